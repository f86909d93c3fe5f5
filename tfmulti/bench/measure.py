"""Measuring here: wall times of repeated work, matmul rates, the main job's training steps
(their seconds, and the host's round trip per call), and the link between replicas.

The pieces advise.py (`bench predict`, the doctor), experiments.py and scaling.py time with;
which figures to measure, and for how long, is theirs to decide.
"""
import math
import statistics
import time

import numpy as np
import tensorflow as tf

from tfmulti.accounting.flops import matmul_gflops  # noqa: F401  (its home: MFU's peak)
from tfmulti.bench import stepmodel
from tfmulti.data import checks, pipeline
from tfmulti.models import usermodel


def timed(fn, repeats=5, warmup=1):
    """Median and spread of fn()'s wall time; fn must wait for its own results."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return {"median_s": statistics.median(samples), "min_s": min(samples),
            "max_s": max(samples), "samples_s": samples}


def training_call(strategy, model="resnet18", width=None, per_replica_batch_size=64,
                  steps_per_call=10, dtype="float32", allreduce_dtype="float32",
                  learning_rate=0.1, disposable=False, data=None, jit_compile=False):
    """The main job's training steps (engine and input pipeline) on synthetic images, or on
    the DataSet `data` (its first examples, with its model and task):
    (call(steps) -> seconds for that many steps, waiting for the last; the engine).
    call(0) times one call of the training function with no steps in it. disposable: the
    input as an iterator that can be dropped at once (one replica: disposable_iterator).
    jit_compile: each replica's step compiled with XLA (--jit_compile=on)."""
    from tfmulti.models import task, zoo
    from tfmulti.training import engine, optim

    global_batch = per_replica_batch_size * strategy.num_replicas_in_sync
    if data is None:
        rng = np.random.default_rng(0)
        images = rng.integers(0, 256, (global_batch * 16, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, len(images)).astype(np.int32)
        shape, classes, is_images = (28, 28, 1), 10, True
    else:
        images, labels = data.train_features, data.train_targets
        shape, classes, is_images = data.input_shape, data.num_classes, data.images
    eng = engine.Engine(strategy, lambda: zoo.build(model, width, shape, classes, dtype=dtype,
                                                    seed=0),
                        optim.constant(learning_rate),
                        global_batch, loss_scaling=dtype == "mixed_float16",
                        steps_per_call=steps_per_call, allreduce_dtype=allreduce_dtype,
                        task_fn=None if data is None else lambda m: task.Task(
                            m, data, model, own_step=usermodel.trains_own(m)),
                        jit_compile=jit_compile)
    dataset_fn = pipeline.train_input_fn(images, labels, per_replica_batch_size, seed=0,
                                         images=is_images)
    iterator = (disposable_iterator(strategy, dataset_fn) if disposable
                else iter(eng.distribute(dataset_fn)))

    def call(steps):
        start = time.perf_counter()
        if steps == 0:  # train_steps makes no call for 0 steps: its function, called directly
            losses = eng._train_steps(iterator, tf.constant(0, tf.int64),
                                      tf.constant(0.0, tf.float64))[0]
            losses.numpy()
        for _ in eng.train_steps(iterator, steps):
            pass
        eng.train_results()  # waits for the last step
        return time.perf_counter() - start

    return call, eng


def disposable_iterator(strategy, dataset_fn):
    """One replica's input pipeline as a plain iterator, tf.data's autotuning off: deleting it
    takes no time (an autotuning iterator can wait up to a minute for its tuning thread as
    it is freed: tfprivate.no_autotuning_on_devices). One replica needs no distribution:
    strategy.run takes the batch as it is (on a GPU, copied in the step: 50 KB for 64
    images)."""
    if strategy.num_replicas_in_sync != 1:
        raise ValueError("a disposable iterator is one replica's")
    return iter(checks.untuned(dataset_fn(tf.distribute.InputContext())))


def round_trip_seconds(call, repeats=5):
    """Median seconds of a call of no steps: the host's round trip per call (dispatch, the
    function's start and end, fetching its losses) with no step's work in it."""
    return statistics.median(call(0) for _ in range(repeats))


def time_steps(call, round_trip_s, keep_going):
    """Seconds of single-step calls, each less the round trip of a call, for as long as
    keep_going(the samples so far) says so: each call waits for its step, so each sample is
    one step and the timing can stop after any of them."""
    samples = []
    while keep_going(samples):
        samples.append(max(call(1) - round_trip_s, 1e-9))
    return samples


def measured_link(strategy, megabytes=32.0, repeats=3):
    """A Link from all-reduces across the strategy's replicas: the latency of a 4-byte one
    and the bus bandwidth of a `megabytes` one (nccl-tests' busbw: algbw x 2 (n - 1) / n)."""
    n = strategy.num_replicas_in_sync

    def best_of(elements):
        def fill():
            return tf.ones([elements], tf.float32)

        reduce = tf.function(lambda: strategy.reduce(
            tf.distribute.ReduceOp.SUM, strategy.run(fill), axis=None))
        reduce().numpy()
        best = math.inf
        for _ in range(repeats):
            start = time.perf_counter()
            reduce().numpy()
            best = min(best, time.perf_counter() - start)
        return best

    latency = best_of(1)
    nbytes = megabytes * 1e6
    seconds = max(best_of(int(nbytes // 4)) - latency, 1e-9)
    bus = nbytes / seconds * 2 * (n - 1) / n / 1e9
    return stepmodel.Link(f"measured here across {n} replicas", bus, latency / max(1, 2 * (n - 1)))
