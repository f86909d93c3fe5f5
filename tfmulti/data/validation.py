"""A validation part held out of the training data (--validation_split): the same examples for
a given seed, fraction and data set, whatever the devices; for class ids, each class gives
its share (stratified), so a rare class is not left out of the part by chance.

A tuning session chooses its trials on this part and never looks at the test set; the main
job reports it beside the test figures. The rest of the training data trains."""
from __future__ import annotations

import dataclasses

import numpy as np

from tfmulti.data.checks import is_class_ids
from tfmulti.data.dataset import DataSet, example_count
from tfmulti.errors import DataError

SEED_STREAM = 0x5A11  # the split's own random stream: not the data order's, not the weights'


def held_out_indices(targets: object, fraction: float, seed: int, count: int = 0
                     ) -> tuple[np.ndarray, np.ndarray]:
    """(training indices, validation indices), each sorted: about `fraction` of the examples
    held out, chosen at random by `seed`; for class ids round(fraction x count) of each
    class. targets None: `count` examples without targets."""
    n = example_count(targets) if targets is not None else count
    rng = np.random.Generator(np.random.PCG64([seed, SEED_STREAM]))
    if targets is not None and is_class_ids(targets):
        labels = np.asarray(targets)
        held = [rng.permutation(np.flatnonzero(labels == c))[:round(fraction * np.sum(labels == c))]
                for c in np.unique(labels)]
        validation = np.sort(np.concatenate(held)) if held else np.zeros(0, np.int64)
    else:
        validation = np.sort(rng.permutation(n)[:round(fraction * n)])
    kept = np.ones(n, bool)
    kept[validation] = False
    return np.flatnonzero(kept), validation


def take(arrays: object, indices: np.ndarray) -> object:
    """The examples at `indices` of an array, a folder's images (still read from their files
    when the pipeline needs them), or a dict / tuple of them."""
    if arrays is None:  # no targets
        return None
    if isinstance(arrays, dict):
        return {name: take(a, indices) for name, a in arrays.items()}
    if isinstance(arrays, (tuple, list)):
        return type(arrays)(take(a, indices) for a in arrays)
    if hasattr(arrays, "subset"):  # records.Records: where they are, not what they hold
        return arrays.subset(indices)
    if hasattr(arrays, "read_batch"):  # folder.ImageFiles: its paths, not its pixels
        return type(arrays)(arrays.spec, arrays.paths[indices], arrays.size, arrays.channels)
    return np.asarray(arrays)[indices]


def split(dataset: DataSet, fraction: float, seed: int
          ) -> tuple[DataSet, tuple[object, object] | None]:
    """(the data set that trains: its training examples less the validation part, the part
    as (features, targets), or (features, targets, sample weights) when the data set has
    them, as fit's validation_split splits them); (dataset, None) for fraction 0. DataError
    when either side would be empty. A data set with a named validation split
    (--validation_set) trains on all its training data and validates on that split."""
    if dataset.validation is not None:
        return dataset, dataset.validation
    if not fraction:
        return dataset, None
    train, validation = held_out_indices(dataset.train_targets, fraction, seed,
                                         dataset.train_size)
    if not len(validation) or not len(train):
        empty = "no validation" if not len(validation) else "no training"
        raise DataError(f"--validation_split={fraction:g} of the {dataset.train_size} training "
                        f"{dataset.example_word} leaves {empty} examples; give a share that "
                        "leaves some on both sides")
    weights = dataset.train_weights  # your sample weights: each example keeps its own
    rest = dataclasses.replace(dataset, train_features=take(dataset.train_features, train),
                               train_targets=take(dataset.train_targets, train),
                               train_weights=None if weights is None else weights[train])
    return rest, (take(dataset.train_features, validation),
                  take(dataset.train_targets, validation),
                  *(() if weights is None else (weights[validation],)))
