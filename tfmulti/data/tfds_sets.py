"""tensorflow-datasets: Fashion-MNIST (the built-in set, when no IDX files are given) and
any image classification set (--dataset=tfds:NAME), downloaded only when a quick check finds
the download host (tensorflow-datasets itself retries for minutes offline)."""
from __future__ import annotations

import contextlib
import socket
import urllib.parse
from typing import TYPE_CHECKING

import numpy as np

from tfmulti.data.checks import materialized
from tfmulti.data.dataset import DataSet
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
    for x, y in dataset.batch(10000).as_numpy_iterator():
        images.append(x.reshape(-1, 28, 28))
        labels.append(y.astype(np.int32))
    return np.concatenate(images), np.concatenate(labels)


def download_url(builder: tfds.core.DatasetBuilder) -> str:
    """Where tensorflow-datasets fetches Fashion-MNIST from."""
    return getattr(builder, "URL", "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/")


@contextlib.contextmanager
def quiet_absl():
    from absl import logging

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


def named_split(spec, data_dir, split, image_size):
    """(images, labels) of the prepared set's split `split` (tensorflow-datasets' syntax,
    slices allowed), read as its train and test splits are; DataError naming the splits it
    has for one it does not."""
    import tensorflow_datasets as tfds

    with quiet_absl():
        builder = tfds.builder(spec[len("tfds:"):], data_dir=data_dir)
    splits = builder.info.splits
    base = split.split("[", 1)[0].strip()
    if base not in splits:
        raise DataError(f"--validation_set={split}: {spec} has no split {base!r} (it has: "
                        f"{', '.join(splits)})")
    try:
        data = builder.as_dataset(split, as_supervised=True)
    except Exception as e:  # noqa: BLE001 - tfds's slice syntax errors and their kin
        raise DataError(f"--validation_set={split}: {first_line(e) or type(e).__name__}"
                        ) from None
    return materialized(spec, split, data, image_size)


def from_tfds(spec, data_dir, image_size):
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
