"""What every data source's arrays go through: shapes, dtypes, labels and class names checked
in one line each, classes training cannot learn said, images resized or given a channel axis,
a tf.data set read into memory. Features that are not images (rows of numbers, token ids, a
dict of named inputs) and targets that are not class ids (floats, multi-hot rows, masks, one
per output) are checked for what any model needs: numbers, one length, the same structure in
train and test."""
import numpy as np
import tensorflow as tf

from tfmulti.data.dataset import example_count, structure_text
from tfmulti.errors import DataError, first_line


def untuned(dataset: tf.data.Dataset) -> tf.data.Dataset:
    """`dataset` without tf.data's autotuning: freeing an iterator that autotunes can wait up
    to a minute for its tuning thread (tfprivate.no_autotuning_on_devices says why). tf.data
    then runs each parallel map with min(16, cores) calls; the values are the same."""
    options = tf.data.Options()
    options.autotune.enabled = False
    return dataset.with_options(options)


def checked(spec, train, test, classes, image_size=None, as_given=False):
    """(train, test, class names, images) as the pipeline takes them: images uint8 or
    float32 of one shape with int32 labels within the classes, or (images False) features
    and targets of any structure of numbers; DataError naming what is wrong otherwise.
    as_given: the features are never taken for images (your model takes them as they are,
    uint8 kept uint8, as model.fit gives them). test None: no test part (the train part
    checked alone; test None returned)."""
    if test is None:  # fit(x, y) with no validation: nothing to test
        train, _, names = _any_task(spec, train, train, classes, keep_uint8=as_given)
        return train, None, names, False
    if train[1] is None or test[1] is None:  # features alone: fit(x) with no y
        return (*_any_task(spec, train, test, classes, keep_uint8=as_given), False)
    images = not as_given and looks_like_images(*train) and looks_like_images(*test)
    if not (images and is_class_ids(_squeezed(train[1])) and is_class_ids(_squeezed(test[1]))):
        return (*_any_task(spec, train, test, classes, image_size if images else False,
                           keep_uint8=as_given), images)
    train = _split(spec, "train", *train, image_size)
    test = _split(spec, "test", *test, image_size)
    shapes = [_image_shape(images) for images in (train[0], test[0])]
    if shapes[0] != shapes[1]:
        raise DataError(f"--dataset={spec}: train images are {_shape_text(shapes[0])}, test "
                        f"images {_shape_text(shapes[1])}; give --image_size=HxW to resize "
                        "both" if shapes[0][2] == shapes[1][2] else
                        f"--dataset={spec}: train images have {shapes[0][2]} channels, test "
                        f"images {shapes[1][2]}")
    names = _class_names(spec, classes, train[1], test[1])
    _check_label_range(spec, names, train, test)
    return train, test, names, True


def none_of(features):
    """No example of `features` (an array, or a dict / tuple of them)."""
    if isinstance(features, dict):
        return {name: none_of(value) for name, value in features.items()}
    if isinstance(features, (tuple, list)):
        return tuple(none_of(value) for value in features)
    return np.asarray(features)[:0]


def weights_apart(spec: str, split: str, part: tuple) -> tuple[tuple, np.ndarray | None]:
    """((features, targets), the weights or None) of a part your function returned as
    (features, targets) or (features, targets, sample_weight), as fit takes them; the
    weights float32 [n], each finite and 0 or more (DataError naming the first that is not)."""
    if len(part) == 2:
        return tuple(part), None
    features, targets, weights = part
    if targets is None:
        raise DataError(f"--dataset={spec}: the {split} part has sample weights and no "
                        "targets; weights weigh a loss of targets (an add_loss model weighs "
                        "its own losses)")
    try:
        weights = np.asarray(weights, np.float32)
    except (TypeError, ValueError):
        raise DataError(f"--dataset={spec}: the {split} sample weights are "
                        f"{type(weights).__name__}; give one number per example") from None
    count = example_count(features)
    if weights.ndim == 2 and weights.shape[1] == 1:
        weights = weights[:, 0]
    if weights.shape != (count,):
        raise DataError(f"--dataset={spec}: the {split} sample weights are "
                        f"{_shape_text(weights.shape)}; give one per example, [{count}]")
    bad = np.flatnonzero(~np.isfinite(weights) | (weights < 0))
    if bad.size:
        raise DataError(f"--dataset={spec}: {split} sample weight {weights[bad[0]]:g} (example "
                        f"{bad[0]}) is not a finite number of 0 or more")
    return (features, targets), weights


def classes_of_labels(spec: str, train_labels: np.ndarray, test_labels: np.ndarray
                      ) -> tuple[str, ...]:
    """The class names ("0" ... the largest label) of class ids read from files, every label
    checked to be one (DataError naming the first that is not)."""
    names = _class_names(spec, None, train_labels, test_labels)
    _check_label_range(spec, names, (None, train_labels), (None, test_labels))
    return names


def _check_label_range(spec, names, train, test):
    for split, (_, labels) in zip(("train", "test"), (train, test)):
        bad = np.flatnonzero((labels < 0) | (labels >= len(names)))
        if bad.size:
            raise DataError(f"--dataset={spec}: {split} label {labels[bad[0]]} (example "
                            f"{bad[0]}) is outside the {len(names)} classes 0-{len(names) - 1}")


def looks_like_images(features, targets):
    """Images: one array [n, h, w] or [n, h, w, c <= 4] of uint8 (scaled to [0, 1] on the way
    to the model, whatever the targets), or of other numbers with one class id each (floats
    taken as they are; other integers refused). Anything else is features of your own task,
    taken as they are (float32, int32)."""
    if isinstance(features, (dict, tuple, list)):
        return False
    features = np.asarray(features)
    if features.ndim not in (3, 4) or (features.ndim == 4 and features.shape[-1] > 4):
        return False
    return features.dtype == np.uint8 or is_class_ids(_squeezed(targets))


def _squeezed(targets):
    """keras.datasets' (n, 1) labels as (n,)."""
    if isinstance(targets, (dict, tuple, list)):
        return targets
    targets = np.asarray(targets)
    if targets.ndim == 2 and targets.shape[1] == 1 and np.issubdtype(targets.dtype, np.integer):
        return targets[:, 0]
    return targets


def is_class_ids(targets: object) -> bool:
    """One integer per example: class indices."""
    return (not isinstance(targets, (dict, tuple, list)) and np.asarray(targets).ndim == 1
            and np.issubdtype(np.asarray(targets).dtype, np.integer))


def _any_task(spec, train, test, classes, image_size=False, keep_uint8=False):
    """(train, test, class names) of features and targets that are not images with class
    ids: every leaf a numeric array, float32 or int32, of one length per split; train and
    test of one structure. Class ids (one integer per example) keep their classes.
    image_size False: the features are not images; else they are, resized to it (None:
    kept). keep_uint8: uint8 features stay uint8 (else int32)."""
    splits = []
    for split, (features, targets) in zip(("train", "test"), (train, test)):
        what = f"--dataset={spec}: {split}"
        features = (_numeric(f"{what} features", features, named=True, keep_uint8=keep_uint8)
                    if image_size is False
                    else _image_array(what, features, image_size))
        if (targets is None) is not (train[1] is None):
            raise DataError(f"--dataset={spec}: the train split has "
                            f"{'no ' if train[1] is None else ''}targets, the test split "
                            f"{'none' if targets is None else 'has'}; give both or neither")
        if targets is not None:
            targets = _numeric(f"{what} targets", _squeezed(targets), named=True)
        lengths = {len(a) for a in tf.nest.flatten(features if targets is None
                                                   else (features, targets))}
        if len(lengths) > 1:
            counts = ", ".join(map(str, sorted(lengths)))
            raise DataError(f"{what} has arrays of different lengths ({counts}): "
                            f"features {structure_text(features)}, targets "
                            f"{structure_text(targets)}")
        if not lengths.pop():
            raise DataError(f"{what} split is empty")
        splits.append((features, targets))
    for part, index in (("features", 0), ("targets", 1)):
        if splits[0][index] is not None and _form(splits[0][index]) != _form(splits[1][index]):
            raise DataError(f"--dataset={spec}: train {part} are {structure_text(splits[0][index])}"
                            f", test {part} {structure_text(splits[1][index])}; give both the "
                            "same names, shapes and dtypes")
    names = ()
    if splits[0][1] is not None and is_class_ids(splits[0][1]):
        names = _class_names(spec, classes, splits[0][1], splits[1][1])
        _check_label_range(spec, names, *splits)
    elif classes is not None:
        names = _class_names(spec, classes, np.zeros(1, np.int32))
    return splits[0], splits[1], names


def _numeric(what, arrays, named=False, keep_uint8=False):
    """arrays (an array, or a dict / tuple of them) as float32 or int32 numpy arrays (uint8
    kept with keep_uint8)."""
    if isinstance(arrays, dict):
        if not all(isinstance(k, str) for k in arrays):
            raise DataError(f"{what}: a dict's keys are the model's input or output names; give "
                            "strings")
        return {k: _numeric(f"{what} {k!r}", v, keep_uint8=keep_uint8) for k, v in arrays.items()}
    if isinstance(arrays, (tuple, list)) and named:
        return tuple(_numeric(f"{what} {i}", v, keep_uint8=keep_uint8)
                     for i, v in enumerate(arrays))
    array = np.asarray(arrays)
    if keep_uint8 and array.dtype == np.uint8:
        return array
    if array.dtype == bool:
        return array.astype(np.float32)
    if np.issubdtype(array.dtype, np.floating):
        return array.astype(np.float32, copy=False)
    if np.issubdtype(array.dtype, np.integer):
        if array.size and (array.max() > np.iinfo(np.int32).max or
                           array.min() < np.iinfo(np.int32).min):
            raise DataError(f"{what}: integers beyond int32 ({array.min()} to {array.max()})")
        return array.astype(np.int32, copy=False)
    raise DataError(f"{what} are {array.dtype} of shape {array.shape}; give numbers (text as "
                    "token ids, for example from keras.layers.TextVectorization)")


def _form(arrays):
    """The structure, shapes past the first axis and dtypes: what train and test share."""
    if isinstance(arrays, dict):
        return {k: _form(v) for k, v in arrays.items()}
    if isinstance(arrays, tuple):
        return tuple(_form(v) for v in arrays)
    return (arrays.shape[1:], arrays.dtype.name)


def class_coverage(spec, train_labels, test_labels, names, counted):
    """The lines to say before the first step about classes training cannot learn, () when
    there are none; DataError when train and test have no class in common (the test accuracy
    could only be 0). counted: where the classes came from, "labels" (the largest label
    + 1), "folder" (train/'s folders) or "given" (your function's names or count: then a
    class without examples is yours to declare, and only the disjoint sets are refused)."""
    trained, tested = np.unique(train_labels), np.unique(test_labels)
    if not np.intersect1d(trained, tested).size:
        raise DataError(f"--dataset={spec}: train and test have no class in common (train "
                        f"labels {_ranges(trained)}, test labels {_ranges(tested)}); the test "
                        "accuracy could only be 0")
    empty = np.setdiff1d(np.arange(len(names)), trained)
    if counted == "given" or not empty.size:
        return ()
    unseen = int(np.isin(test_labels, empty).sum())
    where = (f"folder{'s' if empty.size > 1 else ''} "
             f"{', '.join('train/' + names[i] + '/' for i in empty[:5])}"
             f"{' ...' if empty.size > 5 else ''} hold{'s' if empty.size == 1 else ''} no image"
             if counted == "folder" else
             f"labels {_ranges(empty)} have no training example (the {len(names)} classes "
             f"are counted from the largest label, {len(names) - 1})")
    return (f"--dataset={spec}: {empty.size} of the {len(names)} classes cannot be learned: "
            f"{where}" + (f"; {unseen} test examples are of those classes" if unseen else ""),)


def _ranges(ids):
    """'0-9, 12, 20-29' of sorted distinct integers."""
    parts, ids = [], [int(i) for i in ids]
    for i in ids:
        if parts and i == parts[-1][1] + 1:
            parts[-1][1] = i
        else:
            parts.append([i, i])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in parts)


def _split(spec, split, images, labels, image_size):
    what = f"--dataset={spec}: {split}"
    images, labels = _image_array(what, images, image_size), np.asarray(labels)
    if labels.ndim == 2 and labels.shape[1] == 1:  # keras.datasets.cifar10's labels
        labels = labels[:, 0]
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise DataError(f"{what} labels are {labels.dtype} of shape {labels.shape}; give one "
                        "integer class index per image (not one-hot)")
    if len(images) != len(labels):
        raise DataError(f"{what} has {len(images)} images and {len(labels)} labels")
    if not len(images):
        raise DataError(f"{what} split is empty")
    return images, labels.astype(np.int32)


def _image_array(what, images, image_size):
    """images as the pipeline takes them: uint8 or float32, resized to image_size."""
    images = np.asarray(images)
    if images.ndim not in (3, 4) or (images.ndim == 4 and images.shape[-1] > 4):
        raise DataError(f"{what} images have shape {images.shape}; tfmulti takes [n, height, "
                        "width] or [n, height, width, channels <= 4]")
    if images.dtype != np.uint8 and not np.issubdtype(images.dtype, np.floating):
        raise DataError(f"{what} images are {images.dtype}; give uint8 (0-255, scaled to "
                        "[0, 1]) or floats (taken as they are)")
    if np.issubdtype(images.dtype, np.floating):
        images = images.astype(np.float32, copy=False)
    if image_size and tuple(images.shape[1:3]) != tuple(image_size):
        images = resized(images, image_size)
    return images


def _image_shape(images):
    return (*images.shape[1:3], images.shape[3] if images.ndim == 4 else 1)


def _shape_text(shape):
    return "x".join(map(str, shape))


def _class_names(spec, classes, *labels):
    if classes is None:
        return tuple(str(i) for i in range(int(max(y.max() for y in labels)) + 1))
    if isinstance(classes, (int, np.integer)) and not isinstance(classes, bool):
        if classes < 1:
            raise DataError(f"--dataset={spec}: {classes} classes; give at least 1")
        return tuple(str(i) for i in range(int(classes)))
    if (isinstance(classes, (list, tuple)) and classes
            and all(isinstance(c, str) for c in classes)):
        if len(set(classes)) != len(classes):
            raise DataError(f"--dataset={spec}: the class names repeat a name")
        return tuple(classes)
    raise DataError(f"--dataset={spec}: the classes are {classes!r}; give their count or "
                    "their names (a list of strings)")


def resized(images, size):
    """images [n, h, w(, c)] resized to size (height, width), in their dtype."""
    out = []
    for start in range(0, len(images), 4096):
        chunk = tf.image.resize(_with_channel(images[start:start + 4096]), size).numpy()
        out.append(np.clip(np.round(chunk), 0, 255).astype(np.uint8)
                   if images.dtype == np.uint8 else chunk.astype(np.float32))
    return np.concatenate(out)


def _with_channel(images):
    return images[..., None] if images.ndim == 3 else images


def materialized(spec, split, dataset, image_size=None, as_given=False):
    """(features, targets) of a finite, unbatched tf.data set of (features, targets) pairs of
    any structure, in memory; images (one tensor of rank 2 or 3) of differing sizes are
    resized to image_size or the first one's (as_given: never; your model takes them as
    they are, so they must be of one shape)."""
    what = f"--dataset={spec}: the {split} set"
    if int(dataset.cardinality()) == int(tf.data.INFINITE_CARDINALITY):
        raise DataError(f"{what} is endless (a repeat()?); give it finite: tfmulti shuffles, "
                        "repeats and batches it itself")
    element = dataset.element_spec
    if not (isinstance(element, tuple) and len(element) == 2):
        raise DataError(f"{what} gives {element}; tfmulti takes (features, target) pairs")
    if not tf.nest.is_nested(element[0]):
        shape = element[0].shape
        if shape.rank == 4 and shape[0] is None:
            raise DataError(f"{what} gives batches of images, {shape}: a batched set? give it "
                            "unbatched (dataset.unbatch())")
        if not as_given and shape.rank in (2, 3) and (image_size or
                                                      not shape[:2].is_fully_defined()):
            if not image_size:
                first = next(iter(untuned(dataset.take(1))), None)
                image_size = tuple(first[0].shape[:2]) if first is not None else None
            if image_size:
                dtype = element[0].dtype
                dataset = dataset.map(lambda x, y: (resize_one(x, image_size, dtype), y))
    parts = []
    try:
        parts = list(untuned(dataset.batch(1024)).as_numpy_iterator())
    except (tf.errors.OpError, ValueError) as e:
        batched = ("" if "Cannot batch tensors" not in str(e) else
                   "; examples of differing shapes: your model takes them as your function "
                   "gives them, so give them one shape (resize or pad them there)" if as_given
                   else "; a batched set whose last batch is short? give it unbatched "
                   "(dataset.unbatch())")
        raise DataError(f"{what} cannot be read: {first_line(e)}{batched}") from None
    if not parts:
        raise DataError(f"--dataset={spec}: {split} split is empty")
    return tf.nest.map_structure(lambda *arrays: np.concatenate(arrays), *parts)


def resize_one(image, size, dtype):
    resized_image = tf.image.resize(image if image.shape.rank == 3 else image[..., None], size)
    if dtype == tf.uint8:
        return tf.cast(tf.clip_by_value(tf.round(resized_image), 0, 255), tf.uint8)
    return tf.cast(resized_image, dtype)
