"""The engine against plain Keras `model.fit`, with XLA and without: same model, data, batch,
dtype and devices.

    python benchmarks/enginefit.py --out=benchmarks/results/enginefit.json   # ~45 minutes
    python benchmarks/enginefit.py --replicas=1 \
        --out=benchmarks/results/enginefit_one_replica.json   # one replica only, ~20 minutes

Each row is a model (tfmulti's ResNet-18 at --width 16, LeNet, examples/your_project's
`small_cnn`, and its `own_step_cnn`: the same with a `train_step` of its own, which the engine
runs as fit does), 1 or 2 logical CPU replicas, float32 or mixed_bfloat16, and XLA on or off, on
the embedded synthetic set (--train_size images of 28x28, not Fashion-MNIST), global batch
64, plain SGD at the same rate, --epochs epochs. The engine is `python -m tfmulti.main
--jit_compile=on|off` as a user runs it; Keras is a program as a user writes it, in its own
process: the model built (in a MirroredStrategy's scope on 2 replicas), compiled with
`jit_compile=True|False`, `fit` on a shuffled, batched, prefetched tf.data set. Speed: the
training images/s of every epoch after the first (the first traces and compiles), median;
the ratio engine / fit is of medians from this one invocation, the four runs of a
configuration back to back, their order alternating. Keras's own `jit_compile` after compile
is recorded: Keras turns XLA off under tf.distribute. What ran here: CPU replicas only.

With --rounds=R each configuration runs R times on each side, engine and fit alternating
first; the ratio is of the medians over every round's epochs, and each round's own ratio is
kept (`round_ratios`): a row is ahead beyond the noise only when every round is.

--xla=off,on,auto adds rows where each side runs its own `auto`, as a user who sets nothing
gets it: the engine `--jit_compile=auto` after the doctor measured the verdict for that
configuration (`python -m tfmulti.doctor --jit_compile=auto`, in a cache of the benchmark's
own; its xla line is recorded), Keras `compile(jit_compile="auto")`, its default.

    python benchmarks/enginefit.py --replicas=2 --rounds=2 --xla=off,on,auto \
        --out=benchmarks/results/enginefit_two_replicas.json   # ~60 minutes
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from xla import MODELS, ROOT, doctor, run  # noqa: E402
from yourmodel import fit_epoch_seconds, save  # noqa: E402

BATCH, RATE = 64, 0.1 * 64 / 256  # the engine's base_lr 0.1 per 256, linear rule
# small_cnn with a train_step of its own (Keras's guide's): the engine runs that step as fit
# does, not its fused one; compiled with SGD at RATE
MODELS["own_step"] = ["--model=my_models:own_step_cnn"]


def fit_child(model, replicas, dtype, jit, train_size, epochs, width=0):
    """Plain Keras in this process: prints FIT {"images_per_sec": [...], "keras_jit": ...}."""
    import keras
    import tensorflow as tf

    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0],
        [tf.config.LogicalDeviceConfiguration()] * replicas)
    keras.mixed_precision.set_global_policy(dtype)
    sys.path.insert(0, os.path.join(ROOT, "examples", "your_project"))
    from tfmulti.data import synthetic
    from tfmulti.models import zoo

    (x, y), _ = synthetic.make_dataset(train_size, 256, 0)
    x = x[..., None].astype("float32") / 255
    strategy = (tf.distribute.MirroredStrategy([f"/CPU:{i}" for i in range(replicas)])
                if replicas > 1 else tf.distribute.get_strategy())
    with strategy.scope():
        if model in ("small_cnn", "own_step"):
            import my_models
            net = (my_models.small_cnn if model == "small_cnn" else
                   my_models.own_step_cnn)((28, 28, 1), 10)
        else:
            flags = dict(f[2:].split("=") for f in MODELS[model])
            net = zoo.build(flags["model"], width or int(flags.get("width", 0)), dtype=dtype,
                            seed=0)
        net.compile(optimizer=keras.optimizers.SGD(RATE),
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                    metrics=["accuracy"],
                    jit_compile={"on": True, "off": False, "auto": "auto"}[jit])
    data = (tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(y), seed=0)
            .batch(BATCH, drop_remainder=True).prefetch(tf.data.AUTOTUNE))
    times = fit_epoch_seconds(net, data, epochs)
    images = len(y) // BATCH * BATCH
    print("FIT " + json.dumps({"images_per_sec": [images / t for t in times[1:]],
                               "keras_jit": bool(net.jit_compile)}), flush=True)


def fit(model, replicas, dtype, jit, train_size, epochs, width=0):
    """(images/s of each epoch after the first, Keras's jit_compile) of the fit program
    (width: ResNet-18's, 0: MODELS's)."""
    done = subprocess.run([sys.executable, __file__, "--fit_child",
                           f"{model},{replicas},{dtype},{jit}", f"--train_size={train_size}",
                           f"--epochs={epochs}", f"--fit_width={width}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=1800,
                          env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    if "FIT " not in done.stdout:  # the error's own line, not the graph's tags after it
        said = [line.strip() for line in done.stderr.splitlines()
                if line.strip() and not line.strip().startswith(("[[", "Cf. "))]
        return None, (said or ["no output"])[-1][:300]
    got = json.loads(done.stdout.split("FIT ", 1)[1])
    return got["images_per_sec"], got["keras_jit"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--train_size", type=int, default=2048)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--replicas", default="1,2", help="replica counts to run, e.g. 1")
    parser.add_argument("--rounds", type=int, default=1,
                        help="runs of each side per configuration, their order alternating")
    parser.add_argument("--xla", default="off,on", help="XLA settings to run: off, on, auto")
    parser.add_argument("--dtypes", default="float32,mixed_bfloat16", help="dtypes to run")
    parser.add_argument("--fit_child", default="")
    parser.add_argument("--fit_width", type=int, default=0)
    parser.add_argument("--out", default=os.path.join("benchmarks", "results",
                                                      "enginefit.json"))
    args = parser.parse_args()
    if args.fit_child:
        model, replicas, dtype, jit = args.fit_child.split(",")
        return fit_child(model, int(replicas), dtype, jit, args.train_size, args.epochs,
                         args.fit_width)
    rows, folder = [], tempfile.mkdtemp(prefix="tfmulti-enginefit-")
    for i, (model, replicas, dtype, jit) in enumerate(
            (m, r, d, j) for m in args.models.split(",")
            for r in map(int, args.replicas.split(","))
            for d in args.dtypes.split(",") for j in args.xla.split(",")):
        engine_speeds, fit_speeds, round_ratios, failed = [], [], [], None
        verdict = (doctor(model, replicas, dtype, args.train_size, folder)[1] if jit == "auto"
                   else None)
        for r in range(args.rounds):
            order = ("engine", "fit") if (i + r) % 2 == 0 else ("fit", "engine")
            got = {}
            for which in order:
                if which == "engine":
                    got["engine"] = run(model, replicas, dtype, jit, args.train_size,
                                        args.epochs, folder)
                elif failed is None:
                    got["fit"] = fit(model, replicas, dtype, jit, args.train_size, args.epochs)
            (speeds, engine_xla) = got["engine"]
            engine_speeds += speeds
            if failed is None and got["fit"][0] is None:
                failed = got["fit"][1]
            if failed is None:
                fit_speeds += got["fit"][0]
                keras_jit = got["fit"][1]
                round_ratios.append(statistics.median(speeds)
                                    / statistics.median(got["fit"][0]))
        row = {"model": model, "replicas": replicas, "dtype": dtype, "xla": jit,
               "engine_xla": engine_xla, "engine_images_per_sec": engine_speeds,
               "engine_median": statistics.median(engine_speeds),
               **({"doctor_xla_line": verdict} if verdict else {})}
        if failed is not None:
            row.update(fit_failed=failed)
        else:
            row.update(keras_jit=keras_jit, fit_images_per_sec=fit_speeds,
                       fit_median=statistics.median(fit_speeds),
                       engine_over_fit=statistics.median(engine_speeds)
                       / statistics.median(fit_speeds), round_ratios=round_ratios)
        rows.append(row)
        print(f"{model:10} {replicas} {dtype:15} XLA {jit:3}: engine {row['engine_median']:.0f}"
              + (f", fit {row['fit_median']:.0f} images/s (Keras jit {keras_jit}), "
                 f"{row['engine_over_fit']:.2f}x (rounds "
                 f"{', '.join(f'{x:.2f}' for x in round_ratios)})" if "fit_median" in row
                 else f", fit failed: {failed}"), flush=True)
    for row in rows:  # fit has no XLA on a strategy: the engine's XLA against fit without it
        if "fit_failed" in row:
            plain = next((r for r in rows if "fit_median" in r and r["xla"] == "off" and all(
                r[k] == row[k] for k in ("model", "replicas", "dtype"))), None)
            if plain is not None:
                row["engine_over_fit_without_xla"] = row["engine_median"] / plain["fit_median"]
    done = [r for r in rows if "engine_over_fit" in r]
    summary = {"engine_over_fit_min": min(r["engine_over_fit"] for r in done),
               "engine_over_fit_max": max(r["engine_over_fit"] for r in done),
               "rows_engine_behind": sum(r["engine_over_fit"] < 1 for r in done),
               "rows_ahead_every_round": sum(min(r["round_ratios"]) > 1 for r in done),
               "fit_failed": sum("fit_failed" in r for r in rows), "rows": len(rows),
               "rows_engine_xla_behind_fit_without": sum(
                   r.get("engine_over_fit_without_xla", 2) < 1 for r in rows),
               # each XLA setting's rows: (lowest, highest) engine / fit
               "engine_over_fit_by_xla": {
                   mode: [min(r["engine_over_fit"] for r in done if r["xla"] == mode),
                          max(r["engine_over_fit"] for r in done if r["xla"] == mode)]
                   for mode in args.xla.split(",") if any(r["xla"] == mode for r in done)}}
    save(args, "enginefit.py", summary, rows)


if __name__ == "__main__":
    main()
