"""--per_replica_batch_size=auto: the per-replica batch found on these devices at the start.

On a GPU: the largest batch whose training step fits the device's memory. Batches double from
START while a real step (tracing, the first step's allocations) runs, then the last that ran
and the first that did not are bisected to a multiple of GRANULE; an out-of-memory error from
TensorFlow's allocator is a no. An eighth is then left for what the run holds besides one
replica's step (the evaluation step, the all-reduce's buffers, fragmentation), as
Accelerate's find_executable_batch_size leaves room by halving. On a CPU (memory is rarely
the limit there; the speed per image is): the batch that trains the most images per second,
each candidate's steps timed on one replica (advise's measurement: tracing, the first step,
then timed steps), doubling from START until two in a row are slower than the best so far, a
step would take more than MOST_STEP_S, or a batch no longer fits; the smallest batch within
NEAR_BEST of the fastest wins. No batch leaves an epoch fewer than LEAST_STEPS_PER_EPOCH
steps.

Each worker searches on its first device; the workers then take the smallest of their
answers, so every worker trains the same batch. The learning-rate rule is applied to the
global batch it gives (run_plan), and run.json records it: a resumed run trains the same
global batch without searching again.
"""
from __future__ import annotations

import gc
import statistics
import time
from typing import TYPE_CHECKING, Any

import tensorflow as tf

from tfmulti.bench import advise, progress
from tfmulti.errors import UsageError

if TYPE_CHECKING:
    from collections.abc import Callable

START = 16  # the first batch tried
GRANULE = 8  # a GPU's batch is bisected to a multiple of this (tensor cores like 8)
MOST_BATCH = {"cpu": 2048, "gpu": 65536}  # never tried beyond
SPARE = 1 / 8  # of the largest batch that fits, left for the rest of the run (GPU)
SLOWER_IN_A_ROW = 2  # CPU: stop after this many batches slower than the best so far
MOST_STEP_S = 20.0  # CPU: stop before a batch whose step takes longer than this
CANDIDATE_BUDGET_S = 8.0  # CPU: seconds of timed steps for each batch, past its first step
NEAR_BEST = 0.95  # CPU: the smallest batch this close to the fastest wins (more steps an epoch)
LEAST_STEPS_PER_EPOCH = 16  # no batch so large that an epoch has fewer steps than this


def out_of_memory(error: BaseException) -> bool:
    """An error that says the step did not fit: TensorFlow's ResourceExhaustedError (its
    allocators' "OOM when allocating tensor"), or a library's failure for want of memory
    (cuDNN, cuBLAS) that TensorFlow passes on as another kind."""
    if isinstance(error, tf.errors.ResourceExhaustedError):
        return True
    text = str(getattr(error, "message", error)).lower()
    return isinstance(error, tf.errors.OpError) and ("out of memory" in text
                                                     or "oom when allocating" in text)


def largest_fitting(fits: Callable[[int], bool], limit: int, start: int = START
                    ) -> int | None:
    """The largest batch <= limit for which fits(batch) (a real step) is true, doubling from
    `start`, then bisecting to a multiple of GRANULE; None when not even a batch of 1 fits."""
    batch, good, bad = min(start, limit), None, None
    while batch <= limit:
        if fits(batch):
            good = batch
            if batch == limit:
                break
            batch = min(batch * 2, limit)
        else:
            bad = batch
            break
    if good is None:  # start did not fit: halve down to 1
        batch = bad // 2
        while batch >= 1 and not fits(batch):
            batch //= 2
        return batch if batch >= 1 else None
    if bad is None:
        return good
    step = GRANULE if good >= GRANULE else 1
    while bad - good > step:
        middle = (good + bad) // 2 // step * step
        if middle <= good:
            break
        if fits(middle):
            good = middle
        else:
            bad = middle
    return good


def fastest(rate: Callable[[int], tuple[float | None, bool]], limit: int, start: int = START
            ) -> tuple[int | None, dict[int, float | None]]:
    """(the smallest batch within NEAR_BEST of the most examples/s, {batch: examples/s, None
    where it did not fit}) over start, 2 x start, ... <= limit. rate(batch) returns (its
    examples/s, or None when it does not fit; whether a larger batch may be tried: not when
    its step took more than MOST_STEP_S). A few percent of speed is not worth fewer updates
    an epoch."""
    rates, best, slower = {}, None, 0
    batch = min(start, limit)
    while batch <= limit:
        rates[batch], more = rate(batch)
        if rates[batch] is None:
            break
        if best is None or rates[batch] > rates[best]:
            best, slower = batch, 0
        else:
            slower += 1
        if slower >= SLOWER_IN_A_ROW or not more:
            break
        batch *= 2
    if best is not None:
        best = min(b for b, r in rates.items() if r and r >= NEAR_BEST * rates[best])
    return best, rates


def search(device: str, model: str, width: int, dtype: str, data: Any, limit: int,
           jit_compile: bool | Callable[[int], bool] = False,
           say: Callable[[str], None] = print, by: str | None = None) -> dict[str, Any]:
    """The batch found on `device` for this model and data (see the module's docstring):
    {"per_replica_batch_size", "by": "memory" or "speed", "device", "tried": {batch: images/s
    or true/false (it fit), null where it did not fit}, "seconds"}. UsageError when not even
    a batch of 1 fits. jit_compile: each candidate's step with XLA, or a function of the
    batch that says so (--jit_compile=auto: the doctor's verdict for that batch). by: "memory"
    or "speed" (None: memory on a GPU, speed on a CPU; the tests run the GPU's search on a
    CPU whose allocator is capped)."""
    gpu = (by or ("memory" if "GPU" in device.upper() else "speed")) == "memory"
    strategy = tf.distribute.OneDeviceStrategy(device)
    spec = (strategy, model, width, dtype, data)
    limit = max(1, min(limit, MOST_BATCH["gpu" if gpu else "cpu"]))
    started = time.perf_counter()
    tried = {}
    wants_xla = jit_compile if callable(jit_compile) else (lambda batch: jit_compile)
    refused_once = []  # XLA refused the step: the run trains without it, whatever the batch
    tried_xla = {}

    def attempt(batch, measure_it):
        say(f"batch search: per-replica batch {batch} on {device.split('device:')[-1]}...")
        tried_xla[batch] = bool(wants_xla(batch)) and not refused_once
        try:  # a fit: the first step only; a rate: timed steps past it
            measured, refused = advise.measure_run_step(
                spec, batch, advise.MOST_STEPS if measure_it else 0,
                time.perf_counter() + CANDIDATE_BUDGET_S, progress.silent(),
                jit=tried_xla[batch])
            if refused:
                refused_once.append(refused)
                tried_xla[batch] = False
            return measured
        except (tf.errors.OpError, MemoryError) as e:
            if isinstance(e, MemoryError) or out_of_memory(e):
                return None
            raise
        finally:
            gc.collect()

    if gpu:
        def fits(batch):
            tried[batch] = attempt(batch, False) is not None
            return tried[batch]

        found = largest_fitting(fits, limit)
        if found is not None and found > GRANULE:
            found = max(GRANULE, int(found * (1 - SPARE)) // GRANULE * GRANULE)
    else:
        def rate(batch):
            measured = attempt(batch, True)
            if measured is None:
                tried[batch] = None
                return None, False
            step_s = statistics.median(measured["steps_s"])
            tried[batch] = batch / step_s
            return tried[batch], step_s <= MOST_STEP_S

        found, _ = fastest(rate, limit)
    if found is None:
        smallest = min(int(b) for b in tried) if tried else 1
        raise UsageError(f"--per_replica_batch_size=auto: not even a batch of {smallest} fits "
                         f"the memory of {device}; give a smaller batch as a number")
    return {"per_replica_batch_size": found, "by": "memory" if gpu else "speed",
            "device": device, "tried": {str(b): v for b, v in tried.items()},
            "xla": {str(b): v for b, v in tried_xla.items()},  # each candidate timed with it?
            "seconds": time.perf_counter() - started}


def found_line(found: dict[str, Any]) -> str:
    """'per-replica batch 128 (--per_replica_batch_size=auto: ...)': the run's line."""
    batch, device = found["per_replica_batch_size"], found.get("device", "").split("device:")[-1]
    if found.get("resumed"):
        return (f"per-replica batch: {batch} (--per_replica_batch_size=auto: the global batch "
                "found at the run's start, from run.json)")
    if found["by"] == "memory":
        largest = max(int(b) for b, fit in found["tried"].items() if fit)
        return (f"per-replica batch: {batch} (--per_replica_batch_size=auto: {largest} was the "
                f"largest whose step fit {device}'s memory, less {SPARE:.0%} for the "
                f"rest of the run; {found['seconds']:.0f} s)")
    rates = ", ".join(f"{b}: {r:.0f}" if r else f"{b}: did not fit"
                      for b, r in found["tried"].items())
    return (f"per-replica batch: {batch} (--per_replica_batch_size=auto: the smallest within "
            f"{1 - NEAR_BEST:.0%} of the most examples/s on one replica of {device}, {rates}; "
            f"{found['seconds']:.0f} s)")
