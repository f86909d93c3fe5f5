"""A folder of images (read from the files batch by batch) against the same images in memory.

    python benchmarks/folder.py --out=benchmarks/results/folder.json   # ~5 minutes, 2 cores

The images are examples/your_project's `shapes` (3000 + 600 RGB images of 32x32, 3 classes),
written once as PNG files into DIR/train/<class>/ and DIR/test/<class>/ in a temporary folder.
The engine trains the project's `small_cnn` on them on 2 logical CPU replicas, global batch
64, for --epochs epochs, twice per round, each in a process of its own, the order alternating
over --rounds:

- folder: `--dataset=folder:DIR`, every batch's files read and decoded by the input pipeline
  (each epoch again);
- memory: `--dataset=my_data:shapes`, the same images held in memory.

Speed: the training images per second of every epoch after the first, median per source;
the ratio folder / memory is of medians from this one invocation.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROJECT = os.path.join(ROOT, "examples", "your_project")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from yourmodel import GLOBAL_BATCH, LEARNING_RATE, MOMENTUM, REPLICAS, save  # noqa: E402


def write_folder(root):
    """shapes as PNG files: root/{train,test}/<class>/<index>.png."""
    sys.path.insert(0, PROJECT)
    import my_data
    import tensorflow as tf

    (x, y), (tx, ty), names = my_data.shapes()
    for split, images, labels in (("train", x, y), ("test", tx, ty)):
        for i, (image, label) in enumerate(zip(images, labels)):
            folder = os.path.join(root, split, names[int(label)])
            os.makedirs(folder, exist_ok=True)
            tf.io.write_file(os.path.join(folder, f"{i:05d}.png"), tf.io.encode_png(image))
    return len(x)


def engine(epochs, dataset):
    """The engine on `dataset` in this process: images/s of each epoch."""
    sys.path.insert(0, PROJECT)
    from tfmulti.data import sources
    from tfmulti.distribution import startup
    from tfmulti.run.config import RunConfig
    from tfmulti.training import train

    cfg = RunConfig(model="my_models:small_cnn", dataset=dataset, cpu_replicas=REPLICAS,
                    global_batch_size=GLOBAL_BATCH, base_lr=LEARNING_RATE * 256 / GLOBAL_BATCH,
                    momentum=MOMENTUM, epochs=epochs)
    strategy = startup.from_config(cfg).start()
    _, history = train.train_and_evaluate(strategy, sources.load_for(cfg), cfg, verbose=0)
    return [r["images_per_sec"] for r in history]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=os.path.join("benchmarks", "results", "folder.json"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(engine(args.epochs, args.child)))
        return
    runs = {"folder": [], "memory": []}
    with tempfile.TemporaryDirectory(prefix="tfmulti-folder-bench-") as root:
        files = write_folder(root)
        sources = {"folder": f"folder:{root}", "memory": "my_data:shapes"}
        for round_ in range(args.rounds):
            order = ("folder", "memory") if round_ % 2 == 0 else ("memory", "folder")
            for source in order:
                out = subprocess.run([sys.executable, __file__, f"--epochs={args.epochs}",
                                      f"--child={sources[source]}"], cwd=ROOT,
                                     capture_output=True, text=True,
                                     env={**os.environ, "PYTHONPATH": ROOT})
                line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
                if out.returncode != 0 or not line:
                    sys.exit(f"{source} failed:\n{out.stderr[-3000:]}")
                rates = json.loads(line[0][len("RESULT "):])
                runs[source].append(rates)
                print(f"round {round_ + 1} {source:>6}: {statistics.median(rates[1:]):7.0f} "
                      "images/s", flush=True)
    summary = {source: statistics.median(r for run in results for r in run[1:])
               for source, results in runs.items()}
    summary = {"images_per_sec_median": summary,
               "ratio_folder_over_memory": summary["folder"] / summary["memory"],
               "train_files": files}
    save(args, "folder.py", summary, runs)


if __name__ == "__main__":
    main()
