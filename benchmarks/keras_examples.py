"""The noise the Keras examples' figures carry, and where tfmulti's land in it: each example of
tests/keras_examples (the model as keras.io writes it, data made small and offline) trained
by `model.fit` on one device and by tfmulti on 2 CPU replicas, for --seeds seeds each, in
processes of their own (fit and tfmulti alternating), the example's metric on its test part.

    python benchmarks/keras_examples.py --out=benchmarks/results/keras_examples.json  # ~40 min

--names=a,b measures those examples again and keeps the file's others.

Per example: fit's figures and tfmulti's (seed 0, 1, ...), `fit_range` (the largest minus the
smallest of fit's: what re-running the example with another seed moves its figure by) and
`noise`, the tolerance tests/test_keras_examples.py allows between tfmulti's seed-0 figure
and fit's: the larger of fit's range and tfmulti's range. tfmulti shuffles with its own
generator, so no seed gives both the same order: the figures agree in distribution, not bit
for bit. What ran here: logical CPU replicas, no GPU.
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "keras_examples"))
import conformance  # noqa: E402


def fit_figure(name, seed):
    done = subprocess.run([sys.executable, os.path.join(conformance.HERE, "conformance.py"),
                           "fit", name, str(seed)], env=conformance.environment(),
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])[conformance.example(name).METRIC]


def tfmulti_figure(name, seed, scratch):
    model_dir = os.path.join(scratch, f"{name}_{seed}")
    done = subprocess.run(conformance.command(name, model_dir, seed), cwd=scratch,
                          env=conformance.environment(), capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    with open(os.path.join(model_dir, "metrics.json")) as f:
        record = json.load(f)["epochs"][-1]
    return conformance.comparable(name, conformance.test_figure(
        record, conformance.example(name).METRIC))


def cpu_name():
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--names", default=",".join(conformance.NAMES))
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        for name in args.names.split(","):
            fit, ours = [], []
            for seed in range(args.seeds):
                first, second = ((fit_figure, tfmulti_figure) if seed % 2 == 0 else
                                 (tfmulti_figure, fit_figure))
                for run in (first, second):
                    figure = run(name, seed) if run is fit_figure else run(name, seed, scratch)
                    (fit if run is fit_figure else ours).append(round(figure, 4))
            fit_range, ours_range = max(fit) - min(fit), max(ours) - min(ours)
            results[name] = {"command": f"python benchmarks/keras_examples.py --names={name} "
                                        f"--seeds={args.seeds} --out={args.out}",
                             "metric": conformance.example(name).METRIC, "seeds": args.seeds,
                             "fit": fit,
                             "tfmulti": ours, "fit_range": round(fit_range, 4),
                             "tfmulti_range": round(ours_range, 4),
                             "noise": round(max(fit_range, ours_range), 4)}
            print(name, json.dumps(results[name]), flush=True)
    kept = {}  # --names=a,b measures those again and keeps the file's other examples
    if os.path.exists(args.out) and args.names != ",".join(conformance.NAMES):
        with open(args.out) as f:
            kept = json.load(f)["examples"]
    with open(args.out, "w") as f:
        json.dump({"command": f"python benchmarks/keras_examples.py --out={args.out}",
                   "cpu": cpu_name(), "cores": os.cpu_count(),
                   "fit": "model.fit on one device (CPU:0)", "tfmulti": "2 CPU replicas",
                   "examples": {**kept, **results}}, f, indent=1)


if __name__ == "__main__":
    main()
