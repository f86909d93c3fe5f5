"""What the model learns and how it is judged, for any task: the loss of each example and the
metrics, taken from the model.

An uncompiled model is a classifier of logits: cross-entropy on logits, and accuracy. A model
compiled with its own loss (one, or one per output with `loss_weights`) and metrics trains
and reports with them, under their Keras names ("mae", "out_b_auc"); a classifier (class ids,
one output of a score per class) also reports accuracy. Each example's loss is the weighted
sum over the outputs of the loss's mean over the output's own axes (pixels, time steps), so
its mean over the GLOBAL batch is Keras's sum_over_batch_size on one device: the same step
on any replica count. What cannot train is one line before the first step: a loss that does
not fit its targets, an output without a target, a target without an output, a metric Keras
does not know, features that are not the model's inputs.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import keras
import numpy as np
import tensorflow as tf
from keras.src.trainers.compile_utils import CompileMetrics, get_loss

from tfmulti.data.dataset import structure_text
from tfmulti.data.pipeline import to_model_input
from tfmulti.errors import UsageError, first_line
from tfmulti.models.usermodel import callable_model, is_compiled

if TYPE_CHECKING:
    from tfmulti.data.dataset import DataSet

ACCURACY = "accuracy"  # the classifier's metric: its records keep the book's train_acc, test_acc
EXAMPLES = 4  # examples the model is tried on before the first step


def record_key(part: str, name: str) -> str:
    """The key of metric `name` in an epoch record: part "train", "val" or "test"."""
    if name == ACCURACY:
        return f"{part}_acc"
    return f"{part}_{name}"


def added_losses(losses: list) -> tf.Tensor:
    """The sum of a model's own losses (model.losses: regularizers, add_loss), as Keras sums
    them into the loss it trains and reports; 0 without any."""
    return tf.add_n([tf.constant(0.0), *(tf.reduce_sum(tf.cast(loss, tf.float32))
                                         for loss in losses)])


def output_names(model: keras.Model, outputs=None) -> list[str]:
    """The model's outputs by name, in its order (a dict of outputs: its keys)."""
    if isinstance(outputs, dict):
        names = list(getattr(model, "output_names", None) or [])
        return names if sorted(names) == sorted(outputs) else sorted(outputs)
    names = list(getattr(model, "output_names", None) or [])
    count = len(outputs) if isinstance(outputs, (list, tuple)) else 1
    return names if len(names) == count else [f"output_{i}" for i in range(count)]


def flat(values: object, names: list[str]) -> list:
    """A model's outputs or targets as a list in output order."""
    if isinstance(values, dict):
        return [values[name] for name in names]
    if isinstance(values, (list, tuple)):
        return list(values)
    return [values]


class Task:
    """The loss and the metrics of `model` on `dataset`'s targets. Build it in the strategy's
    scope (the metrics' variables are the strategy's): the model is called eagerly on a few
    training examples, which checks the data against the model and picks the metrics' kinds
    (Keras's "accuracy" is binary, categorical or sparse by the shapes)."""

    def __init__(self, model: keras.Model, dataset: DataSet | None = None,
                 spec: str = "your model", own_step: bool = False):
        self.model, self.spec = model, spec
        self._user_metrics = (None, None)
        self.weighted = set()  # the names of the metrics sample weights weigh
        self.targetless = False  # features alone: the model's own step takes them
        if dataset is None:  # tfmulti's classifier of logits, as the engine's tests build it
            self.names, self.classifier = output_names(model), True
            self.losses = [(0, _sparse_ce_from_logits, 1.0)]
            self.train_metrics, self.test_metrics = self.metrics(), self.metrics()
            self.metric_names = [ACCURACY]
            return
        self.targetless = dataset.train_targets is None
        if own_step and not callable_model(model):  # no call() (a VAE, a GAN): nothing to
            self.names, self.classifier = [], False  # call it with; its train_step's logs
            self.losses, self.train_metrics, self.test_metrics, self.metric_names = [], [], [], []
            return
        if self.targetless:  # features alone (fit(x) with no y): the model's own step only
            if not own_step:
                raise UsageError(
                    f"--model={spec}: --dataset={dataset.name} gives features without targets, "
                    "which a model takes when it trains itself, as model.fit takes it: compile "
                    "it with an optimizer and no loss (its add_loss losses train it) or give it "
                    "a train_step of its own")
            self.names, self.classifier = output_names(model), False
            self.losses, self.train_metrics, self.test_metrics, self.metric_names = [], [], [], []
            return
        features = _first(dataset.train_features, EXAMPLES)
        if dataset.images:
            features = to_model_input(tf.constant(features))
        targets = _first(dataset.train_targets, EXAMPLES)
        _check_inputs(model, features, spec)
        try:
            outputs = model(features, training=False)
        except Exception as e:  # noqa: BLE001 - your model's failure, in one line
            raise UsageError(f"--model={spec} cannot take the data's features "
                             f"({_text(features)}): {type(e).__name__}: {first_line(e)}") from None
        self.names = output_names(model, outputs)
        ys = _targets_by_output(targets, self.names, spec)
        ps = [tf.cast(p, tf.float32) for p in flat(outputs, self.names)]
        self.classifier = (len(ps) == 1 and dataset.num_classes > 0 and ys[0].ndim == 1
                           and np.issubdtype(ys[0].dtype, np.integer)
                           and tuple(ps[0].shape[1:]) == (dataset.num_classes,))
        if own_step and not is_compiled(model):  # its own train_step has its own loss and
            # metrics (ownstep.py), and its test_step evaluates: none of tfmulti's
            self.losses, self.train_metrics, self.test_metrics, self.metric_names = [], [], [], []
            return
        self.losses = _losses(model, ys, ps, self.names, spec, self.classifier)
        values = self.per_example_loss(targets, outputs)
        if tuple(values.shape) != (len(ys[0]),):
            raise UsageError(f"--model={spec}: its loss gives values of shape "
                             f"{tuple(values.shape)} for {len(ys[0])} examples; give a loss "
                             "with a value per example (or per element of it)")
        self._user_metrics = _user_metrics(model)
        self.train_metrics = self.metrics(ys, ps)
        self.test_metrics = self.metrics(ys, ps)
        self.metric_names = [name for name, _, _ in self.train_metrics]

    @property
    def primary(self) -> str:
        """The metric the book's line and a tuning session report: accuracy, else the first
        compiled metric, else "loss"."""
        if ACCURACY in self.metric_names:
            return ACCURACY
        return self.metric_names[0] if self.metric_names else "loss"

    def per_example_loss(self, targets, outputs):
        """float32 [batch]: each example's loss, the outputs' losses weighted and summed."""
        ys = _targets_by_output(targets, self.names, self.spec)
        ps = flat(outputs, self.names)
        total = None
        for index, function, weight in self.losses:
            y, p = ys[index], tf.cast(ps[index], tf.float32)
            values = tf.cast(function(tf.cast(y, tf.float32), p), tf.float32)
            if values.shape.rank and values.shape.rank > 1:
                values = tf.reduce_mean(values, axis=list(range(1, values.shape.rank)))
            values = values * weight if weight != 1 else values
            total = values if total is None else total + values
        return total

    def metrics(self, ys=None, ps=None):
        """[(name, metric, output index)]: a new set of the model's metrics (one for
        training, one for evaluation), in the order and with the names Keras gives them."""
        found = []
        if self._user_metrics != (None, None):
            compiled = CompileMetrics(*self._user_metrics, output_names=self.names)
            try:
                compiled.build(ys if len(ys) > 1 else ys[0], ps if len(ps) > 1 else ps[0])
            except (ValueError, TypeError) as e:
                raise UsageError(f"--model={self.spec}: its metrics cannot be made: "
                                 f"{first_line(e)}") from None
            lists = [(i, m, part is compiled._flat_weighted_metrics)
                     for part in (compiled._flat_metrics, compiled._flat_weighted_metrics)
                     for i, ml in enumerate(part) if ml for m in ml.metrics]
            for index, metric, _ in lists:
                self._built(metric, ys[index], ps[index])
            for (index, metric, weighted), name in zip(lists, compiled.result()):
                found.append((name, self._built(_fresh(metric, name), ys[index], ps[index]),
                              index))
                if weighted:  # compile(weighted_metrics=...): weighed by sample weights
                    self.weighted.add(name)
        if self.classifier and ACCURACY not in [name for name, _, _ in found]:
            found.insert(0, (ACCURACY, keras.metrics.SparseCategoricalAccuracy(ACCURACY), 0))
        return found

    def update(self, metrics: list, targets: object, outputs: object,
               sample_weight: tf.Tensor | None = None, present: tf.Tensor | None = None
               ) -> None:
        """Adds a batch to each metric of a set of this task's metrics(). As Keras's compiled
        metrics: sample_weight (your sample or class weights) weighs the weighted_metrics
        only; present (1 for an example, 0 for the evaluation's padding) counts for all."""
        ys = _targets_by_output(targets, self.names, self.spec)
        ps = flat(outputs, self.names)
        weighed = (present if sample_weight is None else sample_weight if present is None
                   else present * tf.cast(sample_weight, present.dtype))
        for name, metric, index in metrics:
            metric.update_state(ys[index], tf.cast(ps[index], tf.float32),
                                sample_weight=weighed if name in self.weighted else present)

    def _built(self, metric, y, p):
        """metric with its variables made, now, in the strategy's scope: some Keras metrics
        (AUC with multi_label, F1Score, R2Score) make them at their first update, which
        inside the training function would be too late. One update on the examples, then a
        reset; a metric that cannot take them is one line."""
        try:
            metric.update_state(y, p)
        except Exception as e:  # noqa: BLE001 - the metric's own failure, in one line
            raise UsageError(f"--model={self.spec}: its metric {metric.name} cannot take the "
                             f"targets ({_text(y)}) and outputs ({_text(p)}): "
                             f"{type(e).__name__}: {first_line(e)}") from None
        metric.reset_state()
        return metric


def _first(arrays, n):
    if isinstance(arrays, dict):
        return {k: v[:n] for k, v in arrays.items()}
    if isinstance(arrays, tuple):
        return tuple(v[:n] for v in arrays)
    if hasattr(arrays, "read_batch"):  # a folder's images: read from their files
        return arrays.read_batch(tf.constant(arrays.paths[:n])).numpy()
    return arrays[:n]


def _text(arrays):
    return structure_text(tf.nest.map_structure(np.asarray, arrays))


def _check_inputs(model, features, spec):
    """Named features must be the model's named inputs."""
    struct = getattr(model, "_inputs_struct", None)
    if not isinstance(features, dict) or struct is None:
        return
    names = (list(struct) if isinstance(struct, dict) else
             [getattr(t, "name", None) for t in tf.nest.flatten(struct)])
    if None in names:
        return
    missing, extra = sorted(set(names) - set(features)), sorted(set(features) - set(names))
    if missing or extra:
        raise UsageError(f"--model={spec} takes the inputs {', '.join(names)}; the data's "
                         f"features are named {', '.join(features)}"
                         + (f" (no {', '.join(missing)})" if missing else "")
                         + (f" ({', '.join(extra)} not an input)" if extra else ""))


def _targets_by_output(targets, names, spec):
    """targets as a list in output order: a dict by output name, a tuple in output order,
    or one array for one output; UsageError for an output without a target or a target
    without an output."""
    if isinstance(targets, dict):
        missing = [n for n in names if n not in targets]
        extra = [k for k in targets if k not in names]
        if missing or extra:
            raise UsageError(
                f"--model={spec} has the outputs {', '.join(names)}; the data's targets are "
                f"named {', '.join(targets)}"
                + (f": output {missing[0]} has no target" if missing else
                   f": target {extra[0]} has no output"))
        return [targets[n] for n in names]
    ys = list(targets) if isinstance(targets, (tuple, list)) else [targets]
    if len(ys) != len(names):
        raise UsageError(
            f"--model={spec} has {len(names)} output{'s' if len(names) > 1 else ''} "
            f"({', '.join(names)}) and the data {len(ys)} target{'s' if len(ys) > 1 else ''}: "
            + ("an output without a target" if len(ys) < len(names) else
               "a target without an output"))
    return ys


def _losses(model, ys, ps, names, spec, classifier):
    """[(output index, per-example loss function, weight)]."""
    if not is_compiled(model):
        if not classifier:
            raise UsageError(
                f"--model={spec} is not compiled, so tfmulti would train it as a classifier "
                "(cross-entropy on one logit per class), but the data's targets are "
                f"{_text(ys if len(ys) > 1 else ys[0])} for outputs "
                f"{', '.join(str(tuple(p.shape[1:])) for p in ps)}: compile it with the loss "
                "that fits them (model.compile(loss=...))")
        return [(0, _sparse_ce_from_logits, 1.0)]
    loss, weights = model.loss, getattr(getattr(model, "_compile_loss", None),
                                        "_user_loss_weights", None)
    if isinstance(loss, dict):
        unknown = [k for k in loss if k not in names]
        if unknown:
            raise UsageError(f"--model={spec} is compiled with a loss for {unknown[0]}, which "
                             f"is not one of its outputs ({', '.join(names)})")
        loss = [loss.get(n) for n in names]
    elif not isinstance(loss, (list, tuple)):
        loss = [loss] * len(names)  # as Keras: one loss for every output
    if len(loss) != len(names):
        raise UsageError(f"--model={spec} is compiled with {len(loss)} losses for its "
                         f"{len(names)} outputs")
    if isinstance(weights, dict):
        weights = [weights.get(n, 1.0) for n in names]
    weights = list(weights) if weights is not None else [1.0] * len(names)
    found = []
    for index, identifier in enumerate(loss):
        if identifier is None:
            continue
        try:
            loss_obj = get_loss(identifier, ys[index], ps[index])
        except (ValueError, TypeError) as e:
            raise UsageError(f"--model={spec}: its loss {identifier!r} is not one Keras knows: "
                             f"{first_line(e)}") from None
        _check_fit(loss_obj, ys[index], ps[index], names[index], spec, len(names) > 1)
        # A Loss's call() gives the per-example values, before its reduction.
        found.append((index, loss_obj.call if isinstance(loss_obj, keras.losses.Loss)
                      else loss_obj, float(weights[index])))
    if not found:
        raise UsageError(f"--model={spec} is compiled without a loss for any output")
    return found


def _sparse_ce_from_logits(labels, logits):
    return keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)


def _check_fit(loss_obj, y, p, name, spec, several):
    """Keras's own losses need targets of the output's shape (sparse ones: without its last
    axis); Keras would broadcast others silently (a loss of [n] targets against [n, 3]
    outputs). Your own loss functions are taken as they are."""
    function = getattr(loss_obj, "fn", loss_obj)
    if not getattr(function, "__module__", "").startswith("keras."):
        return
    label = getattr(function, "__name__", type(loss_obj).__name__)
    target, out = tuple(np.shape(y)[1:]), tuple(p.shape[1:])
    sparse = "sparse" in label
    fits = ((target in (out[:-1], (*out[:-1], 1))) if sparse else
            target in (out, (*out, 1)) or (*target, 1) == out)
    if not fits:
        where = f" on output {name}" if several else ""
        raise UsageError(f"--model={spec}: its loss {label}{where} does not fit the targets: "
                         f"targets of shape {target} per example, outputs of shape {out}"
                         + (" (a sparse loss takes class ids, one per output row)" if sparse
                            else ""))


def _user_metrics(model):
    """(metrics, weighted_metrics) the model was compiled with; (None, None) without."""
    compiled = getattr(model, "_compile_metrics", None) if getattr(model, "compiled",
                                                                   False) else None
    if compiled is None:
        return None, None
    return (getattr(compiled, "_user_metrics", None) or None,
            getattr(compiled, "_user_weighted_metrics", None) or None)


def _fresh(metric, name):
    """A new metric of metric's kind and settings, named `name` (a metric object of yours
    is not shared between training and evaluation)."""
    if type(metric) is keras.metrics.MeanMetricWrapper:
        return keras.metrics.MeanMetricWrapper(metric._fn, name=name, dtype=metric.dtype,
                                               **metric._fn_kwargs)
    config = dict(metric.get_config(), name=name)
    try:
        return type(metric).from_config(config)
    except (TypeError, ValueError) as e:
        raise UsageError(f"the metric {name} cannot be made again from its get_config() "
                         f"({first_line(e)}); give it a get_config() that does") from None
