"""One start-up: a RunConfig turned into this process's devices, strategy and role.

Every tool, the doctor, its probes, the tuner's trials and the check of your code start
TensorFlow through a `Startup`: `from_config` reads the flags' devices and cluster (nothing
started, every problem one line), `start_devices` starts the runtime on them, `start` also
makes the strategy (one device, mirrored, or multi-worker). Tests inject their own strategy
instead and never start one here.
"""
from __future__ import annotations

import dataclasses
import enum
import os
from typing import TYPE_CHECKING, Mapping

from tfmulti import tfprivate
from tfmulti.distribution import allocator, devices

if TYPE_CHECKING:
    from tfmulti.run.config import RunConfig

WORKER_TIMEOUT = 600.0  # seconds a worker waits for the others to join (--worker_timeout)


class Role(enum.Enum):
    """What this process is in its run (training) or its session (tuning)."""
    ALONE = "alone"  # the only process: one machine, a serial tuning session
    CHIEF = "chief"  # writes the report and the real checkpoints; serves a tuning session
    WORKER = "worker"  # one of the others: trains its share, or runs the chief's trials

    @property
    def leads(self) -> bool:
        """Whether this process writes the run's report (alone, or the chief)."""
        return self is not Role.WORKER


@dataclasses.dataclass(frozen=True)
class Startup:
    plan: devices.DevicePlan
    cluster: dict | None = None  # this worker's TF_CONFIG dict; None on one machine
    threads: tuple[int, int] = (0, 0)  # intra-op and inter-op thread pools (0: TensorFlow's)
    seed: int | None = None  # with --deterministic: everything seeded, ops deterministic
    worker_timeout: float = WORKER_TIMEOUT

    @property
    def role(self) -> Role:
        if self.cluster is None:
            return Role.ALONE
        from tfmulti.distribution import workers

        return Role.CHIEF if workers.is_chief(self.cluster) else Role.WORKER

    @property
    def place(self) -> tuple[int, int]:
        """(this task's place, the task count), chiefs first; (0, 1) on one machine."""
        from tfmulti.distribution import workers

        return workers.task_place(self.cluster)

    def start_devices(self) -> None:
        """Starts TensorFlow's runtime on the plan's devices (before any tensor exists)."""
        devices.configure(self.plan, *self.threads)
        if self.seed is not None:
            import keras
            import tensorflow as tf

            keras.utils.set_random_seed(self.seed)
            tf.config.experimental.enable_op_determinism()
        devices.check_configured(self.plan)
        if self.cluster is None:  # a worker's collectives are configured before any op runs
            keep_buffers()

    def start(self):
        """The runtime started and the strategy made: OneDevice or Mirrored on one machine,
        MultiWorkerMirrored across the cluster (it waits worker_timeout s for the others)."""
        self.start_devices()
        if self.cluster is None:
            return devices.make_strategy(self.plan)
        from tfmulti.distribution import workers

        strategy = workers.make_multi_worker_strategy(self.cluster, self.plan,
                                                      self.worker_timeout)
        keep_buffers()
        return strategy


def keep_buffers() -> None:
    """glibc's malloc keeps a step's buffers: TensorFlow's tf.data sets its threshold first
    (it runs ops: after a worker's strategy is made, whose collectives must be configured
    before any op runs)."""
    allocator.keep_buffers(tfprivate.settle_tf_data_malloc)


def from_config(cfg: RunConfig, environ: Mapping[str, str] | None = None, *,
                one_run: bool = True) -> Startup:
    """The start-up RunConfig cfg asks for, checked, nothing started. The cluster comes from
    --worker_hosts/--task_index, TF_CONFIG or a Slurm step; one_run=False (a tuning session,
    whose tasks each train runs of their own) plans this machine's devices only."""
    from tfmulti.distribution import workers

    environ = os.environ if environ is None else environ
    cluster = (workers.cluster_config(cfg.worker_hosts, cfg.task_index,
                                      environ.get("TF_CONFIG"), environ) if one_run else None)
    plan = devices.plan_for(cfg)
    if cluster:
        workers.check_multi_worker_plan(plan, cfg.worker_timeout)
    return Startup(plan, cluster, (cfg.intra_op_threads, cfg.inter_op_threads),
                   cfg.seed if cfg.deterministic else None, cfg.worker_timeout)
