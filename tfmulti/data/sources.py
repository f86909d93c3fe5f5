"""Where a data set comes from: one `load()` above every source.

--dataset names a built-in set (builtin.py: fashion_mnist, synthetic) or your own:
MODULE:FUNCTION (function.py), folder:DIR (folder.py), tfds:NAME (tfds_sets.py) or
tfrecord:TRAIN,EVAL with --parse (tfrecord.py). The table of sources, run/datasets.py, names
the module that reads each; every one returns a DataSet (dataset.py). tfds and tfrecord sets
are read from their files by index (records.py); the checks every array source goes through
are checks.py.
"""
from __future__ import annotations

import dataclasses
import importlib
import types
from typing import TYPE_CHECKING

import numpy as np

from tfmulti.data import checks
from tfmulti.data.dataset import DataSet, Request
from tfmulti.run import datasets
from tfmulti.run.config import image_size

if TYPE_CHECKING:
    from collections.abc import Callable

    from tfmulti.run.config import RunConfig


def load(name: str, data_dir: str | None = None, synthetic_train_size: int = 60000,
         synthetic_test_size: int = 10000, seed: int = 0,
         image_size: tuple[int, int] | None = None, place: tuple[int, int] = (0, 1),
         smallest: Callable[[int], int] | None = None,
         splits: tuple[str, str] = ("", ""), parse: str = "", as_given: bool = False
         ) -> DataSet:
    """The data set `name` (--dataset) from its source (run/datasets.py): built in, or your
    own (MODULE:FUNCTION, folder:DIR, tfds:NAME, tfrecord:TRAIN,EVAL). image_size (height,
    width): every image resized to it. folder:DIR: this worker checks its `place` (index,
    count) of the files, and smallest(int) -> int (a collective across the workers) agrees
    on the first unreadable one. splits: a tfds:NAME set's training and evaluated splits
    (--train_split, --eval_split; "": its defaults); parse: tfrecord:'s --parse. as_given
    (RunConfig.features_as_given): a function's features (MODULE:FUNCTION, --parse) as it
    returns them, never taken for images."""
    request = Request(data_dir, image_size, place, smallest, splits, parse, as_given,
                      (synthetic_train_size, synthetic_test_size), seed)
    return reader(datasets.source_of(name)).load(name, request)


def reader(source: datasets.Source) -> types.ModuleType:
    """The module that reads the source's examples (imported when first read: the table of
    sources is read before TensorFlow starts)."""
    return importlib.import_module(source.module)


def load_for(cfg: RunConfig, place: tuple[int, int] = (0, 1),
             smallest: Callable[[int], int] | None = None) -> DataSet:
    """The data set RunConfig cfg names (--dataset, --data_dir, the synthetic sizes); with
    several workers, place and smallest split the check of a folder's files among them."""
    dataset = load(cfg.dataset, cfg.data_dir, cfg.synthetic_train_size,
                   cfg.synthetic_test_size, cfg.seed, image_size(cfg.image_size), place,
                   smallest, (cfg.train_split, cfg.eval_split), cfg.parse, cfg.features_as_given)
    return with_validation_set(dataset, cfg) if cfg.validation_set else dataset


def with_validation_set(dataset: DataSet, cfg: RunConfig) -> DataSet:
    """The data set with its split --validation_set read as its validation part, checked as
    its test set is (the same image size, labels within its classes)."""
    size = image_size(cfg.image_size) or tuple(np.shape(dataset.train_features)[1:3])
    # only a source with named splits gets here (config.check_validation_set)
    raw = reader(datasets.source_of(cfg.dataset)).named_split(cfg.dataset, cfg.data_dir,
                                                              cfg.validation_set, size)
    if hasattr(raw[0], "files"):  # records read by index: described by the set itself
        return dataclasses.replace(dataset, validation=raw)
    _, part, _, _ = checks.checked(cfg.dataset, (dataset.train_features, dataset.train_targets),
                                   raw, dataset.class_names, size)
    return dataclasses.replace(dataset, validation=part)
