"""A data set as every source gives it and the pipelines read it: its features (images in
memory or a folder's files; or any arrays: rows of numbers, token ids, a dict of named
inputs), its targets (class ids; or floats, multi-hot rows, masks, one array per output),
class names (for class ids) and what to say of it."""
import dataclasses
import typing

import numpy as np

from tfmulti.data import synthetic

FASHION_MNIST_CLASSES = synthetic.CLASS_NAMES  # the same ten names, in the same order


@dataclasses.dataclass(frozen=True, eq=False)
class DataSet:
    name: str  # --dataset: one of DATASETS or your own (sources.py)
    source: str  # where the examples came from, for reports
    # images [n, height, width(, channels)] uint8 0-255 or float32 (or a folder's files); or,
    # when images is False, any array [n, ...] or a dict {input name: array [n, ...]}
    train_features: np.ndarray
    # int32 [n] class indices; or any array [n, ...], or a dict/tuple of them (one per output)
    train_targets: np.ndarray
    test_features: np.ndarray
    test_targets: np.ndarray
    class_names: tuple = FASHION_MNIST_CLASSES  # () when the targets are not class ids
    notes: tuple = ()  # lines to say before the first step (classes training cannot learn)
    images: bool = True  # the features are images: uint8 scaled to [0, 1], a channel added
    # images given to your model as your function returns them (images False): counted as
    # images in reports
    images_as_given: bool = False
    validation: tuple = None  # (features, targets) of a named split (--validation_set)
    # how the examples are read, when not from memory, or taken as given (said before a run)
    reading: str = ""
    # float32 [n] each example's weight, as your function returned them ((x, y, weight), as
    # fit's sample_weight), or None
    train_weights: object = None
    test_weights: object = None

    @property
    def input_shape(self):
        """What the model sees of one example: (height, width, channels) for images; else
        the shape of one example, or {input name: shape} for named inputs."""
        if not self.images:
            return _each(self.train_features, lambda a: tuple(a.shape[1:]))
        shape = self.train_features.shape
        return (*shape[1:3], shape[3] if len(shape) == 4 else 1)

    @property
    def image_dtype(self):
        """uint8 (0-255, scaled to [0, 1] for the model) or float32 (taken as it is); for
        other features their dtype (or {input name: dtype})."""
        return _each(self.train_features, lambda a: a.dtype.name)

    @property
    def num_classes(self):
        """The number of classes; 0 when the targets are not class ids."""
        return len(self.class_names)

    @property
    def train_size(self):
        return example_count(self.train_features)

    @property
    def test_size(self):
        return example_count(self.test_features)

    @property
    def example_word(self):
        """What reports count: images, or examples (a series [n, steps, 1] your model takes
        as given is not counted in images 1 pixel wide)."""
        return ("images" if self.images or (self.images_as_given
                                            and image_shaped(self.train_features))
                else "examples")

    @property
    def display_name(self):
        """The name every report shows; synthetic figures must never pass for Fashion-MNIST."""
        if self.name == "synthetic":
            return "synthetic Fashion-like data (not Fashion-MNIST)"
        if self.name == "fashion_mnist":
            return "Fashion-MNIST"
        return self.name


@dataclasses.dataclass(frozen=True)
class Request:
    """What a run asks of a source besides its --dataset value (sources.load)."""
    data_dir: str | None = None  # --data_dir: where a built-in or tfds: set is kept
    image_size: tuple[int, int] | None = None  # (height, width): every image resized to it
    # (index, count) of this worker among those that check a folder's files, and
    # smallest(int) -> int, a collective across them that agrees on the first unreadable one
    place: tuple[int, int] = (0, 1)
    smallest: typing.Callable[[int], int] | None = None
    splits: tuple[str, str] = ("", "")  # --train_split, --eval_split ("": the set's own)
    parse: str = ""  # --parse=MODULE:FUNCTION of TFRecord files
    # RunConfig.features_as_given: your function's features as it returns them, never taken
    # for images
    as_given: bool = False
    synthetic_sizes: tuple[int, int] = (60000, 10000)  # the synthetic set's train and test
    seed: int = 0  # the synthetic set's


def _each(features, value):
    if isinstance(features, dict):
        return {name: value(array) for name, array in features.items()}
    if isinstance(features, (tuple, list)):  # inputs in the model's order
        return tuple(value(array) for array in features)
    return value(features)


MAX_IMAGE_ASPECT = 8  # an image's long side over its short one (panoramas: about 4)


def image_shaped(features: np.ndarray) -> bool:
    """[n, h, w(, c)] whose long side is at most MAX_IMAGE_ASPECT times its short one: an
    image's shape, not a series' [n, steps, 1] or [n, steps, a few values]."""
    sides = np.shape(features)[1:3]
    return len(sides) == 2 and 0 < max(sides) <= MAX_IMAGE_ASPECT * min(sides)


def example_count(arrays: object) -> int:
    """The examples in an array, a folder's images, or a dict / tuple of arrays."""
    while isinstance(arrays, (dict, tuple)):
        arrays = next(iter(arrays.values())) if isinstance(arrays, dict) else arrays[0]
    return len(arrays)


def structure_text(arrays: object) -> str:
    """'float32 [n, 8]' of an array, '{age: float32 [n], words: int32 [n, 20]}' of a dict,
    '(..., ...)' of a tuple: what run.json and the errors say of features and targets."""
    if isinstance(arrays, dict):
        return "{" + ", ".join(f"{k}: {structure_text(v)}" for k, v in arrays.items()) + "}"
    if isinstance(arrays, (tuple, list)):
        return "(" + ", ".join(structure_text(v) for v in arrays) + ")"
    shape = ", ".join(["n", *map(str, np.shape(arrays)[1:])])
    return f"{np.asarray(arrays[:0]).dtype.name} [{shape}]"
