"""Your model on tfmulti's engine against the same model in plain Keras `model.fit`.

    python benchmarks/yourmodel.py --out=benchmarks/results/yourmodel.json   # ~6 minutes, 2 cores
    python benchmarks/yourmodel.py --data=synthetic \
        --out=benchmarks/results/yourmodel-synthetic.json
    python benchmarks/yourmodel.py --data=reviews --out=benchmarks/results/yourmodel-text.json
    python benchmarks/yourmodel.py --data=houses --out=benchmarks/results/yourmodel-regression.json

The model is examples/your_project's `small_cnn` (two conv blocks with batch norm, dropout and
an L2 penalty); the data its `shapes` (3000 + 600 RGB images of 32x32, 3 classes, an easy
task), or with --data=synthetic tfmulti's embedded Fashion-like set (12000 + 2000 grayscale
images of 28x28, 10 classes, harder: not Fashion-MNIST, which cannot be fetched here). Beyond
images, from examples/your_task: --data=reviews trains its `text_classifier` (an embedding of
token ids, averaged: 4000 + 1000 reviews, 3 sentiments) and --data=houses its
`price_regression` (named inputs, mse, reported as mae: 4000 + 1000 houses). Both programs
train on 2 logical CPU replicas (MirroredStrategy), global batch 64, float32, SGD with
momentum 0.9 at learning rate 0.1, for --epochs epochs, from the same seed:

- engine: `tfmulti.training.train.train_and_evaluate`, what `python -m tfmulti.main` runs;
- fit: the program a Keras user writes: the model built in `strategy.scope()`, compiled with
  the same loss (cross-entropy from logits, or the regression's mse), optimizer and metric,
  `model.fit` on a shuffled, batched `tf.data` set (Keras shards it over the replicas), then
  `model.evaluate` on the test set.

Each program runs in a process of its own (its own runtime and devices), alternating over
--rounds. Speed: the training images per second of every epoch after the first (the first
traces and compiles), median per program; the ratio engine / fit is of medians from this one
invocation. Quality: each program's test accuracy (the regression's test mae) after the
last epoch, every round.
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
PROJECT = os.path.join(ROOT, "examples", "your_project")
TASK_PROJECT = os.path.join(ROOT, "examples", "your_task")
# --data: (the project, its model function, its data function or None, the metric compared)
KINDS = {"shapes": (PROJECT, "small_cnn", "shapes", "accuracy"),
         "synthetic": (PROJECT, "small_cnn", None, "accuracy"),
         "reviews": (TASK_PROJECT, "text_classifier", "reviews", "accuracy"),
         "houses": (TASK_PROJECT, "price_regression", "houses", "mae")}
GLOBAL_BATCH, LEARNING_RATE, MOMENTUM, REPLICAS = 64, 0.1, 0.9, 2


def start_devices():
    import tensorflow as tf

    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0],
        [tf.config.LogicalDeviceConfiguration()] * REPLICAS)
    return tf.distribute.MirroredStrategy([f"/CPU:{i}" for i in range(REPLICAS)])


SYNTHETIC_SIZES = (12000, 2000)  # --data=synthetic: train and test images


def engine(epochs, seed, which="shapes"):
    """tfmulti's main job in this process: (examples/s of each epoch, final test metric)."""
    project, model, data, metric = KINDS[which]
    sys.path.insert(0, project)
    from tfmulti.data import sources
    from tfmulti.distribution import startup
    from tfmulti.models.task import record_key
    from tfmulti.run.config import RunConfig
    from tfmulti.training import train

    cfg = RunConfig(model=f"my_models:{model}",
                    dataset=f"my_data:{data}" if data else "synthetic",
                    synthetic_train_size=SYNTHETIC_SIZES[0],
                    synthetic_test_size=SYNTHETIC_SIZES[1], cpu_replicas=REPLICAS,
                    global_batch_size=GLOBAL_BATCH, base_lr=LEARNING_RATE * 256 / GLOBAL_BATCH,
                    momentum=MOMENTUM, epochs=epochs, seed=seed)
    strategy = startup.from_config(cfg).start()
    dataset = sources.load_for(cfg)
    _, history = train.train_and_evaluate(strategy, dataset, cfg, verbose=0)
    return ([r["images_per_sec"] for r in history],
            history[-1][record_key("test", metric)])


def fit(epochs, seed, which="shapes"):
    """The same model and data in plain Keras model.fit: (examples/s of each epoch, the
    test metric)."""
    project, model_name, data, metric = KINDS[which]
    sys.path.insert(0, project)
    import keras
    import my_data
    import my_models
    import tensorflow as tf

    from tfmulti.data import synthetic

    strategy = start_devices()
    keras.utils.set_random_seed(seed)
    if data:
        (x, y), (tx, ty), *_ = getattr(my_data, data)()
    else:  # the engine's synthetic set of this seed, with the channel axis it adds
        (x, y), (tx, ty) = synthetic.make_dataset(*SYNTHETIC_SIZES, seed)
        x, tx = x[..., None], tx[..., None]
    if getattr(x, "dtype", None) == "uint8":  # images, scaled as the engine scales them
        x, tx = x.astype("float32") / 255, tx.astype("float32") / 255
    classes = int(max(y.max(), ty.max())) + 1 if metric == "accuracy" else 0
    shape = {k: v.shape[1:] for k, v in x.items()} if isinstance(x, dict) else x.shape[1:]
    with strategy.scope():
        model = getattr(my_models, model_name)(shape, classes)
        model.compile(optimizer=keras.optimizers.SGD(LEARNING_RATE, momentum=MOMENTUM),
                      loss=(keras.losses.SparseCategoricalCrossentropy(from_logits=True)
                            if metric == "accuracy" else "mse"), metrics=[metric])
    train = (tf.data.Dataset.from_tensor_slices((x, y))
             .shuffle(len(y), seed=seed).batch(GLOBAL_BATCH, drop_remainder=True)
             .prefetch(tf.data.AUTOTUNE))
    test = tf.data.Dataset.from_tensor_slices((tx, ty)).batch(256)
    times = fit_epoch_seconds(model, train, epochs)
    _, accuracy = model.evaluate(test, verbose=0)
    images = (len(y) // GLOBAL_BATCH) * GLOBAL_BATCH
    return [images / t for t in times], accuracy


def fit_epoch_seconds(model, train, epochs):
    """model.fit(train) for `epochs` epochs: the seconds of each epoch."""
    import keras

    times = []

    class Timer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            times.append(time.perf_counter() - self.start)

    model.fit(train, epochs=epochs, verbose=0, callbacks=[Timer()])
    return times


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--data", choices=tuple(KINDS), default="shapes")
    parser.add_argument("--out", default=os.path.join("benchmarks", "results", "yourmodel.json"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        program, seed = args.child.split(":")
        rates, accuracy = {"engine": engine, "fit": fit}[program](args.epochs, int(seed),
                                                                  args.data)
        print("RESULT " + json.dumps({"rates": rates, "accuracy": accuracy}))
        return
    runs, metric = {"engine": [], "fit": []}, KINDS[args.data][3]
    for round_ in range(args.rounds):
        order = ("engine", "fit") if round_ % 2 == 0 else ("fit", "engine")
        for program in order:
            out = subprocess.run([sys.executable, __file__, f"--epochs={args.epochs}",
                                  f"--data={args.data}", f"--child={program}:{round_}"],
                                 cwd=ROOT, capture_output=True,
                                 text=True, env={**os.environ, "PYTHONPATH": ROOT})
            line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
            if out.returncode != 0 or not line:
                sys.exit(f"{program} failed:\n{out.stderr[-3000:]}")
            result = json.loads(line[0][len("RESULT "):])
            runs[program].append({"seed": round_, **result})
            print(f"round {round_ + 1} {program:>6}: {statistics.median(result['rates'][1:]):7.0f} "
                  f"examples/s, test {metric} {result['accuracy']:.4f}", flush=True)
    summary, key = {}, "test_acc" if metric == "accuracy" else f"test_{metric}"
    for program, results in runs.items():
        steady = [r for run in results for r in run["rates"][1:]]
        summary[program] = {"images_per_sec_median": statistics.median(steady),
                            key: [run["accuracy"] for run in results],
                            f"{key}_mean": statistics.mean(run["accuracy"] for run in results)}
    summary["speed_ratio_engine_over_fit"] = (summary["engine"]["images_per_sec_median"]
                                              / summary["fit"]["images_per_sec_median"])
    if metric == "accuracy":
        summary["test_acc_engine_minus_fit_points"] = 100 * (summary["engine"]["test_acc_mean"]
                                                             - summary["fit"]["test_acc_mean"])
    else:
        summary[f"{key}_engine_minus_fit"] = (summary["engine"][f"{key}_mean"]
                                              - summary["fit"][f"{key}_mean"])
    save(args, "yourmodel.py", summary, runs)


def save(args, script, summary, runs):
    """The result JSON at args.out: the command that writes it, the machine, the figures."""
    import tensorflow as tf

    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"command": " ".join(["python", f"benchmarks/{script}", *sys.argv[1:]]),
                   "args": vars(args), "cpu_cores": os.cpu_count(), "cpu": _cpu(),
                   "versions": {"python": platform.python_version(),
                                "tensorflow": tf.__version__},
                   "summary": summary, "runs": runs}, f, indent=2)
    print(json.dumps(summary, indent=2))


def _cpu():
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


if __name__ == "__main__":
    main()
