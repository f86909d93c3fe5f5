"""Where a data set comes from: one `load()` above every source.

--dataset names a built-in set (fashion_mnist: IDX files in --data_dir, else
tensorflow-datasets; synthetic: the embedded generator) or your own: MODULE:FUNCTION
(function.py), folder:DIR (folder.py), tfds:NAME (tfds_sets.py) or tfrecord:TRAIN,EVAL with
--parse (tfrecord.py; tfds and tfrecord sets are read from their files by index,
records.py). Each gives a DataSet (dataset.py); the checks every array source goes through
are checks.py.
"""
from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING

import numpy as np

from tfmulti.data import checks, synthetic
from tfmulti.data.dataset import DataSet
from tfmulti.errors import DataError
from tfmulti.run import config
from tfmulti.run.config import DATASETS, image_size

if TYPE_CHECKING:
    from collections.abc import Callable

    from tfmulti.run.config import RunConfig


def load(name: str, data_dir: str | None = None, synthetic_train_size: int = 60000,
         synthetic_test_size: int = 10000, seed: int = 0,
         image_size: tuple[int, int] | None = None, place: tuple[int, int] = (0, 1),
         smallest: Callable[[int], int] | None = None,
         splits: tuple[str, str] = ("", ""), parse: str = "", as_given: bool = False
         ) -> DataSet:
    """The data set `name` (--dataset); fashion_mnist reads IDX files from data_dir if it
    holds them; your own (MODULE:FUNCTION, folder:DIR, tfds:NAME) from its source.
    image_size (height, width): every image resized to it. folder:DIR: this worker checks
    its `place` (index, count) of the files, and smallest(int) -> int (a collective across
    the workers) agrees on the first unreadable one. splits: a tfds:NAME set's training and
    evaluated splits (--train_split, --eval_split; "": its defaults); parse: tfrecord:'s
    --parse. as_given (RunConfig.features_as_given): a function's features (MODULE:FUNCTION,
    --parse) as it returns them, never taken for images."""
    if name not in DATASETS:
        return yours(name, data_dir, image_size, place, smallest, splits, parse, as_given)
    if image_size:
        built_in = load(name, data_dir, synthetic_train_size, synthetic_test_size, seed)
        return dataclasses.replace(
            built_in, train_features=checks.resized(built_in.train_features, image_size),
            test_features=checks.resized(built_in.test_features, image_size))
    if name == "synthetic":
        (x, y), (tx, ty) = synthetic.make_dataset(synthetic_train_size, synthetic_test_size, seed)
        return DataSet("synthetic", f"embedded synthetic generator (seed {seed})", x, y, tx, ty)
    if name != "fashion_mnist":
        raise DataError(f"unknown data set {name!r}; choose one of {', '.join(DATASETS)}")
    from tfmulti.data import idx, tfds_sets

    if data_dir is not None and not os.path.isdir(data_dir):
        raise DataError(f"--data_dir={data_dir} is not a directory")
    if data_dir is not None and idx.has_idx_files(data_dir):
        return idx.load_idx_dir(data_dir)
    return tfds_sets.load_tfds(data_dir)


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
    from tfmulti.data import tfds_sets

    size = image_size(cfg.image_size) or tuple(np.shape(dataset.train_features)[1:3])
    raw = tfds_sets.named_split(cfg.dataset, cfg.data_dir, cfg.validation_set, size)
    if hasattr(raw[0], "files"):  # records read by index: described by the set itself
        return dataclasses.replace(dataset, validation=raw)
    _, part, _, _ = checks.checked(cfg.dataset, (dataset.train_features, dataset.train_targets),
                                   raw, dataset.class_names, size)
    return dataclasses.replace(dataset, validation=part)


def by_index(spec: str, features: object) -> str:
    """The line a run says first of features read from their files by index ('' else)."""
    if not hasattr(features, "files"):
        return ""
    count = len(features.files.paths)
    return (f"--dataset={spec}: read by index from {count} training file"
            f"{'s' if count > 1 else ''}: each worker reads only its own slices of each global "
            "batch, whatever the number of files and workers; a resumed run continues exactly, "
            "on any replica or worker count")


def yours(spec, data_dir=None, image_size=None, place=(0, 1), smallest=None, splits=("", ""),
          parse="", as_given=False):
    """The DataSet of --dataset=spec (not a built-in name), images resized to image_size;
    as_given: a function's features as it returns them (load)."""
    from tfmulti.data import folder, function, tfds_sets

    kind = config.dataset_kind(spec)
    if kind == "folder":  # read from the files as the pipeline needs them: well-formed
        source, train, test, classes, skipped = folder.from_folder(spec, image_size, place,
                                                                   smallest)
        notes = checks.class_coverage(spec, train[1], test[1], classes, "folder") + skipped
        return DataSet(spec, source, *train, *test, class_names=classes, notes=notes)
    if kind == "tfds":  # images and class labels by the set's own description
        source, train, test, classes = tfds_sets.from_tfds(spec, data_dir, image_size, splits)
        notes = checks.class_coverage(spec, train[1], test[1], classes, "given")
        return DataSet(spec, source, *train, *test, class_names=classes, notes=notes,
                       reading=by_index(spec, train[0]))
    if kind == "tfrecord":  # read by index from the files, checked as they were indexed
        from tfmulti.data import tfrecord

        source, train, test, classes, images = tfrecord.from_tfrecord(spec, parse, image_size,
                                                                      as_given)
        notes = (checks.class_coverage(spec, train[1], test[1], classes, "labels")
                 if classes else ())
        return DataSet(spec, source, *train, *test, class_names=classes, notes=notes,
                       images=images and not as_given, images_as_given=images and as_given,
                       reading=by_index(spec, train[0]))
    source, train, test, given = function.from_function(spec, data_dir, image_size, as_given)
    train, weights = checks.weights_apart(spec, "train", train)
    test, test_weights = (None, None) if test is None else checks.weights_apart(spec, "test",
                                                                               test)
    train, test, classes, images = checks.checked(spec, train, test, given, image_size, as_given)
    notes = (checks.class_coverage(spec, train[1], test[1], classes,
                                   "labels" if given is None else "given")
             if test is not None and checks.is_class_ids(train[1]) else ())
    if test is None:  # no test part: an empty one of the train part's form (nothing to test)
        test = (checks.none_of(train[0]), None)
    image_like = as_given and checks.looks_like_images(*train)
    return DataSet(spec, source, *train, *test, class_names=classes, notes=notes, images=images,
                   images_as_given=image_like,
                   reading=as_given_note(spec, train[0]) if image_like else "",
                   train_weights=weights, test_weights=test_weights)


def as_given_note(spec: str, features: np.ndarray) -> str:
    """The line a run says first of images your model takes as your function returns them."""
    from tfmulti.data.dataset import structure_text

    scale = (" (0-255: scale them in your model, keras.layers.Rescaling(1 / 255), if it "
             "expects [0, 1])" if features.dtype == np.uint8 else "")
    return (f"--dataset={spec}: your model takes its features as your function returns them, "
            f"as model.fit gives them: {structure_text(features)}{scale}")
