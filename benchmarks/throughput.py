"""The main job's training speed against the plain Keras program and the machine's limit.

    python benchmarks/throughput.py                  # about 10 minutes on 2 cores
    python benchmarks/throughput.py --rounds=1 --batches=64

Measures, for the full-width ResNet-18 on 28x28 inputs:
- the machine's float32 (and bfloat16) matmul GFLOP/s, and so its limit in images/s
  (GFLOP/s / 2.73 GFLOP per training image, forward and backward);
- plain Keras `model.fit` (the plain `model.fit` program a user would write, rewritten
  here) and the engine, float32 and mixed_bfloat16, one replica, per-replica batch 64 and 256;
- the engine on 2 logical CPU replicas at the same global batch, and plain Keras on 2 replicas
  with TensorFlow's default thread pools;
- the input pipeline alone, and an epoch's wall time against steps x step time + evaluation.

Host noise on a shared VM moves single figures by 5-10%, so every figure is a median over
repeats, settings that need their own process (thread pools, logical devices) alternate over
`--rounds`, and variants within one process are interleaved. Ratios are of medians from the
same invocation. JSON with flags, versions and every sample goes to --out.
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
# ResNet-18 (d2l variant), 28x28, forward + backward (counted for this model)
GFLOP_PER_IMAGE = 2.73


# ----------------------------------------------------------------------------- plain Keras

def plain_keras_resnet18(classes=10):
    """The anchor's model, as a user writes it: Keras defaults, no tfmulti code."""
    import keras
    from keras import layers

    def residual(x, ch, stride=1, proj=False):
        y = layers.Conv2D(ch, 3, stride, padding="same")(x)
        y = layers.ReLU()(layers.BatchNormalization()(y))
        y = layers.BatchNormalization()(layers.Conv2D(ch, 3, padding="same")(y))
        if proj:
            x = layers.Conv2D(ch, 1, stride)(x)
        return layers.ReLU()(y + x)

    inp = keras.Input((28, 28, 1))
    x = layers.ReLU()(layers.BatchNormalization()(layers.Conv2D(64, 3, padding="same")(inp)))
    for i, ch in enumerate([64, 128, 256, 512]):
        for j in range(2):
            first = j == 0 and i > 0
            x = residual(x, ch, 2 if first else 1, proj=first)
    x = layers.GlobalAveragePooling2D()(x)
    return keras.Model(inp, layers.Dense(classes)(x))


# ----------------------------------------------------------------------------- one process

def matmul_gflops(dtype, n=2048, reps=10):
    import tensorflow as tf

    a = tf.cast(tf.random.uniform((n, n)), dtype)
    b = tf.cast(tf.random.uniform((n, n)), dtype)
    tf.linalg.matmul(a, b).numpy()
    best = 0.0
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(reps):
            c = tf.linalg.matmul(a, b)
        c.numpy()
        best = max(best, 2 * n ** 3 * reps / (time.perf_counter() - start) / 1e9)
    return best


class KerasFit:
    """model.fit over a prefetched in-memory dataset of `steps` batches.

    Timed from the end of its first batch to the end of its last, so fit()'s own set-up per
    call (iterators, callbacks) is not charged to Keras: a conservative comparison.
    """

    def __init__(self, strategy, batch, steps):
        import keras
        import numpy as np
        import tensorflow as tf

        with strategy.scope():
            self.model = plain_keras_resnet18()
            self.model.compile(keras.optimizers.SGD(0.1),
                               keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        x = np.random.rand(batch * (steps + 1), 28, 28, 1).astype("float32")
        y = np.random.randint(0, 10, len(x))
        self.data = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch).prefetch(2)
        self.batch = batch

    def run(self):
        import keras

        marks = []
        clock = keras.callbacks.LambdaCallback(
            on_train_batch_end=lambda batch, logs: marks.append(time.perf_counter()))
        self.model.fit(self.data, epochs=1, verbose=0, callbacks=[clock])
        return (len(marks) - 1) * self.batch / (marks[-1] - marks[0])


class EngineSteps:
    """The engine's training steps on the project's pipeline, `steps` per timed call."""

    def __init__(self, strategy, per_replica, steps, dtype="float32"):
        import numpy as np

        from tfmulti.data import pipeline
        from tfmulti.models import zoo
        from tfmulti.training import engine, optim

        global_batch = per_replica * strategy.num_replicas_in_sync
        n = global_batch * 16
        rng = np.random.default_rng(0)
        self.images_np = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        self.labels_np = rng.integers(0, 10, n).astype(np.int32)
        self.engine = engine.Engine(
            strategy, lambda: zoo.build("resnet18", dtype=dtype, seed=0), optim.constant(0.1),
            global_batch,
            loss_scaling=dtype == "mixed_float16", steps_per_call=steps)
        self.input_fn = pipeline.train_input_fn(self.images_np, self.labels_np, per_replica, seed=0)
        self.eval_fn = pipeline.eval_input_fn(self.images_np[:global_batch * 2],
                                          self.labels_np[:global_batch * 2], per_replica)
        self.iterator = iter(self.engine.distribute(self.input_fn))
        self.steps, self.global_batch = steps, global_batch

    def run(self):
        start = time.perf_counter()
        for _ in self.engine.train_steps(self.iterator, self.steps):
            pass
        float(self.engine.figures.loss.result())  # waits for the last step
        return self.steps * self.global_batch / (time.perf_counter() - start)

    def pipeline(self, steps=200):
        """Images/s the distributed input pipeline delivers with no model."""
        strategy = self.engine.strategy
        iterator = iter(self.engine.distribute(self.input_fn))
        next(iterator)
        start = time.perf_counter()
        for _ in range(steps):
            element = next(iterator)
        strategy.experimental_local_results(element[0])[0].numpy()
        return steps * self.global_batch / (time.perf_counter() - start)

    def epoch(self, step_rate):
        """(wall seconds of a steady epoch of fit(), steps x step time + its evaluation).

        The second of two epochs: the first pays for creating the iterators and tracing the
        evaluation function once per run."""
        from tfmulti.training import actions, loop

        steps = 2 * self.steps
        ends = [time.perf_counter()]
        history = loop.fit(self.engine, self.input_fn, {"test": (self.eval_fn, 2)}, 2, steps,
                           [actions.AfterEpoch(lambda row: ends.append(time.perf_counter()))])
        wall = ends[2] - ends[1]
        return wall, steps * self.global_batch / step_rate + history[1]["eval_seconds"]


def child(setting, batches, repeats, steps):
    """Measures one setting's variants, interleaved; prints JSON {variant: [images/s ...]}."""
    import tensorflow as tf

    from tfmulti.distribution import devices, startup

    replicas, threads = setting["replicas"], setting["threads"]
    plan = devices.DevicePlan("cpu", replicas)
    if threads == "default":
        if replicas > 1:
            cpu = tf.config.list_physical_devices("CPU")[0]
            tf.config.set_logical_device_configuration(
                cpu, [tf.config.LogicalDeviceConfiguration()] * replicas)
        strategy = devices.make_strategy(plan)  # TensorFlow's default thread pools
    else:
        strategy = startup.Startup(plan).start()
    samples, extra = {}, {}
    if setting.get("matmul"):
        extra["matmul_gflops_float32"] = matmul_gflops(tf.float32)
        extra["matmul_gflops_bfloat16"] = matmul_gflops(tf.bfloat16)
    variants = {}
    for batch in batches:
        per_replica = batch // replicas
        for name, dtype in setting["variants"]:
            key = f"{name}:{dtype}:b{batch}"
            n = max(2, steps * 64 // batch)
            if name == "keras_fit":
                variants[key] = KerasFit(strategy, batch, n)
            else:
                variants[key] = EngineSteps(strategy, per_replica, n, dtype)
    for runner in variants.values():
        runner.run()  # warm-up: tracing, graph optimisation, oneDNN primitive caches
    for _ in range(repeats):
        for key, runner in variants.items():
            samples.setdefault(key, []).append(runner.run())
    for key, runner in variants.items():
        if isinstance(runner, EngineSteps) and key.split(":")[1] == "float32":
            extra[f"pipeline:{key}"] = runner.pipeline()
            rate = statistics.median(samples[key])
            wall, parts = runner.epoch(rate)
            extra[f"epoch_wall_over_parts:{key}"] = wall / parts
    print("RESULT " + json.dumps({"samples": samples, "extra": extra}))


# ----------------------------------------------------------------------------- the report

SETTINGS = [
    {"name": "1 replica", "replicas": 1, "threads": "tfmulti", "matmul": True,
     "variants": [("keras_fit", "float32"), ("engine", "float32"), ("engine", "mixed_bfloat16")]},
    {"name": "2 replicas", "replicas": 2, "threads": "tfmulti",
     "variants": [("engine", "float32")]},
    {"name": "2 replicas, default threads", "replicas": 2, "threads": "default",
     "variants": [("keras_fit", "float32")]},
]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="64,256", help="global batches")
    parser.add_argument("--rounds", type=int, default=2, help="fresh processes per setting")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per variant per round")
    parser.add_argument("--steps", type=int, default=6, help="steps per timed call at batch 64")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results",
                                                      "throughput.json"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.child:
        child(json.loads(args.child), batches, args.repeats, args.steps)
        return
    samples, extra = {}, {}
    for round_ in range(args.rounds):
        for setting in SETTINGS:
            print(f"round {round_ + 1}/{args.rounds}: {setting['name']}", flush=True)
            out = subprocess.run([sys.executable, __file__, "--child", json.dumps(setting),
                                  f"--batches={args.batches}", f"--repeats={args.repeats}",
                                  f"--steps={args.steps}"], capture_output=True, text=True)
            if out.returncode:
                sys.exit(f"benchmark child failed:\n{out.stderr[-3000:]}")
            result = json.loads(out.stdout.split("RESULT ", 1)[1])
            for key, values in result["samples"].items():
                samples.setdefault(f"{setting['name']}|{key}", []).extend(values)
            for key, value in result["extra"].items():
                extra.setdefault(f"{setting['name']}|{key}", []).append(value)
    report(samples, extra, batches, args)


def report(samples, extra, batches, args):
    import tensorflow as tf

    median = {k: statistics.median(v) for k, v in samples.items()}
    spread = {k: (min(v), max(v)) for k, v in samples.items()}
    peak32 = max(extra["1 replica|matmul_gflops_float32"])
    peak16 = max(extra["1 replica|matmul_gflops_bfloat16"])
    limit = peak32 / GFLOP_PER_IMAGE
    print(f"\nmatmul peak: float32 {peak32:.0f} GFLOP/s, bfloat16 {peak16:.0f} GFLOP/s; "
          f"float32 limit {limit:.1f} images/s ({GFLOP_PER_IMAGE} GFLOP per image)")
    print(f"{'setting | variant':52} {'images/s':>9} {'min-max':>13}")
    for key in samples:
        lo, hi = spread[key]
        print(f"{key:52} {median[key]:9.1f} {lo:6.1f}-{hi:<6.1f}")
    ratios = {}
    for b in batches:
        keras32 = median[f"1 replica|keras_fit:float32:b{b}"]
        eng32 = median[f"1 replica|engine:float32:b{b}"]
        ratios[f"b{b}"] = {
            "engine_vs_keras_fit": eng32 / keras32,
            "engine_vs_limit": eng32 / limit,
            "bf16_vs_float32": median[f"1 replica|engine:mixed_bfloat16:b{b}"] / eng32,
            "two_replicas_vs_one": median[f"2 replicas|engine:float32:b{b}"] / eng32,
            "keras_two_replicas_default_threads_vs_one":
                median[f"2 replicas, default threads|keras_fit:float32:b{b}"] / keras32,
            "pipeline_vs_model_1_replica": statistics.median(
                extra[f"1 replica|pipeline:engine:float32:b{b}"]) / eng32,
            "pipeline_vs_model_2_replicas": statistics.median(
                extra[f"2 replicas|pipeline:engine:float32:b{b}"]) / median[
                f"2 replicas|engine:float32:b{b}"],
            "epoch_wall_vs_steps_plus_eval": statistics.median(
                extra[f"1 replica|epoch_wall_over_parts:engine:float32:b{b}"]),
        }
    print("\nratios (targets: engine/keras >= 1.0, engine/limit >= 0.9, bf16/fp32 >= 1.4, "
          "2 replicas/1 >= 0.9, pipeline/model >= 20, epoch wall/parts <= 1.05)")
    for b, r in ratios.items():
        print(f"  global batch {b[1:]}: " + ", ".join(f"{k} {v:.2f}" for k, v in r.items()))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"command": " ".join(sys.argv), "args": vars(args), "cpu_cores": os.cpu_count(),
                   "versions": {"python": platform.python_version(), "tensorflow": tf.__version__},
                   "matmul_gflops": {"float32": peak32, "bfloat16": peak16},
                   "limit_images_per_s": limit, "median": median, "samples": samples,
                   "extra": extra, "ratios": ratios}, f, indent=2)
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
