"""What a compiled model's optimizer becomes: none of it dropped.

A model your function returns compiled (`model.compile(optimizer=..., loss=..., metrics=...)`)
trains with its own optimizer's kind and settings (Adam's betas, clipnorm, ...) driven by
tfmulti's learning rate (--base_lr per 256 examples, the scaling rule, the warm-up and the
schedule: one line says the rate it gets in place of its own); its loss and metrics are the
run's (task.py). An uncompiled model gets tfmulti's defaults: SGD, cross-entropy on logits.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import keras

from tfmulti.errors import UsageError
from tfmulti.run import hparams

if TYPE_CHECKING:
    from tfmulti.run.config import RunConfig
    from tfmulti.run.plan import RunPlan

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


def lines(cfg: RunConfig, resolved: RunPlan, model: keras.Model) -> tuple[str, ...]:
    """What to say before the first step of a compiled model: the optimizer that trains and
    its rate."""
    own = own_optimizer(model)
    if own is None:
        return ()
    return (optimizer_line(cfg.model, own, resolved.learning_rate, cfg.base_lr,
                           cfg.lr_scaling, resolved.global_batch_size),)
