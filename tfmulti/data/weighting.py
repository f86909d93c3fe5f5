"""Each training example's weight, as model.fit weighs it: your sample weights (a data
function's (x, y, sample_weight)) or --class_weight's weight of the example's class (fit
takes one or the other, not both).

--class_weight=balanced weighs class c by n / (classes x n_c) over the examples that train
(after --validation_split), as scikit-learn's "balanced"; a JSON object {"0": 1.0, "3": 5.0}
(class ids, or class names) gives classes their weights, the others 1, as fit's
class_weight. As in fit, class weights weigh training only; sample weights weigh the
evaluation of their part too (the validation part's, the test set's).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from tfmulti.data.checks import is_class_ids
from tfmulti.errors import UsageError
from tfmulti.run.config import class_weight_given

if TYPE_CHECKING:
    from tfmulti.data.dataset import DataSet
    from tfmulti.run.config import RunConfig

BALANCED = "balanced"


def class_weights(text: str, dataset: DataSet) -> np.ndarray:
    """float32 [classes]: each class's weight by --class_weight=text for the data set's
    training examples (class ids); UsageError for other targets or unknown classes."""
    targets = dataset.train_targets
    if not dataset.num_classes or not is_class_ids(targets):
        raise UsageError(f"--class_weight={text} weighs classes; --dataset={dataset.name}'s "
                         "targets are not class ids (give your sample weights instead)")
    labels = np.asarray(targets).reshape(-1).astype(np.int64)
    classes = dataset.num_classes
    given = class_weight_given(text)
    if given == BALANCED:
        counts = np.bincount(labels, minlength=classes).astype(np.float64)
        return np.where(counts > 0, len(labels) / (classes * np.maximum(counts, 1)),
                        1.0).astype(np.float32)
    weights = np.ones(classes, np.float32)
    names = {name: i for i, name in enumerate(dataset.class_names)}
    for key, weight in given.items():
        index = names.get(key, int(key) if key.isdigit() else -1)
        if not 0 <= index < classes:
            raise UsageError(f"--class_weight={text}: no class {key!r} among the "
                             f"{classes} classes (ids 0-{classes - 1}, or their names)")
        weights[index] = weight
    return weights


def train_weights(dataset: DataSet, cfg: RunConfig) -> np.ndarray | None:
    """float32 [n]: each training example's weight (your sample weights, or its class's),
    or None when neither is given (every example weighs 1, nothing is multiplied)."""
    weights = dataset.train_weights
    if cfg.class_weight:
        if weights is not None:
            raise UsageError(f"--class_weight={cfg.class_weight}: --dataset={dataset.name} "
                             "gives sample weights, and model.fit takes one or the other: "
                             "multiply the class weights into your sample weights")
        by_class = class_weights(cfg.class_weight, dataset)
        weights = by_class[np.asarray(dataset.train_targets).reshape(-1).astype(np.int64)]
    if weights is not None and cfg.data_service:
        raise UsageError(f"--data_service={cfg.data_service}: sample and class weights are not "
                         "served by the tf.data service; train without one, or without weights")
    return weights


def line(dataset: DataSet, cfg: RunConfig) -> str:
    """What the run says before its first step when examples weigh differently ('' else)."""
    train_weights(dataset, cfg)  # refused before anything is said
    parts = []
    if dataset.train_weights is not None:
        kept = dataset.train_weights
        parts.append(f"your sample weights (mean {float(np.mean(kept)):.3g}, from "
                     f"{float(np.min(kept)):.3g} to {float(np.max(kept)):.3g})")
    if cfg.class_weight:
        by_class = class_weights(cfg.class_weight, dataset)
        shown = ", ".join(f"{name}: {w:.3g}" for name, w in zip(dataset.class_names, by_class))
        parts.append(f"--class_weight={cfg.class_weight} ({shown})")
    if not parts:
        return ""
    tested = (" (sample weights weigh the evaluation too)" if dataset.test_weights is not None
              else "")
    return ("Training weighs each example's loss and metrics by " + " and ".join(parts)
            + ", as model.fit does" + tested)
