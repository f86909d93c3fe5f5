"""N logical CPU replicas against one, with each choice of thread pools, in one alternating run.

    python benchmarks/replicas.py --out=benchmarks/results/replicas.json   # ~25 minutes, 2 cores

Each configuration is `python -m tfmulti.main` as a user runs it, on the embedded synthetic
set (--synthetic_train_size images of 28x28, not Fashion-MNIST), float32 (or --dtype), global
batch 64 (so 2 replicas take 32 each), with this CPU's default kernels (or --kernels=eigen):
1 replica with TensorFlow's own thread pools, and 2 replicas with each --pools choice of
(intra-op threads per op, inter-op threads: ops at once), the order rotating over --rounds.
`default` is what tfmulti picks with neither flag given; `apart` is two processes of one
replica each (half the batch, one thread an op) started together, their speeds summed: what
the machine gives two single-threaded replicas that share no runtime. --malloc=tcmalloc
preloads TCMalloc in every run, as make run does (glibc's malloc otherwise).
Speed: the training images per second of every epoch after the first (the first traces), from
metrics.json; median per configuration; ratios are of medians from this one invocation.
"""
import argparse
import concurrent.futures
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import onednn  # noqa: E402


def run(model, width, replicas, pools, kernels, train_size, epochs, folder, dtype="float32"):
    """The training images/s of each epoch after the first, and run.json's kernels record."""
    if pools == "apart":
        return apart(model, width, kernels, train_size, epochs, folder, dtype)
    threads = [] if pools == "default" else [
        f"--intra_op_threads={pools.split('x')[0]}", f"--inter_op_threads={pools.split('x')[1]}"]
    return onednn.run(model, width, replicas, kernels, train_size, epochs, folder,
                      extra=[*threads, f"--dtype={dtype}"], name=f"{model}-{replicas}-{pools}")


def apart(model, width, kernels, train_size, epochs, folder, dtype="float32"):
    """What the machine gives two single-threaded replicas with no runtime shared: two
    processes started together, each one replica of half the global batch with one thread an
    op (and 2 inter-op threads each); their images/s summed epoch by epoch (the ceiling for 2
    replicas in one process). An upper estimate: the two processes' epochs are not aligned
    (start-up skew, evaluations, one finishing first), and a process's epoch run partly alone
    is faster."""
    extra = ["--global_batch_size=32", "--intra_op_threads=1", "--inter_op_threads=2",
             f"--dtype={dtype}"]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        both = list(pool.map(lambda i: onednn.run(
            model, width, 1, kernels, train_size, epochs, folder, extra=extra,
            name=f"{model}-apart-{i}"), range(2)))
    return [a + b for a, b in zip(both[0][0], both[1][0])], both[0][1]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--width", type=int, default=64, help="ResNet-18's (the book's 64)")
    parser.add_argument("--train_sizes", default="resnet18:1024,lenet:8192")
    parser.add_argument("--pools", default="default,1x2,2x2,2x4",
                        help="2 replicas' thread pools, each INTRAxINTER, default or apart")
    parser.add_argument("--kernels", default="this_cpu", choices=["this_cpu", *onednn.KERNELS])
    parser.add_argument("--dtype", default="float32", help="the runs' --dtype")
    parser.add_argument("--out", default="")
    onednn.add_malloc_flag(parser)
    args = parser.parse_args()
    onednn.use_malloc(args)

    rows, folder = [], tempfile.mkdtemp(prefix="tfmulti-replicas-")
    setups = [(1, "default")] + [(2, p) for p in args.pools.split(",")]
    names = [f"{n}:{p}" for n, p in setups]
    for model, size in (part.split(":") for part in args.train_sizes.split(",")):
        speeds, said = {name: [] for name in names}, {}
        for r in range(args.rounds):
            order = list(range(r % len(setups), len(setups))) + list(range(r % len(setups)))
            for i in order:
                (replicas, pools), name = setups[i], names[i]
                got, said[name] = run(model, args.width, replicas, pools, args.kernels,
                                      int(size), args.epochs, folder, args.dtype)
                speeds[name] += got
        medians = {k: statistics.median(v) for k, v in speeds.items()}
        one = medians["1:default"]
        rows.append({"model": model, "dtype": args.dtype, "train_size": int(size),
                     "images_per_sec_median": medians,
                     "images_per_sec": speeds, "cpu_kernels": said,
                     "ratio_over_one_replica": {k: v / one for k, v in medians.items()}})
        print(f"{model:9} " + ", ".join(f"{k} {v:.1f} ({v / one:.2f}x)"
                                         for k, v in medians.items()) + " images/s", flush=True)
    onednn.save("replicas.py", args, rows)

if __name__ == "__main__":
    main()
