"""What --prune=median saves in a tuning session, and what it costs in the trial it finds.

    python benchmarks/pruning.py --out=benchmarks/results/pruning.json   # ~12 minutes, 2 cores

For each seed, the same random search runs twice as `python -m tfmulti.tune` would run it,
once without pruning and once with --prune=median, in alternating order: a LeNet of width 8
on the embedded synthetic set (8192 training images, a tenth held out for validation; not
Fashion-MNIST, which cannot be fetched here), 2 CPU replicas, --trials trials of --epochs
epochs, batches of 32 or 64 per replica, base_lr drawn on a log scale over 0.001-3 (a range
with hopeless rates in it, as a first search has), --deterministic. Random search draws the
same trials for a seed whatever the figures, so both sessions see the same trials and
pruning can only lose the best one by stopping it. A trial also spends seconds that pruning
cannot save (its process and runtime starting, the first epoch's tracing): the time ratio is
of whole sessions, as a user waits for them.

Recorded per seed: each session's wall time, its best val_accuracy and which trial it was,
the trials pruned; in the summary the time ratio (pruned / full) and in how many seeds the
pruned session found the same best trial.
"""
import argparse
import csv
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SESSION = ["--dataset=synthetic", "--synthetic_train_size=8192", "--synthetic_test_size=512",
           "--cpu_replicas=2", "--model=lenet", "--width=8", "--tuner=random",
           "--tune_batch_sizes=32,64", "--tune_lr_range=0.001,3", "--tune_warmup_epochs=0",
           "--deterministic"]


def session(folder, seed, trials, epochs, prune):
    """(wall seconds, trials.csv rows) of one session in folder."""
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "tfmulti.tune", *SESSION, f"--seed={seed}",
                          f"--max_trials={trials}", f"--epochs={epochs}", f"--prune={prune}",
                          f"--model_dir={folder}"], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": ROOT})
    seconds = time.perf_counter() - start
    if out.returncode != 0:
        sys.exit(f"the session failed:\n{out.stderr[-3000:]}")
    with open(os.path.join(folder, "trials.csv")) as f:
        return seconds, list(csv.DictReader(f))


def best_of(rows):
    done = [r for r in rows if r["status"] == "COMPLETED"]
    best = max(done, key=lambda r: float(r["val_accuracy"]))
    return int(best["trial"]), float(best["val_accuracy"])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--out", default=os.path.join("benchmarks", "results", "pruning.json"))
    args = parser.parse_args()
    runs = []
    with tempfile.TemporaryDirectory() as scratch:
        for i, seed in enumerate(int(s) for s in args.seeds.split(",")):
            result = {"seed": seed}
            for prune in (("none", "median") if i % 2 == 0 else ("median", "none")):
                folder = os.path.join(scratch, f"{seed}-{prune}")
                seconds, rows = session(folder, seed, args.trials, args.epochs, prune)
                trial, figure = best_of(rows)
                result[prune] = {"seconds": seconds, "best_trial": trial,
                                 "best_val_accuracy": figure,
                                 "pruned": [r["status"] for r in rows
                                            if r["status"].startswith("PRUNED")],
                                 "trials": rows}
                shutil.rmtree(folder)
                print(f"seed {seed} prune={prune:>6}: {seconds:6.1f} s, best trial {trial} "
                      f"val_accuracy {figure:.4f}, {len(result[prune]['pruned'])} pruned",
                      flush=True)
            runs.append(result)
    ratios = [r["median"]["seconds"] / r["none"]["seconds"] for r in runs]
    summary = {
        "time_ratio_pruned_over_full": ratios,
        "time_ratio_median": statistics.median(ratios),
        "same_best_trial": sum(r["median"]["best_trial"] == r["none"]["best_trial"]
                               for r in runs),
        "seeds": len(runs),
        "best_val_accuracy_full": [r["none"]["best_val_accuracy"] for r in runs],
        "best_val_accuracy_pruned": [r["median"]["best_val_accuracy"] for r in runs],
        "trials_pruned": [len(r["median"]["pruned"]) for r in runs]}
    import tensorflow as tf

    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"command": " ".join(["python", "benchmarks/pruning.py", *sys.argv[1:]]),
                   "args": vars(args), "cpu_cores": os.cpu_count(),
                   "versions": {"python": platform.python_version(),
                                "tensorflow": tf.__version__},
                   "summary": summary, "runs": runs}, f, indent=2)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
