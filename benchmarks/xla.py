"""--jit_compile=on against off: the main job's training speed with and without XLA.

    python benchmarks/xla.py --out=benchmarks/results/xla.json   # ~15 minutes, 2 cores
    python benchmarks/xla.py --modes=auto,off --out=benchmarks/results/xla_auto.json

Each configuration is `python -m tfmulti.main` as a user runs it, once with --jit_compile=on
and once with off, the order alternating over --rounds, on the embedded synthetic set
(--train_size images of 28x28, not Fashion-MNIST): tfmulti's ResNet-18 (--width 16), LeNet
(the book's width) and a user's model (examples/your_project's `small_cnn`: conv blocks with
batch norm, dropout and an L2 penalty), on 1 and 2 logical CPU replicas, in float32 and
mixed_bfloat16, global batch 64. Speed: the training images per second of every epoch after
the first (the first traces and compiles), from metrics.json; median per configuration; the
ratio on / off is of medians from this one invocation. What ran here: CPU replicas only; XLA
on a GPU was not run.

--modes=auto,off runs `--jit_compile=auto` against off: before a configuration's runs, the
doctor (`python -m tfmulti.doctor --jit_compile=auto` with the same flags) measures XLA's
verdict, as a user would, into a cache of the benchmark's own; its seconds and its xla line
are recorded, and whether each auto run trained with XLA (metrics.json's `xla`).
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from quickstart import cpu_name  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = {"resnet18": ["--model=resnet18", "--width=16"], "lenet": ["--model=lenet"],
          "small_cnn": ["--model=my_models:small_cnn"]}


def environment(folder):
    """The runs' environment: the user model's folder importable, the caches (XLA's verdicts
    among them) the benchmark's own."""
    return {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "XDG_CACHE_HOME": os.path.join(folder,
                                                                                  "cache"),
            "PYTHONPATH": os.path.join(ROOT, "examples", "your_project")}


def flags(model, replicas, dtype, jit, train_size):
    return [*MODELS[model], "--dataset=synthetic", f"--synthetic_train_size={train_size}",
            "--synthetic_test_size=256", f"--cpu_replicas={replicas}", f"--dtype={dtype}",
            f"--jit_compile={jit}", "--global_batch_size=64"]


def doctor(model, replicas, dtype, train_size, folder):
    """(seconds, the xla line) of the doctor measuring XLA's verdict for this configuration."""
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "tfmulti.doctor", *flags(model, replicas, dtype, "auto",
                                                         train_size),
         f"--model_dir={os.path.join(folder, 'doctor')}"],
        cwd=ROOT, env=environment(folder), capture_output=True, text=True, timeout=1800)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"doctor: {done.stderr.strip().splitlines()[-1:]}")
    return seconds, next(line.strip() for line in done.stdout.splitlines()
                         if line.strip().startswith("xla:"))


def run(model, replicas, dtype, jit, train_size, epochs, folder):
    """The training images/s of each epoch after the first, and the run's XLA."""
    model_dir = os.path.join(folder, f"{model}-{replicas}-{dtype}-{jit}")
    done = subprocess.run(
        [sys.executable, "-m", "tfmulti.main", *flags(model, replicas, dtype, jit, train_size),
         f"--epochs={epochs}", "--checkpoint_steps=0", f"--model_dir={model_dir}",
         "--overwrite"],
        cwd=ROOT, env=environment(folder), capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"{model_dir}: {done.stderr.strip().splitlines()[-1:]}")
    with open(os.path.join(model_dir, "metrics.json")) as f:
        metrics = json.load(f)
    return [r["images_per_sec"] for r in metrics["epochs"][1:]], metrics["xla"]


def summary(rows, first, second, per_run):
    """The ratios first / second (lowest, highest), the rows where each mode trained with XLA,
    and the noise they stand in: each run's median images/s (per_run epochs a run), and the
    largest ratio between two runs of the same mode of one configuration (the same step,
    separate processes)."""
    def runs(speeds):
        return [statistics.median(speeds[i:i + per_run]) for i in range(0, len(speeds), per_run)]

    ratios = [row[f"ratio_{first}_over_{second}"] for row in rows]
    same = [max(r) / min(r) for row in rows for speeds in row["images_per_sec"].values()
            for r in [runs(speeds)] if len(r) > 1]
    return {f"ratio_{first}_over_{second}": [min(ratios), max(ratios)],
            "rows_with_xla": {mode: sum(any(row["xla_compiled"][mode]) for row in rows)
                              for mode in (first, second)},
            "rows": len(rows),
            "same_mode_run_ratio_max": max(same) if same else None}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--train_size", type=int, default=2048)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--modes", default="on,off", help="the two --jit_compile to compare")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    import tensorflow as tf

    rows, folder = [], tempfile.mkdtemp(prefix="tfmulti-xla-")
    first, second = args.modes.split(",")
    for model in args.models.split(","):
        for replicas in (1, 2):
            for dtype in ("float32", "mixed_bfloat16"):
                row = {"model": model, "replicas": replicas, "dtype": dtype}
                if first == "auto":
                    row["doctor_seconds"], row["doctor_xla_line"] = doctor(
                        model, replicas, dtype, args.train_size, folder)
                speeds = {first: [], second: []}
                compiled = {first: [], second: []}
                for r in range(args.rounds):
                    for jit in ((first, second) if r % 2 == 0 else (second, first)):
                        got, xla = run(model, replicas, dtype, jit, args.train_size,
                                       args.epochs, folder)
                        speeds[jit] += got
                        compiled[jit].append(xla)
                row.update({
                    # whether each run trained with XLA (metrics.json's xla), by mode
                    "xla_compiled": compiled,
                    "images_per_sec_median": {k: statistics.median(v)
                                              for k, v in speeds.items()},
                    "images_per_sec": speeds})
                ratio = (row["images_per_sec_median"][first]
                         / row["images_per_sec_median"][second])
                row[f"ratio_{first}_over_{second}"] = ratio
                rows.append(row)
                print(f"{model:10} {replicas} replica(s) {dtype:15} XLA {first}/{second} "
                      f"{ratio:.2f}x ({row['images_per_sec_median'][first]:.0f}"
                      f" vs {row['images_per_sec_median'][second]:.0f} images/s)", flush=True)
    result = {"command": "python benchmarks/xla.py " + " ".join(sys.argv[1:]),
              "args": vars(args), "cpu_cores": os.cpu_count(), "cpu": cpu_name(),
              "versions": {"python": platform.python_version(), "tensorflow": tf.__version__},
              "summary": summary(rows, first, second, args.epochs - 1), "rows": rows}
    if args.out:
        with open(args.out, "w") as f:  # relative to the current folder, as every benchmark's
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
