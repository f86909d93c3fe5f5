"""What a compiled model brings: its loss, its optimizer and its metrics, none of it dropped.

A model your function returns compiled (`model.compile(optimizer=..., loss=..., metrics=...)`)
trains with its own loss and with its own optimizer's kind and settings (Adam's betas,
clipnorm, ...) driven by tfmulti's learning rate (--base_lr per 256 examples, the scaling
rule, the warm-up and the schedule: one line says the rate it gets in place of its own). An
uncompiled model gets tfmulti's defaults: cross-entropy on logits and SGD. The loss is taken
per example and averaged over the GLOBAL batch, as tfmulti's own (a Loss's `reduction` is
not used: the step is the same on any replica count).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import keras
import tensorflow as tf

from tfmulti.errors import UsageError
from tfmulti.models import usermodel
from tfmulti.run import hparams

if TYPE_CHECKING:
    from tfmulti.run.config import RunConfig
    from tfmulti.run.plan import RunPlan

REPORTED_METRICS = ("accuracy", "acc", "sparse_categorical_accuracy")  # what tfmulti reports


def sparse_ce_from_logits(labels, logits):
    return keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)


def per_example_loss(model):
    """loss(labels, outputs) -> float32 [batch]: the model's compiled loss, or cross-entropy
    on logits for an uncompiled one. A loss with values per pixel or per time step is
    averaged over them first (as Keras's sum_over_batch_size reduction weighs them)."""
    if not usermodel.is_compiled(model):
        return sparse_ce_from_logits
    loss = model.loss
    if isinstance(loss, (list, tuple, dict)):
        raise UsageError(f"{model.name} is compiled with a loss per output; tfmulti trains "
                         "models with one output and one loss")
    loss = keras.losses.get(loss)
    # A Loss object's call() gives the per-example values, before its reduction.
    function = loss.call if isinstance(loss, keras.losses.Loss) else loss

    def per_example(labels, outputs):
        values = tf.cast(function(labels, outputs), tf.float32)
        if values.shape.rank and values.shape.rank > 1:
            values = tf.reduce_mean(values, axis=list(range(1, values.shape.rank)))
        return values

    return per_example


def own_optimizer(model):
    """The optimizer the model was compiled with (inside its loss scaling, if any), or None."""
    optimizer = getattr(model, "optimizer", None) if getattr(model, "compiled", False) else None
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        optimizer = optimizer.inner_optimizer
    return optimizer


def rebuilt(optimizer, learning_rate, momentum=0.0, weight_decay=0.0, spec="your model"):
    """A new optimizer of the compiled one's kind and settings whose rate is learning_rate
    (a callable: tfmulti's schedule); --momentum and --weight_decay, when given, in place of
    its own. UsageError for what would not mean the same."""
    config = dict(optimizer.get_config())
    name = type(optimizer).__name__
    if config.get("gradient_accumulation_steps"):
        raise UsageError(f"--model={spec} is compiled with {name}(gradient_accumulation_steps="
                         f"{config['gradient_accumulation_steps']}); give --grad_accum_steps "
                         "instead (tfmulti accumulates across replicas)")
    if momentum:
        if "momentum" not in config:
            raise UsageError(f"--momentum={momentum:g}: your model's compiled {name} has no "
                             "momentum; leave --momentum out (it is SGD's)")
        config["momentum"] = momentum
    if weight_decay:
        config["weight_decay"] = weight_decay
    config["learning_rate"] = learning_rate
    return type(optimizer).from_config(config)


def optimizer_line(spec, optimizer, rate, base_lr, lr_scaling, global_batch):
    """The line that says which optimizer trains and at what rate."""
    try:  # a number or a variable; a schedule or a callable has no one value
        own = float(keras.ops.convert_to_numpy(optimizer.learning_rate))
    except (TypeError, ValueError):
        own = None
    name = type(optimizer).__name__
    line = (f"--model={spec} is compiled with {name}: it trains with {name} at tfmulti's "
            f"learning rate {rate:g} (--base_lr={base_lr:g} per 256 examples, --lr_scaling="
            f"{lr_scaling}, global batch {global_batch})")
    if own is None or abs(own - rate) <= 1e-9 * max(own, rate):
        return line
    factor = hparams.scale_factor(global_batch, lr_scaling)
    return (f"{line} in place of its own {own:g}; give --base_lr={own / factor:.4g} for its "
            "own rate")


def unreported_metrics(model):
    """The names of the compiled metrics tfmulti does not report (it reports loss and
    accuracy)."""
    compiled = getattr(model, "_compile_metrics", None)
    user = getattr(compiled, "_user_metrics", None) or []
    if isinstance(user, dict):
        user = [m for ms in user.values() for m in (ms if isinstance(ms, (list, tuple)) else [ms])]
    names = []
    for metric in user:
        name = metric if isinstance(metric, str) else getattr(metric, "name", None) or getattr(
            metric, "__name__", type(metric).__name__)
        if name not in REPORTED_METRICS:
            names.append(name)
    return names


def lines(cfg: RunConfig, resolved: RunPlan, model: keras.Model) -> tuple[str, ...]:
    """What to say before the first step of a compiled model: the optimizer that trains and
    its rate, the compiled metrics tfmulti does not report."""
    out = []
    own = own_optimizer(model)
    if own is not None:
        out.append(optimizer_line(cfg.model, own, resolved.learning_rate, cfg.base_lr,
                                  cfg.lr_scaling, resolved.global_batch_size))
    left = unreported_metrics(model)
    if left:
        out.append(f"--model={cfg.model} is compiled with the metric{'s' if len(left) > 1 else ''}"
                   f" {', '.join(left)}: tfmulti reports the loss and accuracy only, so "
                   f"{'they are' if len(left) > 1 else 'it is'} not computed")
    return tuple(out)
