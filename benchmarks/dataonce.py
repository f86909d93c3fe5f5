"""A tuning session on a folder of images: the images decoded once by the session (the
default) against every trial reading the files each epoch (--nodecode_once).

    python benchmarks/dataonce.py --out=benchmarks/results/dataonce.json   # ~5 minutes, 2 cores

The images are examples/your_project's `shapes` (3000 + 600 RGB images of 32x32, 3 classes)
written once as PNG files, as benchmarks/folder.py writes them. Each round runs the same
session twice, `python -m tfmulti.tune --dataset=folder:DIR` as a user runs it, once each
way, the order alternating over --rounds: a LeNet of width 8 on 2 CPU replicas, --trials
trials of --epochs epochs, --deterministic (the same trials and figures either way).

Recorded per session: its wall time; the seconds the session spent decoding (its own line);
for each trial, the seconds before its first epoch began and after its last ended (its
process, runtime and pipeline starting: the trial's time less its epochs' training and
evaluation), and the training images/s of every epoch after the first (metrics.json of its
run folder). The summary gives the ratios, decoded once / files, of medians.
"""
import argparse
import csv
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from folder import write_folder  # noqa: E402
from yourmodel import save  # noqa: E402

SESSION = ["--model=lenet", "--width=8", "--cpu_replicas=2", "--tuner=random",
           "--tune_batch_sizes=32", "--tune_lr_range=0.01,0.2", "--tune_warmup_epochs=0",
           "--deterministic"]


def session(folder, data, trials, epochs, once):
    """One session in `folder`: its figures (see the module's docstring)."""
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "tfmulti.tune", *SESSION, f"--dataset={data}",
                          f"--max_trials={trials}", f"--epochs={epochs}",
                          "--decode_once" if once else "--nodecode_once",
                          f"--model_dir={folder}"], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": ROOT})
    seconds = time.perf_counter() - start
    if out.returncode != 0:
        sys.exit(f"the session failed:\n{out.stderr[-3000:]}")
    decoding = re.search(r"decoded in ([0-9.]+) s\)", out.stdout)
    with open(os.path.join(folder, "trials.csv")) as f:
        rows = list(csv.DictReader(f))
    trials_seen = []
    for row in rows:
        with open(os.path.join(folder, "trials", f"trial_{row['trial']}", "run",
                               "metrics.json")) as f:
            history = json.load(f)["epochs"]
        in_epochs = sum(r["seconds"] + r["eval_seconds"] for r in history)
        trials_seen.append({"trial": row["trial"], "seconds": float(row["seconds"]),
                            "outside_epochs": float(row["seconds"]) - in_epochs,
                            "images_per_sec": [r["images_per_sec"] for r in history[1:]],
                            "val_accuracy": float(row["val_accuracy"])})
    return {"seconds": seconds, "decoding_seconds": float(decoding[1]) if decoding else 0.0,
            "trials": trials_seen}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--out", default=os.path.join("benchmarks", "results", "dataonce.json"))
    args = parser.parse_args()
    runs = {"once": [], "files": []}
    with tempfile.TemporaryDirectory(prefix="tfmulti-dataonce-bench-") as root:
        files = write_folder(os.path.join(root, "images"))
        for round_ in range(args.rounds):
            for way in (("once", "files") if round_ % 2 == 0 else ("files", "once")):
                result = session(os.path.join(root, f"{round_}-{way}"),
                                 f"folder:{os.path.join(root, 'images')}", args.trials,
                                 args.epochs, way == "once")
                runs[way].append(result)
                rates = [r for t in result["trials"] for r in t["images_per_sec"]]
                print(f"round {round_ + 1} {way:>5}: session {result['seconds']:6.1f} s "
                      f"(decoding {result['decoding_seconds']:.1f} s), "
                      f"{statistics.median(rates):6.0f} images/s", flush=True)

    def median(way, key):
        return statistics.median(t[key] for r in runs[way] for t in r["trials"])

    def rate(way):
        return statistics.median(x for r in runs[way] for t in r["trials"]
                                 for x in t["images_per_sec"])

    session_seconds = {w: statistics.median(r["seconds"] for r in runs[w]) for w in runs}
    summary = {
        "session_seconds_median": session_seconds,
        "session_time_ratio_once_over_files": session_seconds["once"] / session_seconds["files"],
        "images_per_sec_median": {w: rate(w) for w in runs},
        "epoch_speed_ratio_once_over_files": rate("once") / rate("files"),
        "trial_seconds_outside_epochs_median": {w: median(w, "outside_epochs") for w in runs},
        "decoding_seconds_median": statistics.median(r["decoding_seconds"]
                                                     for r in runs["once"]),
        "same_val_accuracy": all(
            [t["val_accuracy"] for t in a["trials"]] == [t["val_accuracy"] for t in b["trials"]]
            for a, b in zip(runs["once"], runs["files"])),
        "train_files": files}
    save(args, "dataonce.py", summary, runs)


if __name__ == "__main__":
    main()
