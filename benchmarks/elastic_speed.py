"""What the exact elastic resume costs: a run resumed on 1 replica after 2, whose steps take
the 2 replicas' batches as micro-batches with a replica's threads (bit for bit the
uninterrupted run), against the same run started on 1 replica (its own arithmetic).

    python benchmarks/elastic_speed.py --rounds=2 --out=benchmarks/results/elastic_speed.json

Each round, for each model: (a) 1 epoch on 2 CPU replicas, then the same folder resumed on 1
replica for 2 epochs more; (b) the same, resumed with --intra_op_threads given (micro-batches,
this machine's threads); (c) the run on 1 replica from the start, 3 epochs. Each a process of
its own; the training images/s of epochs 2 and 3 (the resumed ones) from metrics.json.
Ratios from the same round; the machine's speed drifts between rounds.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from quickstart import cpu_name  # noqa: E402

COMMON = ["--dataset=synthetic", "--synthetic_train_size=4096", "--synthetic_test_size=256",
          "--global_batch_size=64", "--checkpoint_steps=0", "--deterministic"]
MODELS = {"resnet18 width 16": ["--model=resnet18", "--width=16"],
          "lenet width 20": ["--model=lenet"]}


def main_job(model_dir, *flags):
    done = subprocess.run([sys.executable, "-m", "tfmulti.main", *COMMON, *flags,
                           f"--model_dir={model_dir}"], cwd=ROOT, capture_output=True,
                          text=True, timeout=3600)
    if done.returncode:
        sys.exit(f"the run failed:\n{done.stderr[-3000:]}")
    return done.stdout


def resumed_speed(model_dir):
    with open(os.path.join(model_dir, "metrics.json")) as f:
        epochs = json.load(f)["epochs"]
    return statistics.median(r["images_per_sec"] for r in epochs if r["epoch"] > 1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    rows = {name: {"exact": [], "micro_batches_all_threads": [], "one_replica": []}
            for name in MODELS}
    for _ in range(args.rounds):
        for name, model in MODELS.items():
            with tempfile.TemporaryDirectory() as work:
                for kind, extra in (("exact", []),
                                    ("micro_batches_all_threads",
                                     [f"--intra_op_threads={os.cpu_count()}"])):
                    folder = os.path.join(work, kind)
                    main_job(folder, *model, "--cpu_replicas=2", "--epochs=1")
                    said = main_job(folder, *model, "--cpu_replicas=1", "--epochs=3", *extra)
                    assert "micro-batches of 32 as the 2 replicas took them" in said, said
                    rows[name][kind].append(resumed_speed(folder))
                folder = os.path.join(work, "one")
                main_job(folder, *model, "--cpu_replicas=1", "--epochs=3")
                rows[name]["one_replica"].append(resumed_speed(folder))
            ratio = [e / o for e, o in zip(rows[name]["exact"], rows[name]["one_replica"])]
            print(f"{name}: exact resume {rows[name]['exact'][-1]:.0f} images/s, with all "
                  f"threads {rows[name]['micro_batches_all_threads'][-1]:.0f}, 1 replica "
                  f"from the start {rows[name]['one_replica'][-1]:.0f} ({ratio[-1]:.2f}x)",
                  flush=True)
    for row in rows.values():
        row["exact_over_one_replica"] = [e / o for e, o in zip(row["exact"], row["one_replica"])]
        row["all_threads_over_one_replica"] = [
            e / o for e, o in zip(row["micro_batches_all_threads"], row["one_replica"])]
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": "python " + " ".join(sys.argv), "rows": rows,
                       "units": "training images/s of the resumed epochs (2 and 3), median",
                       "dataset": "synthetic (embedded, offline)", "cpu": cpu_name(),
                       "cpu_cores": len(os.sched_getaffinity(0))}, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
