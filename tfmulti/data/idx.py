"""Fashion-MNIST from a directory of its four canonical IDX files (gzipped or not), each
checked: magic number, dimensions, payload size, label range."""
from __future__ import annotations

import gzip
import math
import os
import struct
import zlib

import numpy as np

from tfmulti.data.dataset import FASHION_MNIST_CLASSES, DataSet
from tfmulti.errors import DataError

IDX_FILES = {
    "train_images": "train-images-idx3-ubyte.gz",
    "train_labels": "train-labels-idx1-ubyte.gz",
    "test_images": "t10k-images-idx3-ubyte.gz",
    "test_labels": "t10k-labels-idx1-ubyte.gz",
}
_IMAGES_MAGIC, _LABELS_MAGIC = 0x00000803, 0x00000801  # unsigned bytes, 3 or 1 dimensions


def _idx_path(data_dir, filename):
    """The canonical .gz name, or the same file uncompressed."""
    path = os.path.join(data_dir, filename)
    if not os.path.exists(path) and os.path.exists(path[:-3]):
        return path[:-3]
    return path


def has_idx_files(data_dir: str) -> bool:
    return any(os.path.exists(_idx_path(data_dir, f)) for f in IDX_FILES.values())


def read_idx(path, magic):
    """The array in one IDX file, checked: magic number, dimensions and payload size."""
    try:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise DataError(f"{path}: missing (expected the four files "
                        f"{', '.join(IDX_FILES.values())})")
    except (OSError, EOFError, zlib.error) as e:
        raise DataError(f"{path}: cannot be read, truncated or corrupt ({e})")
    if len(raw) < 4:
        raise DataError(f"{path}: truncated: {len(raw)} bytes, not even an IDX header")
    (found,) = struct.unpack(">I", raw[:4])
    if found != magic:
        raise DataError(f"{path}: not an IDX {'image' if magic == _IMAGES_MAGIC else 'label'} "
                        f"file (magic number 0x{found:08x}, expected 0x{magic:08x})")
    ndim = magic & 0xFF
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DataError(f"{path}: truncated inside the header")
    dims = struct.unpack(f">{ndim}I", raw[4:header])
    expected = math.prod(dims)
    if len(raw) - header != expected:
        state = "truncated" if len(raw) - header < expected else "longer than its header says"
        raise DataError(f"{path}: {state}: header says {'x'.join(map(str, dims))} "
                        f"({expected} bytes of data), the file holds {len(raw) - header}")
    return np.frombuffer(raw, np.uint8, offset=header).reshape(dims)


def _checked_split(data_dir, images_key, labels_key):
    images_path = _idx_path(data_dir, IDX_FILES[images_key])
    labels_path = _idx_path(data_dir, IDX_FILES[labels_key])
    images = read_idx(images_path, _IMAGES_MAGIC)
    labels = read_idx(labels_path, _LABELS_MAGIC)
    if images.shape[1:] != (28, 28):
        raise DataError(f"{images_path}: images are {images.shape[1]}x{images.shape[2]}, "
                        "Fashion-MNIST's are 28x28")
    if len(images) != len(labels):
        raise DataError(f"{labels_path}: {len(labels)} labels for the {len(images)} images "
                        f"in {images_path}")
    if len(labels) and labels.max() >= len(FASHION_MNIST_CLASSES):
        raise DataError(f"{labels_path}: label {labels.max()} out of range 0-9")
    return images, labels.astype(np.int32)


def load_idx_dir(data_dir: str) -> DataSet:
    """Fashion-MNIST from the four canonical IDX files (gzipped or not) in data_dir."""
    train = _checked_split(data_dir, "train_images", "train_labels")
    test = _checked_split(data_dir, "test_images", "test_labels")
    return DataSet("fashion_mnist", f"IDX files in {data_dir}", *train, *test)
