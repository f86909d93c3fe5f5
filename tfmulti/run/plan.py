"""A run's plan: what its settings come to on a given number of replicas, resolved once.

The configuration says "256 examples per replica, base_lr 0.1 per 256 examples, linear
rule"; the plan says what that means on 2 replicas and this data set: 512 examples a step,
a learning rate of 0.2, 117 steps an epoch. Everything that trains, tunes or reports takes
these numbers from the plan instead of working them out again. Plain arithmetic: no
TensorFlow.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from tfmulti.errors import UsageError
from tfmulti.run import hparams

if TYPE_CHECKING:
    from tfmulti.run.config import RunConfig


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """The run's numbers resolved once from its RunConfig and replica count (run_plan). Code
    names a RunPlan `resolved`; `plan` is always a DevicePlan (where the replicas run)."""
    replicas: int
    per_replica_batch_size: int
    global_batch_size: int
    learning_rate: float  # peak rate: base_lr (per 256 examples) x rule(global batch / 256)
    steps_per_epoch: int = 0  # 0: the data set is not known yet
    eval_steps: int = 0
    grad_accum_steps: int = 1

    @property
    def micro_batch_size(self):
        """Examples per replica per gradient-accumulation micro-step."""
        return self.per_replica_batch_size // self.grad_accum_steps


def steps_per_epoch(num_examples: int, global_batch_size: int) -> int:
    """Whole global batches in an epoch (the rest of the shuffled epoch is left out)."""
    return num_examples // global_batch_size


def eval_steps(num_examples: int, global_batch_size: int) -> int:
    """Batches that cover every test example once (the last one padded)."""
    return -(-num_examples // global_batch_size)


def run_plan(cfg: RunConfig, replicas: int, train_examples: int | None = None,
             test_examples: int | None = None) -> RunPlan:
    """The RunPlan of RunConfig cfg on `replicas` replicas (and a data set of that many
    training and test examples, when known). One line on a batch that cannot work."""
    per_replica, global_batch = hparams.batch_sizes(
        replicas, cfg.per_replica_batch_size, cfg.global_batch_size)
    if per_replica % cfg.grad_accum_steps:
        raise UsageError(f"--grad_accum_steps={cfg.grad_accum_steps}: the {per_replica} "
                         f"examples per replica do not split into {cfg.grad_accum_steps} "
                         "equal micro-batches")
    steps = evals = 0
    if train_examples is not None:
        steps = steps_per_epoch(train_examples, global_batch)
        if steps < 1:
            raise UsageError(f"global batch {global_batch} is larger than the "
                             f"{train_examples} training examples")
        evals = eval_steps(test_examples, global_batch)
    return RunPlan(replicas, per_replica, global_batch,
                   hparams.scaled_learning_rate(cfg.rate_rule[0], global_batch, cfg.rate_rule[1]),
                   steps, evals, cfg.grad_accum_steps)
