"""The optimizer a run trains with, made from its configuration: one function to change.

The book's default is plain SGD at a constant rate. A run may add linear warm-up (Goyal et
al.), a cosine decay after it, momentum and decoupled weight decay. The rate follows the
engine's step count (saved in checkpoints), not the optimizer's: a step that float16 loss
scaling skips does not advance the optimizer's count, and the schedule would fall behind.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import keras
import tensorflow as tf

from tfmulti.training import compiled

if TYPE_CHECKING:
    from collections.abc import Callable


@keras.saving.register_keras_serializable("tfmulti")
class WarmupSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """At step s (0 first): peak x (s + 1) / warmup_steps during the warm-up, then the peak,
    or with decay_steps a cosine from the peak down to 0 over that many steps."""

    def __init__(self, peak, warmup_steps=0, decay_steps=0):
        self.peak, self.warmup_steps, self.decay_steps = float(peak), int(warmup_steps), int(
            decay_steps)

    def __call__(self, step):
        step = tf.cast(step, tf.float32)
        rate = tf.constant(self.peak, tf.float32)
        if self.warmup_steps > 0:
            rate *= tf.minimum(1.0, (step + 1) / self.warmup_steps)
        if self.decay_steps > 0:
            progress = tf.clip_by_value((step - self.warmup_steps) / self.decay_steps, 0.0, 1.0)
            rate *= 0.5 * (1 + tf.cos(math.pi * progress))
        return rate

    def get_config(self):
        return {"peak": self.peak, "warmup_steps": self.warmup_steps,
                "decay_steps": self.decay_steps}


def schedule(cfg, resolved, peak=None):
    """The run's schedule: peaks at the plan's learning rate (base_lr scaled to the global
    batch: cfg.base_lr itself never reaches the optimizer), or at `peak` (a compiled
    optimizer's own rate, kept)."""
    warmup = round(cfg.warmup_epochs * resolved.steps_per_epoch)
    decay = (max(1, cfg.epochs * resolved.steps_per_epoch - warmup) if cfg.lr_schedule == "cosine"
             else 0)
    return WarmupSchedule(resolved.learning_rate if peak is None else peak, warmup, decay)


def optimizer_fn(cfg, resolved, own=None):
    """What the engine calls in its strategy scope with its step variable: SGD at the
    schedule's rate, or the kind and settings of the optimizer own() returns (your model's
    compiled one, see compiled.py) at its own rate (cfg.keeps_compiled_rate) or the schedule's."""
    def rate(rates, step):
        """The optimizer's rate: the schedule at the engine's step, or (cfg.settable_rate:
        your callbacks may set it) its constant value, a number as fit's."""
        return rates.peak if cfg.settable_rate else (lambda: rates(step))

    def make(step):
        yours = own() if own is not None else None
        if yours is None:
            rates = schedule(cfg, resolved)
            return keras.optimizers.SGD(rate(rates, step), momentum=cfg.momentum,
                                        weight_decay=cfg.weight_decay or None)
        if compiled.keeps_own_schedule(cfg, yours):
            return compiled.rebuilt(yours, None, cfg.momentum, cfg.weight_decay, cfg.model)
        kept = compiled.kept_rate(cfg, yours)
        rates = schedule(cfg, resolved, kept)
        return compiled.rebuilt(yours, rate(rates, step), cfg.momentum, cfg.weight_decay,
                                cfg.model)

    return make


def constant(learning_rate: float) -> Callable[[tf.Variable], keras.optimizers.SGD]:
    """Plain SGD at a fixed rate (benchmarks, tests)."""
    return lambda step: keras.optimizers.SGD(learning_rate)
