"""CPU replicas with glibc's malloc as tfmulti sets it, as TensorFlow leaves it, and TCMalloc.

    python benchmarks/malloc_threshold.py --out=benchmarks/results/malloc_threshold.json   # ~30 min

tf.data sets glibc's mmap threshold to 128 KB once per process when the first generator
dataset's iterator runs, and the datasets tf.distribute makes for each of several devices in
one process are such datasets: every buffer of 128 KB or more is then a mapping of its own,
faulted in again at every step. tfmulti's start-up sets glibc's thresholds after TensorFlow's
(tfmulti/distribution/allocator.py, keep_buffers). Each configuration is `python -m
tfmulti.main` as a user runs it, full-width ResNet-18 on the embedded synthetic set
(--train_size images of 28x28, not Fashion-MNIST), global batch 64, on 1 and 2 CPU replicas,
in each --dtypes, with each malloc, the order rotating over --rounds:
- kept: glibc's malloc, nothing preloaded and no threshold in the environment (a bare
  command: the start-up sets glibc's thresholds);
- as_tensorflow_sets_it: glibc's malloc with GLIBC_TUNABLES=glibc.malloc.trim_threshold=131072
  (glibc's own default trim threshold, given in the environment, so the start-up leaves glibc
  as it is and TensorFlow sets its mmap threshold): glibc's thresholds fixed at 128 KB, how
  a bare command ran on 2 replicas before. (Not on 1: with one replica TensorFlow sets no
  threshold, and glibc moved its own; any threshold given in the environment stops that.)
- tcmalloc: TCMalloc preloaded, as make run starts the main job.
Speed: the training images per second of every epoch after the first (the first traces),
from metrics.json, median per configuration; page faults: the whole process's minor faults
(getrusage of the child). Ratios are of medians from this one invocation.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import onednn  # noqa: E402

sys.path.insert(0, onednn.ROOT)
from tfmulti.distribution import allocator  # noqa: E402

UNTOUCHED = {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=131072"}


def environment(malloc):
    """The environment of a run with `malloc` (a key of MALLOCS)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("LD_PRELOAD", "GLIBC_TUNABLES", allocator.SETTING,
                        *allocator.GLIBC_SETTINGS)}
    if malloc == "tcmalloc":
        return allocator.preload_environment(env, allocator.choose("tcmalloc"))
    return {**env, **(UNTOUCHED if malloc == "as_tensorflow_sets_it" else {})}


MALLOCS = ("kept", "as_tensorflow_sets_it", "tcmalloc")


def run(replicas, dtype, malloc, width, train_size, epochs, folder):
    """(images/s of each epoch after the first, the process's minor page faults, the malloc
    line the run said)."""
    model_dir = os.path.join(folder, f"{replicas}-{dtype}-{malloc}")
    process = subprocess.Popen(
        [sys.executable, "-m", "tfmulti.main", "--model=resnet18", f"--width={width}",
         "--dataset=synthetic", f"--synthetic_train_size={train_size}",
         "--synthetic_test_size=256", f"--cpu_replicas={replicas}", "--global_batch_size=64",
         f"--epochs={epochs}", "--checkpoint_steps=0", f"--model_dir={model_dir}",
         "--overwrite", f"--dtype={dtype}"],
        cwd=onednn.ROOT, env={**environment(malloc), "TF_CPP_MIN_LOG_LEVEL": "2"},
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    out = process.stdout.read()
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        raise SystemExit(f"{model_dir}: exit {process.returncode}")
    with open(os.path.join(model_dir, "metrics.json")) as f:
        metrics = json.load(f)
    said = next((line for line in out.splitlines() if line.startswith("malloc: ")), "")
    return ([r["images_per_sec"] for r in metrics["epochs"][1:]], usage.ru_minflt, said)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--width", type=int, default=64, help="ResNet-18's (the book's 64)")
    parser.add_argument("--train_size", type=int, default=1024)
    parser.add_argument("--dtypes", default="float32,mixed_bfloat16")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    if allocator.choose("auto") is None:
        raise SystemExit("TCMalloc is not installed: " + allocator.INSTALL_HINT)

    rows, folder = [], tempfile.mkdtemp(prefix="tfmulti-malloc-threshold-")
    setups = [(replicas, malloc) for replicas in (1, 2) for malloc in MALLOCS]
    for dtype in args.dtypes.split(","):
        speeds = {f"{n}:{m}": [] for n, m in setups}
        faults, said = {name: [] for name in speeds}, {}
        for r in range(args.rounds):
            for replicas, malloc in setups[r % len(setups):] + setups[:r % len(setups)]:
                name = f"{replicas}:{malloc}"
                got, faulted, said[name] = run(replicas, dtype, malloc, args.width,
                                               args.train_size, args.epochs, folder)
                speeds[name] += got
                faults[name].append(faulted)
        medians = {k: statistics.median(v) for k, v in speeds.items()}
        row = {"dtype": dtype, "images_per_sec_median": medians, "images_per_sec": speeds,
               "page_faults": faults, "malloc_line": said,
               "two_over_one_replica": {m: medians[f"2:{m}"] / medians[f"1:{m}"]
                                        for m in MALLOCS},
               "over_tcmalloc": {k: v / medians[f"{k.split(':')[0]}:tcmalloc"]
                                 for k, v in medians.items()}}
        rows.append(row)
        print(f"{dtype}: " + ", ".join(f"{k} {v:.1f}" for k, v in medians.items())
              + " images/s; 2 over 1 replica: " + ", ".join(
                  f"{m} {v:.2f}" for m, v in row["two_over_one_replica"].items()), flush=True)
    onednn.save("malloc_threshold.py", args, rows)


if __name__ == "__main__":
    main()
