"""The main job's training speed with each kind of CPU kernels, in one alternating run.

    python benchmarks/onednn.py --out=benchmarks/results/onednn.json   # ~20 minutes, 2 cores

Each configuration is `python -m tfmulti.main` as a user runs it, on the embedded synthetic
set (--train_size images of 28x28, not Fashion-MNIST): tfmulti's ResNet-18 (--width, the
book's 64 by default) and LeNet, on 1 and 2 logical CPU replicas, float32, global batch 64,
with these kernels, the order rotating over --rounds:
- onednn: oneDNN's kernels (TF_ENABLE_ONEDNN_OPTS=1), as this CPU allows them;
- onednn_avx2: oneDNN held to AVX2 (ONEDNN_MAX_CPU_ISA=AVX2): the code it runs on x86 CPUs
  without AVX-512, where TensorFlow runs Eigen's unless told (see tfmulti/kernels.py for why
  tfmulti does not turn it on there);
- eigen: TF_ENABLE_ONEDNN_OPTS=0, Eigen's kernels (TensorFlow's default on CPUs without
  AVX-512 VNNI, bfloat16 or AMX).
Speed: the training images per second of every epoch after the first (the first traces),
from metrics.json; median per configuration; ratios are of medians from this one invocation.
The CPU is named in the JSON: the kernels' speeds differ from one CPU to another.
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from quickstart import cpu_name  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNELS = {"onednn": {"TF_ENABLE_ONEDNN_OPTS": "1"},
           "onednn_avx2": {"TF_ENABLE_ONEDNN_OPTS": "1", "ONEDNN_MAX_CPU_ISA": "AVX2"},
           "eigen": {"TF_ENABLE_ONEDNN_OPTS": "0"}}


def run(model, width, replicas, kernels, train_size, epochs, folder, extra=(), name=""):
    """The training images/s of each epoch after the first, and what run.json says of the
    kernels and threads (kernels: a KERNELS key, or any other for this CPU's own; extra: more
    flags; name: the run's folder, by default model-replicas-kernels)."""
    model_dir = os.path.join(folder, name or f"{model}-{replicas}-{kernels}")
    env = {k: v for k, v in os.environ.items()
           if k not in ("TF_ENABLE_ONEDNN_OPTS", "ONEDNN_MAX_CPU_ISA")}
    done = subprocess.run(
        [sys.executable, "-m", "tfmulti.main", f"--model={model}",
         *([f"--width={width}"] if model == "resnet18" else []), "--dataset=synthetic",
         f"--synthetic_train_size={train_size}", "--synthetic_test_size=256",
         f"--cpu_replicas={replicas}", "--global_batch_size=64", f"--epochs={epochs}",
         "--checkpoint_steps=0", f"--model_dir={model_dir}", "--overwrite", *extra],
        cwd=ROOT, env={**env, "TF_CPP_MIN_LOG_LEVEL": "2", **KERNELS.get(kernels, {})},
        capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"{model_dir}: {done.stderr.strip().splitlines()[-1:]}")
    with open(os.path.join(model_dir, "metrics.json")) as f:
        metrics = json.load(f)
    return [r["images_per_sec"] for r in metrics["epochs"][1:]], metrics["cpu_kernels"]


def add_malloc_flag(parser):
    """--malloc=tcmalloc: every process the benchmark starts (tfmulti's runs and its peers'
    alike) with TCMalloc preloaded, as make run starts the main job; unset: as this
    process's environment has it (glibc's malloc unless LD_PRELOAD says otherwise)."""
    parser.add_argument("--malloc", default="", choices=["", "tcmalloc"],
                        help="tcmalloc: every process started with TCMalloc preloaded")


def use_malloc(args):
    """Puts the --malloc choice in the environment every started process inherits (save
    records what they got: preloaded_malloc)."""
    from tfmulti.distribution import allocator

    if args.malloc:
        os.environ.update(allocator.preload_environment(os.environ, allocator.choose("tcmalloc")))


def preloaded_malloc():
    """The malloc the processes started from here get: "tcmalloc", "system" (nothing in
    LD_PRELOAD) or LD_PRELOAD as it is."""
    preloaded = os.environ.get("LD_PRELOAD", "")
    return "tcmalloc" if "tcmalloc" in preloaded else "system" if not preloaded else preloaded


def save(script, args, rows):
    """A CPU benchmark's record: its command, arguments, the CPU and its AVX-512 flags, the
    versions and the rows; written to args.out (relative to the current folder, as
    benchmarks/README.md says) when given."""
    import tensorflow as tf

    with open("/proc/cpuinfo") as f:
        flags = f.read().split()
    result = {"command": f"python benchmarks/{script} " + " ".join(sys.argv[1:]),
              "args": vars(args), "cpu_cores": os.cpu_count(), "cpu": cpu_name(),
              "cpu_flags_avx512": sorted({f for f in flags if f.startswith("avx512")}),
              "versions": {"python": platform.python_version(), "tensorflow": tf.__version__},
              "malloc": preloaded_malloc(), "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--width", type=int, default=64, help="ResNet-18's (the book's 64)")
    parser.add_argument("--train_sizes", default="resnet18:1024,lenet:8192")
    parser.add_argument("--kernels", default=",".join(KERNELS))
    parser.add_argument("--out", default="")
    args = parser.parse_args()

    rows, folder = [], tempfile.mkdtemp(prefix="tfmulti-onednn-")
    kinds = args.kernels.split(",")
    for model, size in (part.split(":") for part in args.train_sizes.split(",")):
        for replicas in (1, 2):
            speeds, said = {k: [] for k in kinds}, {}
            for r in range(args.rounds):
                for kernels in kinds[r % len(kinds):] + kinds[:r % len(kinds)]:
                    got, said[kernels] = run(model, args.width, replicas, kernels, int(size),
                                             args.epochs, folder)
                    speeds[kernels] += got
            medians = {k: statistics.median(v) for k, v in speeds.items()}
            row = {"model": model, "replicas": replicas, "train_size": int(size),
                   "images_per_sec_median": medians, "images_per_sec": speeds,
                   "cpu_kernels": said,
                   "ratio_over_eigen": {k: medians[k] / medians["eigen"] for k in kinds}
                   if "eigen" in medians else None}
            rows.append(row)
            print(f"{model:9} {replicas} replica(s) " + ", ".join(
                f"{k} {v:.0f}" for k, v in medians.items()) + " images/s", flush=True)
    for model in {row["model"] for row in rows}:  # N replicas against one, each kernel
        one, two = (next(r for r in rows if r["model"] == model and r["replicas"] == n)
                    for n in (1, 2))
        two["ratio_over_one_replica"] = {k: two["images_per_sec_median"][k]
                                         / one["images_per_sec_median"][k] for k in kinds}
    save("onednn.py", args, rows)


if __name__ == "__main__":
    main()
