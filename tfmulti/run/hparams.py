"""Batch sizes and the learning-rate scaling rule: plain arithmetic, no TensorFlow.

Goyal et al. (2017): with k times the batch, use k times the learning rate (linear rule) after
a gradual warm-up; the square-root rule is the gentler alternative for very large batches.
"""
from __future__ import annotations

import math

from tfmulti.errors import UsageError

LR_SCALINGS = ("linear", "sqrt", "none")
DEFAULT_PER_REPLICA_BATCH = 256
LR_REFERENCE_BATCH = 256  # base_lr is given per this many examples


def batch_sizes(num_replicas, per_replica_batch_size=None, global_batch_size=None):
    """(per_replica, global) from one of the two; the default is 256 per replica."""
    if per_replica_batch_size is not None and global_batch_size is not None:
        raise UsageError("--per_replica_batch_size and --global_batch_size both given; give one "
                         "(the other follows from the replica count)")
    if per_replica_batch_size == "auto":  # tfmulti.main resolves it before any plan
        raise UsageError("--per_replica_batch_size=auto: only tfmulti.main finds the batch (at "
                         "its start); give a number of examples here")
    for flag, value in (("per_replica_batch_size", per_replica_batch_size),
                        ("global_batch_size", global_batch_size)):
        if value is not None and value < 1:
            raise UsageError(f"--{flag}={value}: a batch needs at least one example")
    if global_batch_size is not None:
        if global_batch_size % num_replicas:
            raise UsageError(f"--global_batch_size={global_batch_size} does not divide over "
                             f"{num_replicas} replicas; use a multiple of {num_replicas}")
        return global_batch_size // num_replicas, global_batch_size
    per_replica = per_replica_batch_size or DEFAULT_PER_REPLICA_BATCH
    return per_replica, per_replica * num_replicas


def scale_factor(global_batch_size: int, rule: str) -> float:
    ratio = global_batch_size / LR_REFERENCE_BATCH
    if rule == "linear":
        return ratio
    if rule == "sqrt":
        return math.sqrt(ratio)
    if rule == "none":
        return 1.0
    raise UsageError(f"--lr_scaling={rule}: choose one of {', '.join(LR_SCALINGS)}")


def scaled_learning_rate(base_lr, global_batch_size, rule):
    """The rate training uses: base_lr (per 256 examples) x rule(global_batch / 256)."""
    if not base_lr > 0:
        raise UsageError(f"--base_lr={base_lr}: the learning rate must be positive")
    return base_lr * scale_factor(global_batch_size, rule)
