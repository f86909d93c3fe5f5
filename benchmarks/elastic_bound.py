"""How far an elastic resume ends from the uninterrupted run over a real-length run: the bound
the resume line and docs/faults-and-workers.md state.

    python benchmarks/elastic_bound.py --out=benchmarks/results/elastic_bound.json

For each model, every run a `python -m tfmulti.main` process of its own, --deterministic, the
same global batch (64) and data:
- on 2 replicas from the start to the end (the uninterrupted run);
- on 4 replicas from the start to the end: how far another replica count ends by itself;
- on 2 replicas for the first epoch, then resumed on 4 (more replicas: the gradients summed
  in another order);
- on 2 replicas for the first epoch, then resumed on 1 (fewer: the 2 replicas' batches as
  micro-batches, expected bit for bit);
- on 4 replicas for the first epoch, then resumed on 2 (against the run on 4 from the start).
Each final model's largest weight difference from its reference, relative to that weight's
largest value (over the trainable weights, and over all: batch norm's moving statistics too),
and the test accuracies of the last epoch. --work=DIR keeps the runs there; a run already
finished in it (an earlier call's) is read, not trained again.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from quickstart import where_measured  # noqa: E402

COMMON = ["--dataset=synthetic", "--global_batch_size=64", "--checkpoint_steps=0",
          "--deterministic", "--seed=3"]
MODELS = {  # name: (flags, epochs)
    "lenet width 20": (["--model=lenet", "--synthetic_train_size=8192",
                        "--synthetic_test_size=1000"], 10),
    "resnet18 width 8": (["--model=resnet18", "--width=8", "--synthetic_train_size=4096",
                          "--synthetic_test_size=500"], 6),
}


def main_job(model_dir, flags, epochs, replicas):
    devices = [f"--cpu_replicas={replicas}"] if replicas > 1 else ["--num_gpus=0"]
    done = subprocess.run([sys.executable, "-m", "tfmulti.main", *COMMON, *flags, *devices,
                           f"--epochs={epochs}", f"--model_dir={model_dir}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=7200)
    if done.returncode:
        sys.exit(f"the run failed:\n{done.stderr[-3000:]}")
    return done.stdout


def finished(model_dir, epochs):
    try:
        with open(os.path.join(model_dir, "metrics.json")) as f:
            return len(json.load(f)["epochs"]) == epochs
    except FileNotFoundError:
        return False


def final(model_dir):
    """({"trainable": its weights, "all": ...} of the saved model, the last epoch's test
    accuracy)."""
    import keras

    import tfmulti.models.zoo  # noqa: F401  (registers tfmulti's layers)

    model = keras.saving.load_model(os.path.join(model_dir, "model.keras"))
    weights = {"trainable": [w.numpy() for w in model.trainable_weights],
               "all": model.get_weights()}
    with open(os.path.join(model_dir, "metrics.json")) as f:
        return weights, json.load(f)["epochs"][-1]["test_acc"]


def relative_gap(a, b):
    """{kind: the largest difference of a weight, relative to that weight's largest}."""
    import numpy as np

    return {kind: max(float(np.abs(x - y).max() / np.abs(x).max())
                      for x, y in zip(a[kind], b[kind])) for kind in a}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="")
    parser.add_argument("--work", default="")
    args = parser.parse_args()
    from tfmulti import quiet

    quiet.import_tensorflow()
    import tensorflow as tf

    rows = {}
    work = args.work or tempfile.mkdtemp(prefix="elastic-bound-")
    for name, (flags, epochs) in MODELS.items():
        runs = {}
        for label, first, then in (("2", 2, None), ("4", 4, None), ("2 then 4", 2, 4),
                                   ("2 then 1", 2, 1), ("4 then 2", 4, 2)):
            folder = os.path.join(work, f"{name.split()[0]}-{label.replace(' ', '-')}")
            if not finished(folder, epochs):
                main_job(folder, flags, 1 if then else epochs, first)
                if then:
                    said = main_job(folder, flags, epochs, then)
                    with open(os.path.join(folder, "resumed.txt"), "w") as f:
                        f.write(said)
            if then:
                with open(os.path.join(folder, "resumed.txt")) as f:
                    runs[label + " line"] = next(
                        (line for line in f if "Resuming the run" in line), "").strip()
            runs[label] = final(folder)
            print(f"{name}: {label} done, test acc {runs[label][1]:.4f}", flush=True)
        two, four = runs["2"][0], runs["4"][0]
        rows[name] = {
            "epochs": epochs, "resumed_after_epoch": 1,
            "4_from_the_start_vs_2": relative_gap(two, four),
            "2_then_4_vs_2": relative_gap(two, runs["2 then 4"][0]),
            "2_then_1_vs_2": relative_gap(two, runs["2 then 1"][0]),
            "4_then_2_vs_4": relative_gap(four, runs["4 then 2"][0]),
            "test_acc": {label: runs[label][1] for label in ("2", "4", "2 then 4", "2 then 1",
                                                             "4 then 2")},
            "resume_lines": {label: runs[label + " line"]
                             for label in ("2 then 4", "2 then 1", "4 then 2")},
        }
        print(name, json.dumps({k: v for k, v in rows[name].items() if k != "resume_lines"}),
              flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": "python " + " ".join(sys.argv), "rows": rows,
                       "common_flags": COMMON, "models": MODELS,
                       **where_measured(), "tensorflow": tf.__version__}, f, indent=1)


if __name__ == "__main__":
    main()
