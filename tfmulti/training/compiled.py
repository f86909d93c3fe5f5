"""What a compiled model's optimizer becomes: none of it dropped.

A model your function returns compiled (`model.compile(optimizer=..., loss=..., metrics=...)`)
trains with its own optimizer's kind and settings (Adam's betas, clipnorm, ...) at its own
learning rate, as fit trains it, unless --base_lr or --lr_scaling is given: then at
tfmulti's (--base_lr per 256 examples, the scaling rule). The warm-up and the schedule apply
to either; one line says which rate trains and why. Its loss and metrics are the run's
(task.py). An uncompiled model gets tfmulti's defaults: SGD, cross-entropy on logits.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import keras

from tfmulti.errors import UsageError
from tfmulti.run import hparams

if TYPE_CHECKING:
    from tfmulti.run.config import RunConfig
    from tfmulti.run.plan import RunPlan

def own_optimizer(model: keras.Model) -> keras.optimizers.Optimizer | None:
    """The optimizer the model was compiled with (inside its loss scaling, if any), or None."""
    optimizer = getattr(model, "optimizer", None) if getattr(model, "compiled", False) else None
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        optimizer = optimizer.inner_optimizer
    return optimizer


def rebuilt(optimizer, learning_rate, momentum=0.0, weight_decay=0.0, spec="your model"):
    """A new optimizer of the compiled one's kind and settings whose rate is learning_rate
    (a callable: tfmulti's schedule; None: its own); --momentum and --weight_decay, when
    given, in place of its own. UsageError for what would not mean the same."""
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
    if learning_rate is not None:  # None: its own (a schedule of its own, kept)
        config["learning_rate"] = learning_rate
    return type(optimizer).from_config(config)


def own_rate(optimizer: keras.optimizers.Optimizer) -> float | None:
    """The optimizer's learning rate as a number, or None (a schedule or a callable)."""
    try:
        return float(keras.ops.convert_to_numpy(optimizer.learning_rate))
    except (TypeError, ValueError):
        return None


def own_schedule(optimizer):
    """Whether the optimizer's rate is a schedule (or a callable) of its own, not a number."""
    rate = getattr(optimizer, "_learning_rate", None)
    return isinstance(rate, keras.optimizers.schedules.LearningRateSchedule) or callable(rate)


def keeps_own_schedule(cfg, optimizer):
    """Whether the run keeps the optimizer's own schedule (cfg.keeps_compiled_rate);
    UsageError when tfmulti's warm-up or schedule would have to drive it too."""
    if not cfg.keeps_compiled_rate or not own_schedule(optimizer):
        return False
    if cfg.warmup_epochs or cfg.lr_schedule != "constant":
        raise UsageError(f"--model={cfg.model} is compiled with a learning-rate schedule of "
                         "its own, which --warmup_epochs and --lr_schedule cannot drive: leave "
                         "them out, or give --base_lr for tfmulti's rate and schedule")
    return True


def kept_rate(cfg, optimizer):
    """The compiled optimizer's own rate, a number, when the run keeps it
    (cfg.keeps_compiled_rate); else None (tfmulti's rate replaces it, or its schedule is
    kept: keeps_own_schedule)."""
    if not cfg.keeps_compiled_rate or own_schedule(optimizer):
        return None
    return own_rate(optimizer)


def optimizer_line(spec, optimizer, rate, base_lr, lr_scaling, global_batch):
    """The line that says which optimizer trains and at what rate."""
    own = own_rate(optimizer)  # a schedule or a callable has no one value
    name = type(optimizer).__name__
    line = (f"--model={spec} is compiled with {name}: it trains with {name} at tfmulti's "
            f"learning rate {rate:g} (--base_lr={base_lr:g} per 256 examples, --lr_scaling="
            f"{lr_scaling}, global batch {global_batch})")
    if own is None or abs(own - rate) <= 1e-9 * max(own, rate):
        return line
    factor = hparams.scale_factor(global_batch, lr_scaling)
    return (f"{line} in place of its own {own:g}; give --base_lr={own / factor:.4g} for its "
            "own rate")


def lines(cfg: RunConfig, resolved: RunPlan, own: keras.optimizers.Optimizer | None
          ) -> tuple[str, ...]:
    """What to say before the first step of a compiled model (`own`: the optimizer it was
    compiled with, own_optimizer): the optimizer that trains and its rate."""
    if own is None:
        return ()
    if cfg.keeps_compiled_rate:
        name = type(own).__name__
        rate = (f"its own learning-rate schedule ({type(own._learning_rate).__name__}, "
                f"{own_rate(own):g} at its start)" if own_schedule(own) else
                f"its own learning rate {own_rate(own):g}")
        return (f"--model={cfg.model} is compiled with {name}: it trains with {name} at {rate}, "
                "as model.fit trains it (--base_lr or --lr_scaling would replace it by "
                "tfmulti's)",)
    return (optimizer_line(cfg.model, own, resolved.learning_rate, *cfg.rate_rule,
                           resolved.global_batch_size),)


def as_trained(cfg: RunConfig, resolved: RunPlan, own: keras.optimizers.Optimizer | None
               ) -> RunPlan:
    """The plan with the learning rate the run trains at: the compiled optimizer's (`own`)
    own rate, kept."""
    if own is None or not cfg.keeps_compiled_rate:
        return resolved
    return dataclasses.replace(resolved, learning_rate=own_rate(own))
