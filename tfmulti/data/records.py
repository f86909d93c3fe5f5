"""Examples that stay in their files as serialized records (TFRecord or ArrayRecord) and are
read by index. One pass before the run (TensorFlow's reader, which checks every checksum)
finds every record and reads its target; the features stay on disk. The pipeline reads the
records of its own slices of each global batch (pipeline.py), so the stream stays a pure
function of (seed, epoch, step): exact and elastic resume, each worker its own examples.

What that pass finds in a file is kept (~/.cache/tfmulti/index, one small file per record
file and way of reading its targets): a later run on this machine, a resume, the doctor
read it instead of reading the file through. A file changed since (its size, time or
inode) is read through again, and so is one whose kept index does not read whole.
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
import zipfile
from typing import TYPE_CHECKING

import numpy as np
import tensorflow as tf

from tfmulti import caches
from tfmulti.data import checks
from tfmulti.distribution import storage
from tfmulti.errors import DataError, first_line

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

HEADER_BYTES, FOOTER_BYTES = 12, 4  # TFRecord: length (8) and its CRC (4); the data's CRC (4)
SCAN_BATCH = 4096  # records per batch of the indexing pass


class RecordFiles:
    """Where each record of a split is: its file, its place among the file's records
    (ordinals), and its byte offset and length (TFRecord) or its position (ArrayRecord).
    read() gives the serialized records at some indices."""

    def __init__(self, kind: str, paths: Sequence[str], file_of: np.ndarray,
                 where: np.ndarray, lengths: np.ndarray | None = None,
                 ordinals: np.ndarray | None = None):
        self.kind, self.paths = kind, list(paths)
        self.file_of, self.where, self.lengths = file_of, where, lengths
        self.ordinals = where if ordinals is None else ordinals  # ArrayRecord: its position
        self._open, self._lock = {}, threading.Lock()

    def __len__(self):
        return len(self.file_of)

    def subset(self, indices: np.ndarray) -> RecordFiles:
        return RecordFiles(self.kind, self.paths, self.file_of[indices], self.where[indices],
                           None if self.lengths is None else self.lengths[indices],
                           self.ordinals[indices])

    def _handle(self, file):
        with self._lock:  # one handle per file and process, opened when first read
            if file not in self._open:
                path = self.paths[file]
                if self.kind == "tfrecord":
                    self._open[file] = os.open(path, os.O_RDONLY)
                else:
                    from array_record.python.array_record_module import ArrayRecordReader

                    self._open[file] = (ArrayRecordReader(path, "readahead_buffer_size:0"),
                                        threading.Lock())
            return self._open[file]

    def read(self, indices: np.ndarray) -> np.ndarray:
        """The serialized records at `indices` (int64 [b]) as an object array of bytes."""
        indices = np.asarray(indices, np.int64).reshape(-1)
        out = np.empty(len(indices), object)
        if self.kind == "tfrecord":
            for i, index in enumerate(indices):
                out[i] = os.pread(self._handle(int(self.file_of[index])),
                                  int(self.lengths[index]), int(self.where[index]))
            return out
        files = self.file_of[indices]
        for file in np.unique(files):
            mine = np.flatnonzero(files == file)
            reader, lock = self._handle(int(file))
            with lock:
                out[mine] = reader.read([int(p) for p in self.where[indices[mine]]])
        return out

    def __getstate__(self):  # a pickled copy opens its own handles
        return {**self.__dict__, "_open": {}, "_lock": None}

    def __setstate__(self, state):
        self.__dict__.update(state, _lock=threading.Lock())


def index_files(what: str, kind: str, parts: Sequence[tuple[str, int, int | None]],
                target: Callable[[tf.Tensor], tf.Tensor], targets_by: str | None = None
                ) -> tuple[RecordFiles, np.ndarray]:
    """(RecordFiles, targets) of the records [skip, skip + take) of each (path, skip, take)
    of `parts` (take None: to the end), the targets read by target(serialized) -> tensor.
    One pass over the files, or what an earlier pass kept when `targets_by` says how target
    reads them (the same words: the same targets; None: nothing kept); DataError naming the
    file for a record that does not read or whose target does not parse, and for a file
    that holds no record."""
    paths, file_of, where, lengths, ordinals, targets = [], [], [], [], [], []
    for number, (path, skip, take) in enumerate(parts):
        try:
            got_where, got_lengths, got_targets = _kept_scan(kind, path, target, targets_by)
        except (tf.errors.OpError, ValueError, TypeError, RuntimeError, OSError) as e:
            raise DataError(f"{what}: {path} cannot be read: {first_line(e)}") from None
        if not len(got_where):
            raise DataError(f"{what}: {path} holds no record (a shard left empty by a failed "
                            "write?); remove it or write it again")
        end = None if take is None else skip + take
        paths.append(path)
        file_of.append(np.full(len(got_where[skip:end]), number, np.int32))
        where.append(got_where[skip:end])
        lengths.append(got_lengths[skip:end])
        ordinals.append(np.arange(len(got_where), dtype=np.int64)[skip:end])
        targets.append(got_targets[skip:end])
    files = RecordFiles(kind, paths, np.concatenate(file_of), np.concatenate(where),
                        np.concatenate(lengths) if kind == "tfrecord" else None,
                        np.concatenate(ordinals))
    return files, np.concatenate(targets)


INDEX_VERSION = 1  # of the kept index's layout: another version is read through again


def kept_index_path(kind: str, path: str, targets_by: str) -> str:
    """The file that keeps the index of record file `path` as it is now (its size, time and
    inode), its targets read as `targets_by` says."""
    st = os.stat(path)
    key = json.dumps([INDEX_VERSION, kind, os.path.abspath(path), st.st_size, st.st_mtime_ns,
                      st.st_ctime_ns, st.st_ino, targets_by, tf.__version__])
    return os.path.join(caches.folder("index"),
                        f"index-{hashlib.sha256(key.encode()).hexdigest()[:24]}.npz")


def _kept_scan(kind, path, target, targets_by):
    """(where, lengths, targets) of every record of one file: kept from an earlier scan, or
    scanned now (and kept, where the cache can be written: a cache that cannot is no
    reason to stop)."""
    scan = _scan_tfrecord if kind == "tfrecord" else _scan_array_record
    if targets_by is None:
        return scan(path, target)
    kept = kept_index_path(kind, path, targets_by)
    if not caches.own_folder(os.path.dirname(kept)):  # a cache others may write: not used
        return scan(path, target)
    try:
        if caches.trusted_file(kept):  # yours alone (what another user planted: not read)
            with np.load(kept, allow_pickle=False) as got:
                found = got["where"], got["lengths"], got["targets"]
            if len(found[0]) == len(found[1]) == len(found[2]) > 0 and _fits(kind, path, found):
                return found
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
        pass  # none kept yet, or spoiled on disk: read through again
    found = scan(path, target)
    try:  # whole or not at all; several writers: the same content (a cache shared by
        # machines, a home on NFS: their processes' names apart; a link planted there: not
        # kept, not followed)
        os.makedirs(os.path.dirname(kept), exist_ok=True)
        with storage.replacing(kept, permissions=caches.FILE_MODE, named=True) as f:
            np.savez(f, where=found[0], lengths=found[1], targets=found[2])
    except OSError:
        pass
    return found


def _fits(kind, path, found):
    """Whether a kept index describes the file as it is: a TFRecord file's records end to
    end from its start to its end, each where its length puts it; an ArrayRecord file's
    positions are 0, 1, ..."""
    where, lengths = (np.asarray(a, np.int64) for a in found[:2])
    if kind != "tfrecord":
        return bool(np.array_equal(where, np.arange(len(where))))
    ends = np.cumsum(HEADER_BYTES + lengths + FOOTER_BYTES)
    return bool(np.all(lengths >= 0) and np.array_equal(where, ends - lengths - FOOTER_BYTES)
                and ends[-1] == os.path.getsize(path))


def _scan_tfrecord(path, target):
    """(data offsets, lengths, targets) of every record of a TFRecord file."""
    data = tf.data.TFRecordDataset(path).map(
        lambda s: (tf.cast(tf.strings.length(s), tf.int64), target(s)),
        num_parallel_calls=tf.data.AUTOTUNE, deterministic=True).batch(SCAN_BATCH)
    lengths, targets = [np.zeros(0, np.int64)], []
    for got_lengths, got_targets in checks.untuned(data).as_numpy_iterator():
        lengths.append(got_lengths)
        targets.append(got_targets)
    lengths = np.concatenate(lengths)
    starts = np.cumsum(HEADER_BYTES + lengths + FOOTER_BYTES) - lengths - FOOTER_BYTES
    return starts, lengths, np.concatenate(targets) if targets else np.zeros(0)


def _scan_array_record(path, target):
    """(positions, None, targets) of every record of an ArrayRecord file."""
    files = RecordFiles("array_record", [path], np.zeros(0, np.int32), np.zeros(0, np.int64))
    count = files._handle(0)[0].num_records()
    files.file_of, files.where = np.zeros(count, np.int32), np.arange(count, dtype=np.int64)
    data = (tf.data.Dataset.range(0, count, SCAN_BATCH)
            .map(lambda start: tf.numpy_function(
                lambda s: files.read(np.arange(s, min(s + SCAN_BATCH, count))), [start],
                tf.string, stateful=False))
            .unbatch().map(target, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
            .batch(SCAN_BATCH))
    targets = list(checks.untuned(data).as_numpy_iterator())
    return files.where, np.zeros(count, np.int64), (np.concatenate(targets) if targets
                                                     else np.zeros(0))


class Records:
    """The features of a split's records, read and decoded when the pipeline needs them.
    Array-like for the rest of tfmulti (len, shape, dtype, indexing and numpy.asarray read
    and decode what they touch). decode(serialized) -> one example's features, of `element`
    (a tf.TensorSpec)."""

    def __init__(self, spec: str, files: RecordFiles, decode: Callable[[tf.Tensor], tf.Tensor],
                 element: tf.TensorSpec):
        self.spec, self.files, self.decode, self.element = spec, files, decode, element

    def __len__(self):
        return len(self.files)

    @property
    def shape(self):
        return (len(self.files), *self.element.shape)

    @property
    def dtype(self):
        return np.dtype(self.element.dtype.as_numpy_dtype)

    @property
    def ndim(self):
        return 1 + self.element.shape.rank

    def subset(self, indices: np.ndarray) -> Records:
        return Records(self.spec, self.files.subset(indices), self.decode, self.element)

    def gather_batch(self, indices: tf.Tensor) -> tf.Tensor:
        """The features of the records at `indices` (a tensor [b]), inside a tf.data map."""
        serialized = tf.numpy_function(self.files.read, [indices], tf.string, stateful=False)
        serialized = tf.reshape(serialized, tf.shape(indices))
        return tf.map_fn(self.decode, serialized, fn_output_signature=self.element)

    def __getitem__(self, key):
        first, rest = (key[0], key[1:]) if isinstance(key, tuple) else (key, ())
        picked = np.arange(len(self.files))[first]
        chosen = np.atleast_1d(picked)
        decoded = (self.gather_batch(tf.constant(chosen, tf.int64)).numpy() if chosen.size
                   else np.zeros((0, *self.element.shape), self.dtype))
        out = decoded if np.ndim(picked) else decoded[0]
        return out[((slice(None),) if np.ndim(picked) else ()) + rest] if rest else out

    def __array__(self, dtype=None, copy=None):
        features = np.concatenate([self[start:start + SCAN_BATCH]
                                   for start in range(0, max(len(self), 1), SCAN_BATCH)])
        return features if dtype is None else features.astype(dtype)


def reading_line(spec: str, features: object) -> str:
    """The line a run says first of features read from their files by index ('' else)."""
    if not hasattr(features, "files"):
        return ""
    count = len(features.files.paths)
    return (f"--dataset={spec}: read by index from {count} training file"
            f"{'s' if count > 1 else ''}: each worker reads only its own slices of each global "
            "batch, whatever the number of files and workers; a resumed run continues exactly, "
            "on any replica or worker count")
