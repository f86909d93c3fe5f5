"""What every data source's arrays go through: shapes, dtypes, labels and class names checked
in one line each, classes training cannot learn said, images resized or given a channel axis,
a tf.data set read into memory."""
import numpy as np
import tensorflow as tf

from tfmulti.errors import DataError, first_line


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
        hint = ("rows of features are not images: tfmulti's data sets are images today"
                if images.ndim == 2 else "a batched tf.data set? give it unbatched"
                if images.ndim == 5 else "more than 4 channels, or a batch of sets?")
        raise DataError(f"{what} images have shape {images.shape}; tfmulti takes [n, height, "
                        f"width] or [n, height, width, channels] ({hint})")
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
            dataset = dataset.map(lambda x, y: (resize_one(x, image_size, dtype), y))
    images, labels = [], []
    try:
        for x, y in dataset.batch(1024).as_numpy_iterator():
            images.append(x)
            labels.append(y)
    except (tf.errors.OpError, ValueError) as e:
        batched = ("; a batched set whose last batch is short? give it unbatched "
                   "(dataset.unbatch())" if "Cannot batch tensors" in str(e) else "")
        raise DataError(f"{what} cannot be read: {first_line(e)}{batched}") from None
    if not images:
        raise DataError(f"--dataset={spec}: {split} split is empty")
    return np.concatenate(images), np.concatenate(labels)


def resize_one(image, size, dtype):
    resized_image = tf.image.resize(image if image.shape.rank == 3 else image[..., None], size)
    if dtype == tf.uint8:
        return tf.cast(tf.clip_by_value(tf.round(resized_image), 0, 255), tf.uint8)
    return tf.cast(resized_image, dtype)
