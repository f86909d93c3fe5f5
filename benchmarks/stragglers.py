"""How far apart equal workers' compute times are, against a worker slowed on purpose: the
ground for the straggler margin (tfmulti/accounting/timing.py, STRAGGLER_MARGIN).

    python benchmarks/stragglers.py --out=benchmarks/results/stragglers.json   # ~3 minutes

Each run is `python -m tfmulti.launch --workers=2` on this machine, as a user runs it, for
--epochs epochs: LeNet (width 8) and the book's ResNet-18 (width 4) with equal workers, and
the CNN of tests/test_timing.py whose forward pass sleeps --delay s a step on worker 1. For
every epoch after the first (the first holds tracing), the ratio of the slower worker's
compute seconds to the faster one's (metrics.json's worker_compute_seconds), and whether the
run named a straggler.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from test_timing import SLOW_WORKER  # noqa: E402
from yourmodel import save  # noqa: E402

RUN = ["--dataset=synthetic", "--synthetic_train_size=4096", "--synthetic_test_size=200",
       "--per_replica_batch_size=32"]
CASES = {"lenet, equal workers": ["--model=lenet", "--width=8"],
         "resnet18 width 4, equal workers": ["--model=resnet18", "--width=4"],
         "cnn, worker 1 sleeping": ["--model=slowone:cnn"]}


def spreads(folder, flags, epochs, env):
    """[(slower / faster compute seconds, the straggler named or None)] per epoch after the
    first, of one 2-worker run."""
    out = subprocess.run([sys.executable, "-m", "tfmulti.launch", "--workers=2", "--", *RUN,
                          *flags, f"--epochs={epochs}", f"--model_dir={folder}"], cwd=ROOT,
                         env=env, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"the run failed:\n{out.stdout[-3000:]}")
    with open(os.path.join(folder, "metrics.json")) as f:
        history = json.load(f)["epochs"]
    return [{"ratio": max(r["worker_compute_seconds"]) / min(r["worker_compute_seconds"]),
             "worker_compute_seconds": r["worker_compute_seconds"],
             "straggler": r.get("straggler")} for r in history[1:]]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--delay", type=float, default=0.02)
    parser.add_argument("--out", default=os.path.join("benchmarks", "results",
                                                      "stragglers.json"))
    args = parser.parse_args()
    runs = {}
    with tempfile.TemporaryDirectory(prefix="tfmulti-stragglers-bench-") as root:
        with open(os.path.join(root, "slowone.py"), "w") as f:
            f.write(SLOW_WORKER.format(delay=args.delay))
        env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
        env["PYTHONPATH"] = root
        for i, (case, flags) in enumerate(CASES.items()):
            runs[case] = spreads(os.path.join(root, str(i)), flags, args.epochs, env)
            ratios = ", ".join(f"{e['ratio']:.3f}" for e in runs[case])
            named = [e["straggler"] and e["straggler"]["worker"] for e in runs[case]]
            print(f"{case}: compute ratios {ratios}, named: {named}", flush=True)
    equal = [e["ratio"] for case, epochs in runs.items() if "equal" in case for e in epochs]
    slowed = [e["ratio"] for case, epochs in runs.items() if "sleeping" in case for e in epochs]
    summary = {"equal_workers_ratio_max": max(equal), "slowed_worker_ratio_min": min(slowed),
               "named_among_equal": sum(bool(e["straggler"]) for case, epochs in runs.items()
                                        if "equal" in case for e in epochs),
               "named_slowed": sum(bool(e["straggler"]) and e["straggler"]["worker"] == 1
                                   for e in runs["cnn, worker 1 sleeping"]),
               "epochs_measured_each": args.epochs - 1}
    save(args, "stragglers.py", summary, runs)


if __name__ == "__main__":
    main()
