"""tfmulti against what a user would pick instead, PyTorch and plain Keras `fit`, in one
alternating run.

    python benchmarks/peers.py --torch_python=TORCH_VENV/bin/python \
        --out=benchmarks/results/peers.json   # ~40 minutes on 2 cores

TORCH_VENV is a virtual environment of its own with PyTorch (`python -m venv TORCH_VENV &&
TORCH_VENV/bin/pip install torch`): the project's does not install it.

Rows: the book's ResNet-18 (3x3 stem, stride 1, no max-pool; full width unless --width) and
LeNet (the multi-GPU chapter's: conv 20 3x3, avg-pool, conv 50 5x5, avg-pool, dense 128, dense
10); 1 and 2 CPU replicas; float32 and, where the CPU has AVX-512 bfloat16, bfloat16. Global
batch 64 (32 per replica on 2), plain SGD, --epochs epochs of --train_size 28x28 images; the
training images/s of every epoch after the first (the first traces), median per program.
- tfmulti: `python -m tfmulti.main` as a user runs it (--cpu_replicas=N, --dtype), on the
  embedded synthetic set;
- Keras: the plain `model.fit` program (benchmarks/enginefit.py's), the same model built in a
  MirroredStrategy over N logical CPU devices, TensorFlow's default thread pools, Keras's
  mixed_bfloat16 policy for bfloat16;
- PyTorch: the book's PyTorch code for the same model (torch.nn), batches of a shuffled
  tensor of random 28x28 images held in memory (the speed does not depend on the pixels'
  values); one process on 1 replica, on 2 DistributedDataParallel over 2 processes (gloo on
  this host) with cores / 2 threads each, as PyTorch spreads training over one machine's
  cores; bfloat16 under torch.autocast.
Each round runs every program once per row, the programs' order rotating from row to row and
round to round; ratios are of medians from this one invocation. The CPU is named in the JSON.
--malloc=tcmalloc preloads TCMalloc in every program's processes (as make run starts tfmulti).
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
from enginefit import fit  # noqa: E402

TORCH_CHILD = r'''
import json, os, sys, time
import torch
from torch import nn
from torch.nn import functional as F

model, replicas, dtype, train_size, epochs, width = sys.argv[1:7]
replicas, train_size, epochs, width = int(replicas), int(train_size), int(epochs), int(width)
BATCH = 64


class Residual(nn.Module):  # the book's (d2l) residual block
    def __init__(self, cin, cout, proj=False, stride=1):
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, 3, stride, 1); self.c2 = nn.Conv2d(cout, cout, 3, 1, 1)
        self.c3 = nn.Conv2d(cin, cout, 1, stride) if proj else None
        self.b1 = nn.BatchNorm2d(cout); self.b2 = nn.BatchNorm2d(cout)

    def forward(self, x):
        y = F.relu(self.b1(self.c1(x))); y = self.b2(self.c2(y))
        return F.relu(y + (self.c3(x) if self.c3 else x))


def stage(cin, cout, first=False):
    return nn.Sequential(*[Residual(cin, cout, True, 2) if i == 0 and not first
                           else Residual(cout, cout) for i in range(2)])


def build():
    if model == "lenet":
        return nn.Sequential(nn.Conv2d(1, 20, 3), nn.ReLU(), nn.AvgPool2d(2),
                             nn.Conv2d(20, 50, 5), nn.ReLU(), nn.AvgPool2d(2), nn.Flatten(),
                             nn.Linear(800, 128), nn.ReLU(), nn.Linear(128, 10))
    w = width
    return nn.Sequential(nn.Conv2d(1, w, 3, 1, 1), nn.BatchNorm2d(w), nn.ReLU(),
                         stage(w, w, True), stage(w, 2 * w), stage(2 * w, 4 * w),
                         stage(4 * w, 8 * w), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(8 * w, 10))


def train(rank):
    cores = len(os.sched_getaffinity(0))
    if replicas > 1:
        torch.set_num_threads(max(1, cores // replicas))
        torch.distributed.init_process_group("gloo", init_method=os.environ["INIT"],
                                             rank=rank, world_size=replicas)
    torch.manual_seed(0)
    net = build()
    if replicas > 1:
        net = nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(net.parameters(), 0.1 * BATCH / 256)
    loss_fn = nn.CrossEntropyLoss()
    images = torch.rand(train_size, 1, 28, 28)
    labels = torch.randint(0, 10, (train_size,))
    per_replica, steps = BATCH // replicas, train_size // BATCH
    speeds = []
    for epoch in range(epochs):
        order = torch.randperm(train_size, generator=torch.Generator().manual_seed(epoch))
        start = time.perf_counter()
        for s in range(steps):
            idx = order[s * BATCH + rank * per_replica:s * BATCH + (rank + 1) * per_replica]
            x, y = images[idx], labels[idx]
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
                loss = loss_fn(net(x), y)
            loss.backward()
            opt.step()
        speeds.append(steps * BATCH / (time.perf_counter() - start))
    if rank == 0:
        print("TORCH " + json.dumps({"images_per_sec": speeds[1:],
                                     "threads": torch.get_num_threads(),
                                     "torch": torch.__version__}), flush=True)


if __name__ == "__main__":
    if replicas > 1:
        torch.multiprocessing.spawn(train, nprocs=replicas)
    else:
        train(0)
'''


def torch_run(python, model, replicas, dtype, train_size, epochs, width, folder):
    """(images/s of each epoch after the first, {threads, torch version}) of PyTorch."""
    import socket

    with socket.socket() as s:  # a free port on this host for the 2 processes' rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = os.path.join(folder, "torch_child.py")  # a file: spawn imports it again
    with open(script, "w") as f:
        f.write(TORCH_CHILD)
    done = subprocess.run([python, script, model, str(replicas), dtype,
                           str(train_size), str(epochs), str(width)],
                          capture_output=True, text=True, timeout=3600,
                          env={**os.environ, "INIT": f"tcp://127.0.0.1:{port}"})
    if "TORCH " not in done.stdout:
        raise SystemExit(f"PyTorch {model} {replicas} {dtype}: "
                         f"{done.stderr.strip().splitlines()[-1:]}")
    got = json.loads(done.stdout.split("TORCH ", 1)[1])
    return got.pop("images_per_sec"), got


def tfmulti_run(model, replicas, dtype, train_size, epochs, width, folder):
    """(images/s of each epoch after the first, run.json's CPU kernels) of tfmulti."""
    return onednn.run(model, width, replicas, "this_cpu", train_size, epochs, folder,
                      extra=[f"--dtype={dtype}"], name=f"{model}-{replicas}-{dtype}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--torch_python", required=True,
                        help="the python of an environment with PyTorch")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--width", type=int, default=64, help="ResNet-18's (the book's 64)")
    parser.add_argument("--train_sizes", default="resnet18:1024,lenet:8192")
    parser.add_argument("--replicas", default="1,2")
    parser.add_argument("--dtypes", default="", help="default: float32, and bfloat16 where "
                        "the CPU has AVX-512 bfloat16")
    parser.add_argument("--out", default="")
    onednn.add_malloc_flag(parser)
    args = parser.parse_args()
    onednn.use_malloc(args)

    flags = set(open("/proc/cpuinfo").read().split())
    dtypes = (args.dtypes.split(",") if args.dtypes else
              ["float32"] + (["bfloat16"] if "avx512_bf16" in flags else []))
    folder, rows = tempfile.mkdtemp(prefix="tfmulti-peers-"), []
    programs = ("tfmulti", "keras", "pytorch")
    configs = [(m, int(size), r, d) for m, size in (p.split(":") for p in
                                                    args.train_sizes.split(","))
               for r in map(int, args.replicas.split(",")) for d in dtypes]
    speeds = {c: {p: [] for p in programs} for c in configs}
    said = {c: {} for c in configs}
    for r in range(args.rounds):
        for i, (model, size, replicas, dtype) in enumerate(configs):
            k = (i + r) % len(programs)
            for program in programs[k:] + programs[:k]:
                if program == "tfmulti":
                    got, said[model, size, replicas, dtype][program] = tfmulti_run(
                        model, replicas, "mixed_bfloat16" if dtype == "bfloat16" else dtype,
                        size, args.epochs, args.width, folder)
                elif program == "keras":
                    got, jit = fit(model, replicas, "mixed_bfloat16" if dtype == "bfloat16"
                                   else dtype, "off", size, args.epochs, args.width)
                    if got is None:
                        raise SystemExit(f"Keras {model} {replicas} {dtype}: {jit}")
                else:
                    got, said[model, size, replicas, dtype][program] = torch_run(
                        args.torch_python, model, replicas, dtype, size, args.epochs,
                        args.width, folder)
                speeds[model, size, replicas, dtype][program] += got
            medians = {p: statistics.median(v) for p, v
                       in speeds[model, size, replicas, dtype].items() if v}
            print(f"round {r + 1}: {model:9} {replicas} replica(s) {dtype:9} " + ", ".join(
                f"{p} {v:.1f}" for p, v in medians.items()) + " images/s", flush=True)
    for (model, size, replicas, dtype), got in speeds.items():
        medians = {p: statistics.median(v) for p, v in got.items()}
        rows.append({"model": model, "train_size": size, "replicas": replicas, "dtype": dtype,
                     "images_per_sec_median": medians, "images_per_sec": got,
                     "tfmulti_over": {p: medians["tfmulti"] / medians[p]
                                      for p in ("keras", "pytorch")},
                     "said": said[model, size, replicas, dtype]})
    for row in rows:  # N replicas against one, each program
        one = next(o for o in rows if (o["model"], o["dtype"], o["replicas"])
                   == (row["model"], row["dtype"], 1))
        row["over_one_replica"] = {p: row["images_per_sec_median"][p]
                                   / one["images_per_sec_median"][p] for p in programs}
    for row in rows:
        print(f"{row['model']:9} {row['replicas']} {row['dtype']:9} tfmulti "
              f"{row['images_per_sec_median']['tfmulti']:.1f} images/s: "
              f"{row['tfmulti_over']['pytorch']:.2f}x PyTorch, "
              f"{row['tfmulti_over']['keras']:.2f}x Keras fit; over 1 replica "
              f"{row['over_one_replica']['tfmulti']:.2f}x")
    onednn.save("peers.py", args, rows)


if __name__ == "__main__":
    main()
