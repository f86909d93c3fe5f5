"""The launcher's workers in a network of their own against the machine's network.

    python benchmarks/network.py --out=benchmarks/results/network.json   # ~4 minutes, 2 cores

Two workers of the main job (`python -m tfmulti.launch --workers=2`, one CPU replica each, a
width-8 ResNet-18 on the synthetic set, global batch 64) with --network=private (a user and
network namespace: their gRPC all-reduce goes over the namespace's own loopback) and with
--network=host (the machine's loopback), alternating over --rounds.

Speed: worker 0's images per second of every epoch after the first, median per network; the
ratio private / host is of medians from this one invocation.
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from yourmodel import save  # noqa: E402

RUN = ["--dataset=synthetic", "--synthetic_train_size=4096", "--synthetic_test_size=256",
       "--model=resnet18", "--width=8", "--global_batch_size=64"]
EPOCH = re.compile(r"\[worker 0\]   test acc .*, (\d+) images/s")


def launch(network, epochs, folder):
    """images/s of worker 0's epochs, and the launcher's line about the network."""
    out = subprocess.run(
        [sys.executable, "-m", "tfmulti.launch", "--workers=2", f"--network={network}", "--",
         *RUN, f"--epochs={epochs}", f"--model_dir={folder}"],
        cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise SystemExit(f"the {network} run failed: {out.stdout[-2000:]}{out.stderr[-2000:]}")
    said = next(line for line in out.stdout.splitlines() if line.startswith("[launch] "))
    return [float(m) for m in EPOCH.findall(out.stdout)], said


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/network.json")
    args = parser.parse_args()
    runs, speeds = [], {"private": [], "host": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = ("private", "host") if r % 2 == 0 else ("host", "private")
            for network in order:
                rates, said = launch(network, args.epochs, os.path.join(tmp, f"{network}-{r}"))
                speeds[network] += rates[1:]  # the first epoch traces
                runs.append({"round": r, "network": network, "images_per_sec": rates,
                             "launcher_line": said})
                print(f"round {r} {network}: {rates} images/s ({said})", flush=True)
    medians = {k: statistics.median(v) for k, v in speeds.items()}
    summary = {"median_images_per_sec": medians,
               "private_over_host": round(medians["private"] / medians["host"], 3),
               "spread_images_per_sec": {k: [min(v), max(v)] for k, v in speeds.items()}}
    save(args, "network.py", summary, runs)


if __name__ == "__main__":
    main()
