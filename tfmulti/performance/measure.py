"""`python -m tfmulti.bench predict`: measures one device here, then predicts N devices on M
machines with the step model of stepmodel.py, says what bounds each, and recommends the
per-device batch, --steps_per_call and the dtype.

    python -m tfmulti.bench predict --model=resnet18 --per_replica_batch_size=64 \\
        --predict_devices=1,2,4,8 --predict_machines=1,2,4 --intra_link=nvlink2 --inter_link=eth100
"""
import math
import statistics
import time

import numpy as np
import tensorflow as tf

from tfmulti.performance import stepmodel


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


def matmul_gflops(device, dtype, size, repeats=3):
    """GFLOP/s of a size x size matmul in dtype on device (best of repeats, after a warm-up)."""
    with tf.device(device):
        x = tf.random.stateless_uniform((size, size), seed=[1, 2], dtype=tf.float32)
        x = tf.cast(x, dtype)
        product = tf.function(lambda a: tf.reduce_sum(tf.cast(tf.matmul(a, a)[:1, :1],
                                                              tf.float32)))
        product(x).numpy()
        best = math.inf
        for _ in range(repeats):
            start = time.perf_counter()
            product(x).numpy()
            best = min(best, time.perf_counter() - start)
    return 2 * size ** 3 / best / 1e9


def training_call(strategy, model="resnet18", width=None, per_replica_batch_size=64,
                  steps_per_call=10, dtype="float32", allreduce_dtype="float32",
                  learning_rate=0.1):
    """The main job's training steps (engine and input pipeline) on synthetic images:
    (call(steps) -> seconds for that many steps, waiting for the last; the engine)."""
    from tfmulti.training import data, engine, models, optim

    global_batch = per_replica_batch_size * strategy.num_replicas_in_sync
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (global_batch * 16, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, len(images)).astype(np.int32)
    eng = engine.Engine(strategy, lambda: models.build(model, width, dtype=dtype, seed=0),
                        optim.constant(learning_rate),
                        global_batch, loss_scaling=dtype == "mixed_float16",
                        steps_per_call=steps_per_call, allreduce_dtype=allreduce_dtype)
    iterator = iter(eng.distribute(
        data.train_input_fn(images, labels, per_replica_batch_size, seed=0)))

    def call(steps):
        start = time.perf_counter()
        for _ in eng.train_steps(iterator, steps):
            pass
        float(eng.train_loss.result())  # waits for the last step
        return time.perf_counter() - start

    return call, eng


def step_seconds(strategy, model, width, dtype, batch, steps, steps_per_call, repeats=3):
    """Median seconds per training step of the main job's engine on one device."""
    call, eng = training_call(strategy, model, width, batch, steps_per_call, dtype,
                              learning_rate=0.01)
    call(steps)  # traces and compiles
    return float(np.median([call(steps) / steps for _ in range(repeats)])), eng.model


def measure(strategy, device, model, width, dtype, batch, steps=10):
    """What the prediction needs from this machine: compute at batch and 2 x batch, the host
    round trip per call, the gradients, and matmul rates in float32 and bfloat16."""
    at_batch, keras_model = step_seconds(strategy, model, width, dtype, batch, steps, steps)
    at_double, _ = step_seconds(strategy, model, width, dtype, 2 * batch, steps, steps)
    one_per_call, _ = step_seconds(strategy, model, width, dtype, batch, steps, 1)
    size = 4096 if "GPU" in device.upper() else 1024
    return {
        "batch": batch, "step_s": at_batch, "step_s_double_batch": at_double,
        "call_overhead_s": max(0.0, one_per_call - at_batch) * steps / (steps - 1),
        "gradient_bytes": stepmodel.Model.of_keras(keras_model).gradient_bytes,
        "tensors": stepmodel.Model.of_keras(keras_model).tensors,
        "float32_gflops": matmul_gflops(device, tf.float32, size),
        "bfloat16_gflops": matmul_gflops(device, tf.bfloat16, size),
    }


def measured_link(strategy, megabytes=32.0, repeats=3):
    """A Link from all-reduces across the strategy's replicas: the latency of a 4-byte one
    and the bus bandwidth of a `megabytes` one (nccl-tests' busbw: algbw x 2 (n - 1) / n)."""
    n = strategy.num_replicas_in_sync

    def timed(elements):
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

    latency = timed(1)
    nbytes = megabytes * 1e6
    seconds = max(timed(int(nbytes // 4)) - latency, 1e-9)
    bus = nbytes / seconds * 2 * (n - 1) / n / 1e9
    return stepmodel.Link(f"measured here across {n} replicas", bus, latency / max(1, 2 * (n - 1)))


def table(measured, shared, setup_for, devices_list, machines_list, allreduce_dtype="float32"):
    """Predictions for every (machines, devices) pair, and the compute model used."""
    batch = measured["batch"]
    compute = stepmodel.Compute.from_two(batch, measured["step_s"], 2 * batch,
                                       measured["step_s_double_batch"], shared=shared)
    model = stepmodel.Model(measured["gradient_bytes"], measured["tensors"]).sent_in(
        allreduce_dtype)
    rows = [stepmodel.predict(compute, model, setup_for(n, m), batch)
            for m in machines_list for n in devices_list]
    return compute, model, rows


def format_rows(rows):
    lines = [f"{'machines':>8} {'devices':>7} {'images/s':>10} {'speed-up':>9} "
             f"{'efficiency':>10}  bound (share of the step)"]
    for r in rows:
        step = sum(r.terms.values())
        lines.append(f"{r.machines:>8} {r.devices:>7} {r.images_per_s:>10.1f} {r.speedup:>9.2f} "
                     f"{r.efficiency:>10.0%}  {r.bound} ({r.terms[r.bound] / step:.0%})")
    return "\n".join(lines)
