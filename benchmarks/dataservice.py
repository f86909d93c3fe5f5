"""A folder of images read by the training process against the same folder read by a tf.data
service (a dispatcher and 1 or 2 worker servers, each a process on this machine).

    python benchmarks/dataservice.py --out=benchmarks/results/dataservice.json   # ~10 minutes

The images are examples/your_project's `shapes` (3000 + 600 RGB images of 32x32, 3 classes),
written once as PNG files (folder.py). The main job trains the project's `small_cnn` (a model
so small that reading and decoding bound its steps: the input-bound setting) on 2 logical
CPU replicas, global batch 64, --epochs epochs, `--nodecode_once` (every epoch reads the
files), each run its own process, the three settings in turn over --rounds, the order
rotating:

- local: the training process reads and decodes every batch's files;
- service1 / service2: `--data_service`, 1 or 2 service workers read and decode them.

Figures: the training images per second of every epoch after the first, median per setting,
and the median share of each epoch its steps waited for input (metrics.json's
input_wait_share). On one 2-core machine the service workers share the training's cores: this
measures what the service costs and moves, not the gain of machines added for it.
"""
import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROJECT = os.path.join(ROOT, "examples", "your_project")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from folder import write_folder  # noqa: E402
from yourmodel import GLOBAL_BATCH, REPLICAS, save  # noqa: E402

ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": f"{ROOT}:{PROJECT}"}


def free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def start_service(workers):
    """(dispatcher address, the server processes), each server having said it serves."""
    port = free_port()
    servers = [subprocess.Popen([sys.executable, "-m", "tfmulti.dataservice", "dispatcher",
                                 f"--port={port}"], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                                text=True)]
    servers[0].stdout.readline()
    for _ in range(workers):
        servers.append(subprocess.Popen(
            [sys.executable, "-m", "tfmulti.dataservice", "worker",
             f"--dispatcher=localhost:{port}", "--advertise=localhost"], cwd=ROOT, env=ENV,
            stdout=subprocess.PIPE, text=True))
        servers[-1].stdout.readline()
    return f"localhost:{port}", servers


def train(root, folder, epochs, service=""):
    """(images/s, input wait share) of each epoch of one run."""
    model_dir = os.path.join(root, "runs", f"run-{len(os.listdir(os.path.join(root, 'runs')))}")
    done = subprocess.run(
        [sys.executable, "-m", "tfmulti.main", "--model=my_models:small_cnn",
         f"--dataset=folder:{folder}", f"--cpu_replicas={REPLICAS}",
         f"--global_batch_size={GLOBAL_BATCH}", f"--epochs={epochs}", "--nodecode_once",
         "--checkpoint_steps=0", f"--model_dir={model_dir}",
         *([f"--data_service={service}"] if service else [])],
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        sys.exit(f"{service or 'local'} failed:\n{done.stderr[-3000:]}")
    with open(os.path.join(model_dir, "metrics.json")) as f:
        epochs_done = json.load(f)["epochs"]
    return ([e["images_per_sec"] for e in epochs_done],
            [e["input_wait_share"] for e in epochs_done])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=os.path.join("benchmarks", "results",
                                                      "dataservice.json"))
    args = parser.parse_args()
    settings = ("local", "service1", "service2")
    runs = {s: [] for s in settings}
    with tempfile.TemporaryDirectory(prefix="tfmulti-dataservice-bench-") as root:
        folder = os.path.join(root, "images")
        files = write_folder(folder)
        os.makedirs(os.path.join(root, "runs"))
        for round_ in range(args.rounds):
            for setting in settings[round_ % 3:] + settings[:round_ % 3]:
                servers = []
                try:
                    if setting != "local":
                        address, servers = start_service(int(setting[-1]))
                    rates, waits = train(root, folder, args.epochs,
                                         address if servers else "")
                finally:
                    for p in servers:
                        p.kill()
                        p.wait()
                runs[setting].append({"images_per_sec": rates, "input_wait_share": waits})
                print(f"round {round_ + 1} {setting:>8}: {statistics.median(rates[1:]):6.0f} "
                      f"images/s, input {statistics.median(waits[1:]):.0%}", flush=True)
    speed = {s: statistics.median(r for run in runs[s] for r in run["images_per_sec"][1:])
             for s in settings}
    wait = {s: statistics.median(w for run in runs[s] for w in run["input_wait_share"][1:])
            for s in settings}
    summary = {"images_per_sec_median": speed, "input_wait_share_median": wait,
               **{f"ratio_{s}_over_local": speed[s] / speed["local"] for s in settings[1:]},
               "train_files": files}
    save(args, "dataservice.py", summary, runs)


if __name__ == "__main__":
    main()
