"""tensorflow-datasets: Fashion-MNIST (the built-in set, when no IDX files are given) and
any image classification set (--dataset=tfds:NAME), downloaded only when a quick check finds
the download host (tensorflow-datasets itself retries for minutes offline)."""
from __future__ import annotations

import contextlib
import socket
import urllib.parse
from typing import TYPE_CHECKING

import numpy as np
import tensorflow as tf
from absl import logging

from tfmulti.data import checks, records
from tfmulti.data.checks import checked, materialized, resize_one
from tfmulti.data.dataset import DataSet, Request
from tfmulti.data.idx import IDX_FILES
from tfmulti.errors import DataError, first_line

if TYPE_CHECKING:
    import tensorflow_datasets as tfds

TFDS_MIRROR = "https://storage.googleapis.com/"


def check_download_host(url: str, timeout: float = 5.0) -> None:
    """Fails fast when the download host is unreachable (offline, TFDS retries for minutes)."""
    parts = urllib.parse.urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname, port), timeout=timeout).close()
    except OSError as e:
        raise OSError(f"{parts.hostname} is unreachable: {e}") from e


def _split_arrays(dataset):
    images, labels = [], []
    for x, y in checks.untuned(dataset.batch(10000)).as_numpy_iterator():
        images.append(x.reshape(-1, 28, 28))
        labels.append(y.astype(np.int32))
    return np.concatenate(images), np.concatenate(labels)


def download_url(builder: tfds.core.DatasetBuilder) -> str:
    """Where tensorflow-datasets fetches Fashion-MNIST from."""
    return getattr(builder, "URL", "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/")


@contextlib.contextmanager
def quiet_absl():
    before = logging.get_verbosity()
    logging.set_verbosity(logging.ERROR)
    try:
        yield
    finally:
        logging.set_verbosity(before)


def load_tfds(data_dir=None, check_network=check_download_host):
    """Fashion-MNIST through tensorflow-datasets, downloading it into data_dir if needed."""
    import tensorflow_datasets as tfds  # slow to import; only this path needs it

    with quiet_absl():  # "Variant folder ... has no dataset_info.json" before a download
        builder = tfds.builder("fashion_mnist", data_dir=data_dir)
        prepared = builder.is_prepared()
    if not prepared:
        try:
            check_network(download_url(builder))
            builder.download_and_prepare()
        except Exception as e:  # TFDS and requests raise many kinds; all mean "no data"
            reason = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
            raise DataError(
                f"cannot download Fashion-MNIST with tensorflow-datasets (no network? {reason}); "
                f"pass --data_dir=DIR holding the four IDX files ({', '.join(IDX_FILES.values())})"
                ", or use --dataset=synthetic for the offline stand-in") from e
    train, test = (builder.as_dataset(split=s, as_supervised=True) for s in ("train", "test"))
    return DataSet("fashion_mnist", f"tensorflow-datasets ({builder.data_dir})",
                   *_split_arrays(train), *_split_arrays(test))


def named_split(spec, data_dir, split, image_size, flag="--validation_set"):
    """The Records and labels of the prepared set's split `split` (tensorflow-datasets'
    syntax, slices allowed), read as its train and test splits are; DataError naming the
    splits it has for one it does not."""
    import tensorflow_datasets as tfds

    with quiet_absl():
        builder = tfds.builder(spec[len("tfds:"):], data_dir=data_dir)
    return split_examples(spec, builder, split, image_size, f"{flag}={split}")


def _base(split):
    return split.split("[", 1)[0].strip()


def split_examples(spec, builder, split, image_size, what):
    """(features, labels) of `split` of a prepared builder: Records read by index where it
    is prepared as TFRecord or ArrayRecord files (the images stay there), else in memory.
    what: the flag that named the split, as the errors say it."""
    splits = builder.info.splits
    if _base(split) not in splits:
        raise DataError(f"{what}: {spec} has no split {_base(split)!r} (it has: "
                        f"{', '.join(splits)})")
    try:
        instructions = splits[split].file_instructions
    except Exception as e:  # noqa: BLE001 - tfds's slice syntax errors and their kin
        raise DataError(f"{what}: {first_line(e) or type(e).__name__}") from None
    kind = getattr(builder.info.file_format, "value", str(builder.info.file_format))
    if kind not in ("tfrecord", "array_record"):  # riegeli, parquet: read into memory
        return materialized(spec, split, builder.as_dataset(split, as_supervised=True),
                            image_size)
    if not instructions:
        raise DataError(f"{what}: that slice of {spec} holds no example")
    return _records(spec, builder, split, kind, instructions, image_size)


def _records(spec, builder, split, kind, instructions, image_size):
    import tensorflow_datasets as tfds

    features = builder.info.features
    image_key, label_key = builder.info.supervised_keys
    skip = {image_key: tfds.decode.SkipDecoding()}
    files, labels = records.index_files(
        f"--dataset={spec}: its {split} split", kind,
        [(i.filename, i.skip, i.take if i.take not in (None, -1) else None)
         for i in instructions],
        lambda s: tf.cast(features.deserialize_example(s, decoders=skip)[label_key], tf.int32),
        f"tfds {label_key} as int32")

    stored = features[image_key]
    channels = stored.shape[-1] or 3
    size = tuple(image_size or (stored.shape[:2] if None not in stored.shape[:2] else
                                ImageOf(builder.data_dir, image_key, None, channels)(
                                    tf.constant(files.read([0])[0])).shape[:2]))
    return (records.Records(spec, files, ImageOf(builder.data_dir, image_key, size, channels),
                            tf.TensorSpec([*size, channels], stored.tf_dtype)),
            labels.astype(np.int32))


class ImageOf:
    """serialized example -> its image, resized to `size` (None: as stored), of a set
    prepared in `data_dir`; pickled as where the set is (a tuning trial's process reads the
    description again)."""

    def __init__(self, data_dir, image_key, size, channels):
        self.data_dir, self.image_key = str(data_dir), image_key
        self.size, self.channels = (tuple(size) if size else None), channels
        self._features = self._read_features()

    def _read_features(self):
        import tensorflow_datasets as tfds

        with quiet_absl():
            return tfds.builder_from_directory(self.data_dir).info.features

    def __getstate__(self):
        return {**self.__dict__, "_features": None}

    def __setstate__(self, state):  # read here, not while a tf.function traces
        self.__dict__.update(state)
        self._features = self._read_features()

    def __call__(self, serialized):
        picture = self._features.deserialize_example(serialized)[self.image_key]
        if self.size is None:
            return picture
        if tuple(picture.shape[:2]) != self.size:
            picture = resize_one(picture, self.size, picture.dtype)
        return tf.ensure_shape(picture, [*self.size, self.channels])


def eval_split_of(spec, splits, given):
    """The split a run evaluates as its test set: --eval_split, else test, else validation."""
    if given:
        return given
    for name in ("test", "validation"):
        if name in splits:
            return name
    raise DataError(f"--dataset={spec}: no test or validation split (it has: "
                    f"{', '.join(splits)}); name the one to evaluate with --eval_split")


def load(spec: str, request: Request) -> DataSet:
    """--dataset=tfds:NAME: images and class labels by the set's own description, read from
    its files by index where its format allows."""
    source, train, test, classes = from_tfds(spec, request.data_dir, request.image_size,
                                             request.splits)
    notes = checks.class_coverage(spec, train[1], test[1], classes, "given")
    return DataSet(spec, source, *train, *test, class_names=classes, notes=notes,
                   reading=records.reading_line(spec, train[0]))


def from_tfds(spec, data_dir, image_size, splits=("", "")):
    """(source, train, test, class names) of --dataset=tfds:NAME; splits: --train_split and
    --eval_split ("": train, and test or else validation)."""
    import tensorflow_datasets as tfds  # slow to import; only this source needs it

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
            check_download_host(TFDS_MIRROR)
            builder.download_and_prepare()
        except Exception as e:  # noqa: BLE001 - TFDS and requests raise many kinds
            reason = first_line(e) or type(e).__name__
            raise DataError(f"--dataset={spec}: not prepared in {builder.data_dir} and the "
                            f"download failed (no network? {reason}); prepare it where there is "
                            "a network and give --data_dir") from None
    info = builder.info
    if not info.supervised_keys:
        raise DataError(f"--dataset={spec}: no (image, label) pairs (supervised_keys); "
                        "tfmulti trains image classifiers")
    label = info.features[info.supervised_keys[1]]
    if not isinstance(label, tfds.features.ClassLabel):
        raise DataError(f"--dataset={spec}: its label {info.supervised_keys[1]!r} is not a "
                        "class label")
    train_split = splits[0] or "train"
    eval_split = eval_split_of(spec, info.splits, splits[1])
    train = split_examples(spec, builder, train_split, image_size,
                           f"--train_split={train_split}" if splits[0] else f"--dataset={spec}")
    test = split_examples(spec, builder, eval_split, image_size or train[0].shape[1:3],
                          f"--eval_split={eval_split}" if splits[1] else f"--dataset={spec}")
    read = "read from its files by index"
    if not hasattr(train[0], "files"):  # a format read into memory: checked as arrays are
        train, test, _, _ = checked(spec, train, test, tuple(label.names), image_size)
        read = "read into memory"
    return (f"tensorflow-datasets ({builder.data_dir}; {train_split} and {eval_split}, {read})",
            train, test, tuple(label.names))
