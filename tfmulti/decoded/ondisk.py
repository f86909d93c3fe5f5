"""Decoded once onto disk: training examples that stay in files (a folder's images, records
read by index) and do not fit in memory decoded once into a file of the user's cache
(~/.cache/tfmulti/decoded, $XDG_CACHE_HOME if set; the rows as they are in memory, nothing
else), which the run maps into memory and reads by index every epoch. Decoding every epoch
takes the cores that also compute; a mapped file is read at about the speed of memory where
the page cache holds it, and the process's memory does not grow with the set.

The file is named by what it holds (the source's files with their sizes and times, which
records, how they are decoded, the example shape), so a later run on the same data reads it
again and a change makes another. It is written under a temporary name and renamed when
whole: a process killed while decoding leaves only its temporary file, which the next run
on this machine removes; a file that does not read whole is decoded again."""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import time
from typing import TYPE_CHECKING

import numpy as np
import tensorflow as tf

from tfmulti import caches
from tfmulti.distribution import storage
from tfmulti.run import usercode

if TYPE_CHECKING:
    from tfmulti.data.dataset import DataSet

DISK_SHARE = 0.5  # of the free space where the cache is that a decoded file may take
CHUNK_BYTES = 8 * 2**20  # decoded examples made and written at a time (at least one)
SYNC_BYTES = 64 * 2**20  # written to disk (and dropped from the page cache) after so many
TEMPORARY = re.compile(r"decoded-[0-9a-f]+\.raw\.tmp-(?P<host>.+)-(?P<pid>\d+)$")


def cache_folder() -> str:
    return caches.folder("decoded")


def identity(features: object) -> str:
    """What the decoded examples of `features` (folder.ImageFiles or records.Records) are
    made of, as a digest: their files (path, size, time), which records of them, how each is
    decoded (your parse function's file too), the example shape and type."""
    files = getattr(features, "files", None)
    parts = {"spec": features.spec, "shape": list(features.shape), "dtype": str(features.dtype)}
    if files is not None:  # records.Records
        paths = files.paths
        parts["records"] = hashlib.sha256(np.asarray(files.file_of, np.int64).tobytes()
                                          + np.asarray(files.ordinals, np.int64).tobytes()
                                          ).hexdigest()
        decode = features.decode
        parts["decode"] = {k: str(v) for k, v in vars(decode).items() if not k.startswith("_")}
        if hasattr(decode, "parse_spec"):
            parts["parse"] = usercode.provenance(decode.parse_spec)["sha256"]
    else:  # folder.ImageFiles: the paths in their order
        paths = [str(p) for p in features.paths]
    stats = []
    for path in paths:
        st = os.stat(path)
        stats.append((os.path.abspath(path), st.st_size, st.st_mtime_ns))
    parts["files"] = hashlib.sha256(json.dumps(stats).encode()).hexdigest()
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


class MappedExamples:
    """Examples decoded into a file of raw rows (`shape`, `dtype`, C order, nothing else),
    mapped into memory: read by index inside the pipeline, array-like for the rest of
    tfmulti (len, shape, dtype, indexing, numpy.asarray, subset). Pickled as its path, shape,
    type and indices."""

    def __init__(self, path: str, shape: tuple, dtype: np.dtype,
                 indices: np.ndarray | None = None):
        self.path, self.indices = path, indices
        self._array = np.memmap(path, dtype=dtype, mode="r", shape=tuple(shape))

    def __len__(self):
        return len(self._array) if self.indices is None else len(self.indices)

    @property
    def shape(self):
        return (len(self), *self._array.shape[1:])

    @property
    def dtype(self):
        return self._array.dtype

    @property
    def ndim(self):
        return self._array.ndim

    def rows(self, picked: np.ndarray) -> np.ndarray:
        picked = np.asarray(picked, np.int64)
        return np.ascontiguousarray(self._array[picked if self.indices is None
                                                else self.indices[picked]])

    def gather_batch(self, indices: tf.Tensor) -> tf.Tensor:
        """The examples at `indices` (a tensor [b]), inside a tf.data map. (TensorFlow's own
        ImmutableConst over the file is faster a batch, but a graph holding it copies the
        whole file into memory, which this file is here to avoid.)"""
        out = tf.numpy_function(self.rows, [indices], tf.as_dtype(self.dtype), stateful=False)
        return tf.ensure_shape(out, [None, *self._array.shape[1:]])

    def subset(self, indices: np.ndarray) -> MappedExamples:
        indices = np.asarray(indices, np.int64)
        return MappedExamples(self.path, self._array.shape, self.dtype,
                              indices if self.indices is None else self.indices[indices])

    def __getitem__(self, key):
        first, rest = (key[0], key[1:]) if isinstance(key, tuple) else (key, ())
        picked = np.arange(len(self))[first]
        out = self.rows(np.atleast_1d(picked))
        out = out if np.ndim(picked) else out[0]
        return out[((slice(None),) if np.ndim(picked) else ()) + rest] if rest else out

    def __array__(self, dtype=None, copy=None):
        out = self.rows(np.arange(len(self)))
        return out if dtype is None else out.astype(dtype)

    def __getstate__(self):
        return {"path": self.path, "shape": self._array.shape, "dtype": self.dtype.str,
                "indices": self.indices}

    def __setstate__(self, state):
        self.__init__(state["path"], state["shape"], np.dtype(state["dtype"]),
                      state["indices"])


def whole(path: str, shape: tuple, dtype: np.dtype) -> MappedExamples | None:
    """The decoded file at `path` if it holds every row (its size is theirs), else None."""
    try:
        size = os.path.getsize(path)
    except OSError:
        return None
    if size != int(np.prod(shape)) * np.dtype(dtype).itemsize:
        return None
    return MappedExamples(path, shape, dtype)


def written(out) -> None:
    """What was written to `out` on disk, and out of the page cache: under a memory cap (a
    container's, a job's cgroup) dirty pages of a file larger than the cap count against
    it."""
    out.flush()
    os.fdatasync(out.fileno())
    os.posix_fadvise(out.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def remove_stale(folder: str) -> None:
    """Removes the temporary files of this machine's processes that are gone (killed while
    they decoded)."""
    host = socket.gethostname()
    for name in os.listdir(folder):
        match = TEMPORARY.match(name)
        if match and match["host"] == host and not _alive(int(match["pid"])):
            try:
                os.remove(os.path.join(folder, name))
            except OSError:
                pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def decoded_file(dataset: DataSet, reader: str = "the run") -> tuple[MappedExamples | None, str]:
    """(the training examples decoded into the cache, or None; the line that says so, or
    why not): read from an earlier run's file where one holds them whole, else decoded now
    (when the file takes at most DISK_SHARE of the free space there)."""
    features, word = dataset.train_features, dataset.example_word
    folder = cache_folder()
    if not caches.own_folder(folder):
        return None, (f"its cache {folder} is not yours alone (another owner, a link, or "
                      "writable by others): nothing is read from it or kept in it")
    path = os.path.join(folder, f"decoded-{identity(features)}.raw")
    found = whole(path, features.shape, features.dtype) if caches.trusted_file(path) else None
    if found is not None:
        return found, (f"{len(features)} training {word} decoded once by an earlier run; "
                       f"{reader} reads them from {path} (mapped into memory)")
    size = int(np.prod(features.shape)) * features.dtype.itemsize
    try:
        os.makedirs(folder, exist_ok=True)
        free = shutil.disk_usage(folder).free
    except OSError as e:
        return None, f"its cache {folder} cannot be made ({e.strerror or e})"
    if size > DISK_SHARE * free:
        return None, (f"decoded, they would take {size / 2**20:.0f} MB, more than "
                      f"{DISK_SHARE:.0%} of the {free / 2**30:.1f} GB free in {folder}")
    remove_stale(folder)
    start = time.perf_counter()
    try:
        chunk = max(1, CHUNK_BYTES // max(1, size // len(features)))
        with storage.replacing(path, permissions=caches.FILE_MODE, named=True) as out:  # (its
            # name says whose it is: remove_stale)
            unsynced = 0
            for first in range(0, len(features), chunk):
                rows = np.ascontiguousarray(features[first:first + chunk], features.dtype)
                out.write(rows.tobytes())
                unsynced += rows.nbytes
                if unsynced >= SYNC_BYTES or first + chunk >= len(features):
                    written(out)
                    unsynced = 0
    except OSError as e:
        return None, f"{path} could not be written ({e.strerror or e})"
    return MappedExamples(path, features.shape, features.dtype), (
        f"{len(features)} training {word} decoded once into {path} ({size / 2**20:.0f} MB, "
        f"{time.perf_counter() - start:.1f} s); {reader} reads them from there (mapped into "
        "memory)")
