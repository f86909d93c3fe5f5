"""Where a step's time goes: clocks inside the traced steps, and the straggler rule.

Each step's time is split at three clocks: when the worker asked for its batch, when the
batch was there (input wait), when every local replica's gradients were there (compute: the
forward and backward pass), when their sum across replicas and workers was back (the
all-reduce, waiting for the slowest replica included). The remainder of an epoch (the weight
update, the host loop) is neither.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np
import tensorflow as tf

from tfmulti import tfprivate

if TYPE_CHECKING:
    from collections.abc import Sequence

# A worker whose steps compute this many times as long as the median of the others is named:
# every step of every worker waits for it in the all-reduce, so the job runs at its speed.
# Equal workers on one machine differed by up to 1.16x an epoch here
# (benchmarks/results/stragglers.json); 1.5 stays clear of that noise and names a worker
# that costs the job a third of its speed.
STRAGGLER_MARGIN = 1.5


def clock() -> tf.Tensor:
    """Seconds now, as a graph op: tf.timestamp, which TensorFlow refuses while op
    determinism is on (--deterministic); then the host's clock through a Python call. The
    value is only reported, never computed with, so the weights stay deterministic."""
    if tfprivate.op_determinism_on():
        return tf.reshape(tf.py_function(time.perf_counter, [], tf.float64), [])
    return tf.timestamp()


def clock_after(tensors: Sequence[tf.Tensor | None], on_device: bool | None = None
                ) -> tf.Tensor:
    """clock(), once every tensor of `tensors` is computed. On a CPU an op has finished when
    its control dependencies let the next one run; on a GPU it has only been queued on the
    device's stream then, so one element of each tensor is brought to the host first and the
    clock waits for the device (on_device: do that; None: when a tensor is on a GPU)."""
    # (a sparse gradient, tf.IndexedSlices, as its values and indices)
    tensors = [t for t in tf.nest.flatten(tensors, expand_composites=True) if t is not None]
    if on_device is None:
        on_device = any("GPU" in (t.device or "").upper() for t in tensors)
    if on_device:
        with tf.device("/device:CPU:0"):
            tensors = [tf.reduce_sum(tf.concat(
                [tf.cast(tf.reshape(t, [-1])[:1], tf.float32) for t in tensors], 0))]
    with tf.control_dependencies(tensors):
        return clock()


def held_until(structure: Any, read: tf.Tensor) -> Any:
    """structure's tensors (a distributed batch's per-replica parts included), each where
    it was made, available only once the clock `read` has been read. Without it the clock
    op waits for a free inter-op thread while the step's first kernels already run on the
    batch, and reads late: with as many inter-op threads as replicas, a large share of an
    epoch of CPU replicas would read as input wait."""
    def held(tensor):  # beside the op that made it (a batch's ops name no device in a trace)
        with tfprivate.colocated_with(tensor), tf.control_dependencies([read]):
            return tf.identity(tensor)
    return tf.nest.map_structure(held, structure, expand_composites=True)


def straggler(compute_seconds: Sequence[float], margin: float = STRAGGLER_MARGIN
              ) -> tuple[int, float] | None:
    """(worker, its compute time over the median of the others') for the slowest worker when
    that ratio passes margin; None otherwise (or with one worker)."""
    if len(compute_seconds) < 2:
        return None
    slowest = max(range(len(compute_seconds)), key=lambda w: compute_seconds[w])
    others = sorted(s for w, s in enumerate(compute_seconds) if w != slowest)
    middle = len(others) // 2
    median = (others[middle] if len(others) % 2 else (others[middle - 1] + others[middle]) / 2)
    if median <= 0:
        return None
    ratio = compute_seconds[slowest] / median
    return (slowest, ratio) if ratio > margin else None


class Spent:
    """Where the training steps' seconds went since it was made (Engine.train_steps adds each
    call's): this worker's seconds waiting for its input, and each worker's seconds computing
    and all-reducing (arrays by worker)."""

    def __init__(self, workers: int = 1):
        self.input_wait = 0.0
        self.compute, self.allreduce = np.zeros(workers), np.zeros(workers)

    def add(self, waited: float, spent: np.ndarray) -> None:
        """One call's: the seconds waited, and [2, workers] seconds computing, all-reducing."""
        self.input_wait += float(waited)
        self.compute, self.allreduce = self.compute + spent[0], self.allreduce + spent[1]

    def figures(self, worker: int, seconds: float) -> dict[str, Any]:
        """An epoch record's timing figures: this worker's seconds waiting for input,
        computing and all-reducing, their shares of the epoch's `seconds`; with several
        workers each worker's compute and all-reduce seconds and the straggler, when one is."""
        figures = {"input_wait_seconds": self.input_wait,
                   "compute_seconds": float(self.compute[worker]),
                   "allreduce_seconds": float(self.allreduce[worker])}
        figures.update({f"{kind}_share": figures[f"{kind}_seconds"] / seconds
                        for kind in ("input_wait", "compute", "allreduce")})
        if len(self.compute) > 1:
            figures["worker_compute_seconds"] = [float(s) for s in self.compute]
            figures["worker_allreduce_seconds"] = [float(s) for s in self.allreduce]
            slow = straggler(self.compute)
            if slow:
                figures["straggler"] = {"worker": slow[0], "ratio": slow[1]}
        return figures
