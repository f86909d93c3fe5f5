"""The sets tfmulti brings: fashion_mnist (IDX files in --data_dir, else tensorflow-datasets)
and synthetic (the embedded generator, the offline default: never named Fashion-MNIST)."""
from __future__ import annotations

import dataclasses
import os

from tfmulti.data import checks, idx, synthetic, tfds_sets
from tfmulti.data.dataset import DataSet, Request
from tfmulti.errors import DataError


def load(spec: str, request: Request) -> DataSet:
    """--dataset=fashion_mnist or synthetic, its images resized to request.image_size if set."""
    dataset = _synthetic(request) if spec == "synthetic" else _fashion_mnist(request.data_dir)
    if not request.image_size:
        return dataset
    return dataclasses.replace(
        dataset, train_features=checks.resized(dataset.train_features, request.image_size),
        test_features=checks.resized(dataset.test_features, request.image_size))


def _synthetic(request: Request) -> DataSet:
    (x, y), (tx, ty) = synthetic.make_dataset(*request.synthetic_sizes, request.seed)
    return DataSet("synthetic", f"embedded synthetic generator (seed {request.seed})",
                   x, y, tx, ty)


def _fashion_mnist(data_dir: str | None) -> DataSet:
    if data_dir is not None and not os.path.isdir(data_dir):
        raise DataError(f"--data_dir={data_dir} is not a directory")
    if data_dir is not None and idx.has_idx_files(data_dir):
        return idx.load_idx_dir(data_dir)
    return tfds_sets.load_tfds(data_dir)
