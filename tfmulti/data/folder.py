"""--dataset=folder:DIR: image files in DIR/train/<class>/ and DIR/test/<class>/; the classes
are the train/ folder names, sorted. The images stay files (ImageFiles), read by the pipeline
batch by batch, so each worker reads only the files of its own slices of the global batches.
Every file is checked before the run (several workers each check their place's part and agree on the
first that does not decode); FIFOs, links out of the folder and non-image files are skipped
and said; an image whose header promises more than MAX_IMAGE_PIXELS is refused before any
decoding."""
import os
import struct

import numpy as np
import tensorflow as tf

from tfmulti.data import checks
from tfmulti.data.dataset import DataSet, Request
from tfmulti.errors import DataError, first_line

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif")


def load(spec: str, request: Request) -> DataSet:
    """--dataset=folder:DIR: its files checked (this worker's request.place of them) and kept
    as files, read as the pipeline needs them; the classes training cannot learn said."""
    source, train, test, classes, skipped = from_folder(spec, request.image_size,
                                                        request.place, request.smallest)
    notes = checks.class_coverage(spec, train[1], test[1], classes, "folder") + skipped
    return DataSet(spec, source, *train, *test, class_names=classes, notes=notes)


def from_folder(spec, image_size, place=(0, 1), smallest=None):
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
                   size, first.shape[2], place, smallest)
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


def check_readable(spec, paths, size, channels, place=(0, 1), smallest=None):
    """Every image file decodes: this worker decodes its part of `paths` (place: index, count),
    smallest(int) -> int agrees across the workers on the first that does not (len(paths):
    none), and every worker raises the same DataError naming it. A single worker checks
    all."""
    index, count = place
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


CHECK_BATCH = 256  # files decoded per call of the check: tf.data's cost per element is more
# than a small image's decoding


def first_unreadable(paths, size, channels):
    """The position in `paths` of the first file that does not decode, or None; decoded in
    parallel batches, nothing kept (a batch that fails is decoded again file by file, in
    order, to name the first)."""
    if not paths:
        return None

    def checked(batch):  # a value of the pixels, so that nothing can prune the decoding
        return tf.map_fn(lambda p: tf.reduce_max(_decode_tensor(tf.io.read_file(p), channels,
                                                                size)),
                         batch, fn_output_signature=tf.uint8)

    dataset = (tf.data.Dataset.from_tensor_slices(paths).batch(CHECK_BATCH)
               .map(checked, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True))
    done = 0
    iterator = iter(checks.untuned(dataset))
    while done < len(paths):
        try:
            done += len(next(iterator))
        except StopIteration:
            break
        except tf.errors.OpError:  # this batch holds a file that does not decode: which one
            for position in range(done, min(done + CHECK_BATCH, len(paths))):
                try:
                    _decode_tensor(tf.io.read_file(paths[position]), channels, size)
                except (tf.errors.OpError, ValueError):
                    return position
            raise
    return None


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
        image = checks.resize_one(image, size, tf.uint8)
    return image


def decode_all(spec, paths, size, channels):
    """uint8 [n, height, width, channels] of the image files, decoded in parallel; the first
    corrupt file is named."""
    dataset = (tf.data.Dataset.from_tensor_slices(paths)
               .map(lambda p: _decode_tensor(tf.io.read_file(p), channels, size),
                    num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
               .batch(1024))
    try:
        return np.concatenate(list(checks.untuned(dataset).as_numpy_iterator()))
    except tf.errors.OpError:
        for path in paths:  # find which one, in order
            _decode(spec, path, channels, size)
        raise
