"""Your own data: --dataset=MODULE:FUNCTION, folder:DIR or tfds:NAME.

Each becomes a DataSet, like the built-in sets, so it goes through the same pipeline: the
engine shuffles, shards, batches per replica and counts examples by step, and a run resumes
exactly, on any device count, on your data as on Fashion-MNIST. A function's or a tfds set's
images are held in memory; a folder's stay files (ImageFiles), read by the pipeline batch by
batch, so each worker reads only the files of its own slices of the global batches.

- MODULE:FUNCTION: FUNCTION() returns ((x_train, y_train), (x_test, y_test)) numpy arrays, as
  keras.datasets loaders do, optionally with the class names (or count) as a third element;
  or (train, test, classes): finite, unbatched tf.data.Datasets of (image, label).
- folder:DIR: image files in DIR/train/<class>/ and DIR/test/<class>/; the classes are the
  train/ folder names, sorted. Every file is checked before the run (several workers each
  check a share and agree on the first that does not decode).
- tfds:NAME: a tensorflow-datasets image classification set with train and test splits.

Images: uint8 ones are scaled to [0, 1] on their way to the model, float ones are taken as
they are, and [n, height, width] gets a channel axis. --image_size resizes every image; a
folder or tfds set whose images differ in size is resized to its first image's. Everything
a user can get wrong is one line naming the flag, before any run folder is made.
"""
import inspect
import os

import numpy as np
import tensorflow as tf

from tfmulti.errors import DataError, UsageError, first_line
from tfmulti.run import config
from tfmulti.training import usercode

TFDS_MIRROR = "https://storage.googleapis.com/"
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif")
FUNCTION_FORMS = ("((x_train, y_train), (x_test, y_test)) numpy arrays (and optionally the "
                  "class names), or (train_dataset, test_dataset, class names or count)")


def load(spec, data_dir=None, image_size=None, share=(0, 1), smallest=None):
    """The DataSet of --dataset=spec (not a built-in name), images resized to image_size
    ((height, width)) when given. folder:DIR: this worker checks its `share` (index, count)
    of the files, and smallest(int) -> int (a collective across the workers) agrees on the
    first unreadable one."""
    from tfmulti.training import data

    kind = config.dataset_kind(spec)
    if kind == "folder":  # read from the files as the pipeline needs them: well-formed
        source, train, test, classes, skipped = _from_folder(spec, image_size, share, smallest)
        notes = class_coverage(spec, train[1], test[1], classes, "folder") + skipped
        return data.DataSet(spec, source, *train, *test, class_names=classes, notes=notes)
    loader = {"function": _from_function, "tfds": _from_tfds}[kind]
    source, train, test, given = loader(spec, data_dir, image_size)
    train, test, classes = checked(spec, train, test, given, image_size)
    notes = class_coverage(spec, train[1], test[1], classes,
                           "labels" if given is None else "given")
    return data.DataSet(spec, source, *train, *test, class_names=classes, notes=notes)


# ----------------------------------------------------------------------------- checks

def checked(spec, train, test, classes, image_size=None):
    """(train, test, class names) as the pipeline takes them: images uint8 or float32 of one
    shape, labels int32 within the classes; DataError naming what is wrong otherwise."""
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
    for split, (_, labels) in zip(("train", "test"), (train, test)):
        bad = np.flatnonzero((labels < 0) | (labels >= len(names)))
        if bad.size:
            raise DataError(f"--dataset={spec}: {split} label {labels[bad[0]]} (example "
                            f"{bad[0]}) is outside the {len(names)} classes 0-{len(names) - 1}")
    return train, test, names


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
    images, labels = np.asarray(images), np.asarray(labels)
    if images.ndim not in (3, 4) or (images.ndim == 4 and images.shape[-1] > 4):
        raise DataError(f"{what} images have shape {images.shape}; tfmulti takes [n, height, "
                        "width] or [n, height, width, channels] (a batched tf.data set? give "
                        "it unbatched)")
    if images.dtype != np.uint8 and not np.issubdtype(images.dtype, np.floating):
        raise DataError(f"{what} images are {images.dtype}; give uint8 (0-255, scaled to "
                        "[0, 1]) or floats (taken as they are)")
    if labels.ndim == 2 and labels.shape[1] == 1:  # keras.datasets.cifar10's labels
        labels = labels[:, 0]
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise DataError(f"{what} labels are {labels.dtype} of shape {labels.shape}; give one "
                        "integer class index per image (not one-hot)")
    if len(images) != len(labels):
        raise DataError(f"{what} has {len(images)} images and {len(labels)} labels")
    if not len(images):
        raise DataError(f"{what} split is empty")
    if np.issubdtype(images.dtype, np.floating):
        images = images.astype(np.float32, copy=False)
    if image_size and tuple(images.shape[1:3]) != tuple(image_size):
        images = resized(images, image_size)
    return images, labels.astype(np.int32)


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


# ----------------------------------------------------------------------------- MODULE:FUNCTION

def _from_function(spec, data_dir, image_size):
    function = usercode.load_function(spec, "--dataset")
    try:
        inspect.signature(function).bind()
    except TypeError:
        raise UsageError(f"--dataset={spec}: tfmulti calls {spec.split(':')[1]}() without "
                         f"arguments; yours takes {inspect.signature(function)}") from None
    except ValueError:  # no signature to read (a builtin): just call it
        pass
    result = usercode.call(spec, "--dataset", function)
    if isinstance(result, (tuple, list)) and len(result) in (2, 3):
        first, second = result[0], result[1]
        classes = result[2] if len(result) == 3 else None
        if isinstance(first, tf.data.Dataset) and isinstance(second, tf.data.Dataset):
            if classes is None:
                raise DataError(f"--dataset={spec} returned two tf.data sets; return the "
                                "class names or count as a third element")
            train = materialized(spec, "train", first, image_size)
            return f"{spec}() (tf.data)", train, materialized(
                spec, "test", second, image_size or train[0].shape[1:3]), classes
        if all(isinstance(p, (tuple, list)) and len(p) == 2 for p in (first, second)):
            return f"{spec}() (arrays)", first, second, classes
    raise DataError(f"--dataset={spec} returned {_describe(result)}; tfmulti takes "
                    f"{FUNCTION_FORMS}")


def _describe(value):
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)} ({', '.join(type(v).__name__ for v in value[:4])})"
    return f"a {type(value).__name__}"


def materialized(spec, split, dataset, image_size=None):
    """(images, labels) of a finite, unbatched tf.data set of (image, label), in memory;
    images of differing sizes are resized to image_size or the first one's."""
    what = f"--dataset={spec}: the {split} set"
    if int(dataset.cardinality()) == int(tf.data.INFINITE_CARDINALITY):
        raise DataError(f"{what} is endless (a repeat()?); give it finite: tfmulti shuffles, "
                        "repeats and batches it itself")
    element = dataset.element_spec
    if not (isinstance(element, tuple) and len(element) == 2):
        raise DataError(f"{what} gives {element}; tfmulti takes (image, label) pairs")
    shape = element[0].shape
    if shape.rank in (2, 3) and (image_size or not shape[:2].is_fully_defined()):
        if not image_size:
            first = next(iter(dataset.take(1)), None)
            image_size = tuple(first[0].shape[:2]) if first is not None else None
        if image_size:
            dtype = element[0].dtype
            dataset = dataset.map(lambda x, y: (_resize_one(x, image_size, dtype), y))
    images, labels = [], []
    try:
        for x, y in dataset.batch(1024).as_numpy_iterator():
            images.append(x)
            labels.append(y)
    except (tf.errors.OpError, ValueError) as e:
        raise DataError(f"{what} cannot be read: {first_line(e)}") from None
    if not images:
        raise DataError(f"--dataset={spec}: {split} split is empty")
    return np.concatenate(images), np.concatenate(labels)


def _resize_one(image, size, dtype):
    resized_image = tf.image.resize(image if image.shape.rank == 3 else image[..., None], size)
    if dtype == tf.uint8:
        return tf.cast(tf.clip_by_value(tf.round(resized_image), 0, 255), tf.uint8)
    return tf.cast(resized_image, dtype)


# ----------------------------------------------------------------------------- folder:DIR

def _from_folder(spec, image_size, share=(0, 1), smallest=None):
    root = spec[len("folder:"):]
    if not os.path.isdir(root):
        raise DataError(f"--dataset={spec}: {root} is not a directory")
    layout = "folder: takes DIR/train/<class>/ and DIR/test/<class>/ image files"
    splits = {}
    for split in ("train", "test"):
        folder = os.path.join(root, split)
        if not os.path.isdir(folder):
            raise DataError(f"--dataset={spec}: no {split} split: {folder} is missing ({layout})")
        splits[split] = sorted(d for d in os.listdir(folder)
                               if not d.startswith(".") and os.path.isdir(os.path.join(folder, d)))
    classes = splits["train"]
    if not classes:
        raise DataError(f"--dataset={spec}: {os.path.join(root, 'train')} has no class "
                        f"folders ({layout})")
    unknown = sorted(set(splits["test"]) - set(classes))
    if unknown:
        raise DataError(f"--dataset={spec}: test/{unknown[0]} is a class train/ does not have "
                        f"(train's classes: {', '.join(classes)})")
    odd = []  # not regular files, or links out of the folder
    files = {split: image_files(root, split, classes, odd) for split in ("train", "test")}
    others = sorted(os.path.join(split, name, f) for split in ("train", "test")
                    for name in classes if os.path.isdir(os.path.join(root, split, name))
                    for f in os.listdir(os.path.join(root, split, name))
                    if not f.lower().endswith(IMAGE_EXTENSIONS) or f.startswith("."))
    skipped = (f"--dataset={spec}: {len(others)} file{'s' if len(others) > 1 else ''} in the "
               f"class folders {'are' if len(others) > 1 else 'is'} not an image "
               f"({', '.join(IMAGE_EXTENSIONS)}) and skipped: {', '.join(others[:3])}"
               f"{' ...' if len(others) > 3 else ''}",) if others else ()
    if odd:
        skipped += (f"--dataset={spec}: {len(odd)} entr{'ies' if len(odd) > 1 else 'y'} with an "
                    "image's name skipped: not a regular file (a FIFO, a folder) or a link out "
                    f"of the folder: {', '.join(sorted(odd)[:3])}"
                    f"{' ...' if len(odd) > 3 else ''}",)
    for split, found in files.items():
        if not found:
            raise DataError(f"--dataset={spec}: {os.path.join(root, split)} holds no image "
                            f"files ({', '.join(IMAGE_EXTENSIONS)}) in its class folders")
    check_pixels(spec, [files["train"][0][0]])  # decoded next, to learn the size
    first = _decode(spec, files["train"][0][0], None)
    size = tuple(image_size or first.shape[:2])
    images = {split: ImageFiles(spec, [p for p, _ in found], size, first.shape[2])
              for split, found in files.items()}
    check_readable(spec, images["train"].paths.tolist() + images["test"].paths.tolist(),
                   size, first.shape[2], share, smallest)
    loaded = {split: (images[split], np.array([c for _, c in found], np.int32))
              for split, found in files.items()}
    return (f"image files in {root}", loaded["train"], loaded["test"], tuple(classes),
            skipped)


class ImageFiles:
    """The images of a folder, read from their files when the pipeline needs them: each
    worker reads only the files of its own slices of the global batches. Array-like for the
    rest of tfmulti (len, shape, dtype, indexing, numpy.asarray decode what they touch):
    uint8 [n, height, width, channels], every image decoded into the first image's channels
    and resized to one size."""

    dtype = np.dtype(np.uint8)
    ndim = 4

    def __init__(self, spec, paths, size, channels):
        self.spec, self.paths = spec, np.array(paths, dtype=str)
        self.size, self.channels = tuple(int(x) for x in size), int(channels)

    def __len__(self):
        return len(self.paths)

    @property
    def shape(self):
        return (len(self.paths), *self.size, self.channels)

    def read_batch(self, paths):
        """A batch of paths (a string tensor) as uint8 [b, height, width, channels]; inside
        a tf.data map, so the reading happens in the pipeline."""
        spec = tf.TensorSpec([*self.size, self.channels], tf.uint8)
        return tf.map_fn(lambda p: tf.ensure_shape(_decode_tensor(
            tf.io.read_file(p), self.channels, self.size), spec.shape), paths,
            fn_output_signature=spec)

    def __getitem__(self, key):
        first, rest = (key[0], key[1:]) if isinstance(key, tuple) else (key, ())
        picked = np.arange(len(self.paths))[first]
        decoded = decode_all(self.spec, self.paths[np.atleast_1d(picked)].tolist(), self.size,
                             self.channels) if np.size(picked) else np.zeros(
                                 (0, *self.size, self.channels), np.uint8)
        out = decoded if np.ndim(picked) else decoded[0]
        return out[((slice(None),) if np.ndim(picked) else ()) + rest] if rest else out

    def __array__(self, dtype=None, copy=None):
        images = self[:]
        return images if dtype is None else images.astype(dtype)


def check_readable(spec, paths, size, channels, share=(0, 1), smallest=None):
    """Every image file decodes: this worker decodes its share (index, count) of `paths`,
    smallest(int) -> int agrees across the workers on the first that does not (len(paths):
    none), and every worker raises the same DataError naming it. A single worker checks
    all."""
    index, count = share
    mine = np.arange(index, len(paths), count)
    check_pixels(spec, [paths[i] for i in mine])  # before anything is decoded
    bad = first_unreadable([paths[i] for i in mine], size, channels)
    local = int(mine[bad]) if bad is not None else len(paths)
    first = smallest(local) if smallest is not None and count > 1 else local
    if first == len(paths):
        return
    if first == local:
        _decode(spec, paths[first], channels, size)  # raises, with the reason
    raise DataError(f"--dataset={spec}: {paths[first]} is not a readable image (found by "
                    "another worker)")


def first_unreadable(paths, size, channels):
    """The position in `paths` of the first file that does not decode, or None; decoded in
    parallel, nothing kept."""
    if not paths:
        return None
    dataset = (tf.data.Dataset.from_tensor_slices((tf.range(len(paths), dtype=tf.int64), paths))
               # a value of the pixels, so that nothing can prune the decoding (its shape
               # alone is known in advance once resized)
               .map(lambda i, p: (i, tf.reduce_max(_decode_tensor(tf.io.read_file(p),
                                                                   channels, size))),
                    num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
               .ignore_errors())
    read = {int(i) for i, _ in dataset.as_numpy_iterator()}
    missing = [i for i in range(len(paths)) if i not in read]
    return missing[0] if missing else None


def image_files(root, split, classes, skipped=None):
    """[(path, class index)] of root/split/<class>/*, classes in order, files sorted: regular
    files (not a FIFO, which would block the reader, nor a folder named x.png) inside root (a
    symbolic link that leaves the folder is not followed). The others with an image's name
    are appended to `skipped`."""
    found, inside = [], os.path.join(os.path.realpath(root), "")
    for index, name in enumerate(classes):
        folder = os.path.join(root, split, name)
        if not os.path.isdir(folder):
            continue
        for f in sorted(os.listdir(folder)):
            if not f.lower().endswith(IMAGE_EXTENSIONS) or f.startswith("."):
                continue
            path = os.path.join(folder, f)
            if os.path.isfile(path) and os.path.realpath(path).startswith(inside):
                found.append((path, index))
            elif skipped is not None:
                skipped.append(os.path.join(split, name, f))
    return found


# Pillow's limit against decompression bombs: a small file that decodes to gigabytes
MAX_IMAGE_PIXELS = 89_478_485


def pixels_in_header(path):
    """(width, height) from a PNG, GIF, BMP or JPEG file's header, without decoding it;
    None when the header does not say (the decoder then judges the file)."""
    import struct

    try:
        with open(path, "rb") as f:
            head = f.read(1 << 16)
    except OSError:
        return None
    if head[:8] == b"\x89PNG\r\n\x1a\n" and len(head) >= 24:
        return struct.unpack(">II", head[16:24])
    if head[:6] in (b"GIF87a", b"GIF89a") and len(head) >= 10:
        return struct.unpack("<HH", head[6:10])
    if head[:2] == b"BM" and len(head) >= 26:
        width, height = struct.unpack("<ii", head[18:26])
        return abs(width), abs(height)
    if head[:2] == b"\xff\xd8":  # JPEG: the first start-of-frame marker holds the size
        i = 2
        while i + 9 < len(head):
            if head[i] != 0xFF:
                return None
            marker, length = head[i + 1], struct.unpack(">H", head[i + 2:i + 4])[0]
            if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
                height, width = struct.unpack(">HH", head[i + 5:i + 9])
                return width, height
            i += 2 + length
    return None


def check_pixels(spec, paths):
    """DataError naming the first file whose header promises more than MAX_IMAGE_PIXELS."""
    for path in paths:
        size = pixels_in_header(path)
        if size is not None and size[0] * size[1] > MAX_IMAGE_PIXELS:
            raise DataError(f"--dataset={spec}: {path} is {size[0]}x{size[1]} pixels, more than "
                            f"the {MAX_IMAGE_PIXELS:,} tfmulti decodes (a decompression bomb, or "
                            "an image to shrink first)")


def _decode(spec, path, channels, size=None):
    """One image file as uint8 [h, w, c], resized to size when given; DataError if corrupt."""
    try:
        image = _decode_tensor(tf.io.read_file(path), channels or 0, size)
        return image.numpy()
    except (tf.errors.OpError, ValueError) as e:
        raise DataError(f"--dataset={spec}: {path} is not a readable image "
                        f"({first_line(e, 150)})") from None


def _decode_tensor(contents, channels, size):
    image = tf.io.decode_image(contents, channels=channels, expand_animations=False)
    if size is not None:
        image = _resize_one(image, size, tf.uint8)
    return image


def decode_all(spec, paths, size, channels):
    """uint8 [n, height, width, channels] of the image files, decoded in parallel; the first
    corrupt file is named."""
    dataset = (tf.data.Dataset.from_tensor_slices(paths)
               .map(lambda p: _decode_tensor(tf.io.read_file(p), channels, size),
                    num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
               .batch(1024))
    try:
        return np.concatenate(list(dataset.as_numpy_iterator()))
    except tf.errors.OpError:
        for path in paths:  # find which one, in order
            _decode(spec, path, channels, size)
        raise


# ----------------------------------------------------------------------------- tfds:NAME

def _from_tfds(spec, data_dir, image_size):
    import tensorflow_datasets as tfds  # slow to import; only this source needs it

    from tfmulti.training import data
    from tfmulti.training.data import quiet_absl

    name = spec[len("tfds:"):]
    try:
        with quiet_absl():
            builder = tfds.builder(name, data_dir=data_dir)
            prepared = builder.is_prepared()
    except Exception as e:  # noqa: BLE001 - DatasetNotFoundError and its kin
        reason = first_line(e) or type(e).__name__
        raise DataError(f"--dataset={spec}: tensorflow-datasets cannot find it ({reason})"
                        f"{'' if data_dir else '; give --data_dir where it is prepared'}") from None
    if not prepared:
        try:
            # tensorflow-datasets retries for minutes offline; its data sets come from the
            # web and its mirror on Google Cloud Storage: no answer from there, no download
            data.check_download_host(TFDS_MIRROR)
            builder.download_and_prepare()
        except Exception as e:  # noqa: BLE001 - TFDS and requests raise many kinds
            reason = first_line(e) or type(e).__name__
            raise DataError(f"--dataset={spec}: not prepared in {builder.data_dir} and the "
                            f"download failed (no network? {reason}); prepare it where there is "
                            "a network and give --data_dir") from None
    info = builder.info
    missing = [s for s in ("train", "test") if s not in info.splits]
    if missing:
        raise DataError(f"--dataset={spec}: no {missing[0]} split (it has: "
                        f"{', '.join(info.splits)}); tfmulti needs train and test")
    if not info.supervised_keys:
        raise DataError(f"--dataset={spec}: no (image, label) pairs (supervised_keys); "
                        "tfmulti trains image classifiers")
    label = info.features[info.supervised_keys[1]]
    if not isinstance(label, tfds.features.ClassLabel):
        raise DataError(f"--dataset={spec}: its label {info.supervised_keys[1]!r} is not a "
                        "class label")
    train = materialized(spec, "train", builder.as_dataset("train", as_supervised=True),
                         image_size)
    test = materialized(spec, "test", builder.as_dataset("test", as_supervised=True),
                        image_size or train[0].shape[1:3])
    return f"tensorflow-datasets ({builder.data_dir})", train, test, tuple(label.names)
