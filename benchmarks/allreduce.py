"""Time per allreduce, naive vs ring, for a whole model's gradients (one tensor per parameter,
as tfmulti.scratch sums them).

    python benchmarks/allreduce.py                       # 2 and 4 logical CPU devices
    python benchmarks/allreduce.py --devices=2,4 --repeats=20 \
        --out=benchmarks/results/allreduce.json

Each device count runs in a fresh process (logical devices are fixed when TensorFlow starts).
Each figure: warm-up calls, then `repeats` timed calls, each waiting for every device's result;
median and spread (min-max) in milliseconds, and the gradient bytes per second of allreduce.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def gradient_shapes(model):
    from tfmulti.models import zoo

    return [tuple(w.shape) for w in zoo.build(model).trainable_weights]


def measure(devices, repeats, warmup):
    """Runs in the child process: every (model, kind) on `devices` logical CPU devices."""
    import numpy as np
    import tensorflow as tf

    from tfmulti.scratch import lesson

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * devices)

    names = [f"/CPU:{i}" for i in range(devices)]
    rows = []
    for model in ("lenet", "resnet18"):
        shapes = gradient_shapes(model)
        rng = np.random.default_rng(0)
        grads = []  # grads[d][p]: device d's gradient of parameter p
        for name in names:
            with tf.device(name):
                grads.append([tf.constant(rng.normal(size=s).astype(np.float32)) for s in shapes])
        size = sum(int(np.prod(s)) for s in shapes)
        for kind in ("naive", "ring"):
            allreduce = lesson.ALLREDUCE[kind]

            @tf.function
            def all_parameters(grads):
                outs = [allreduce([g[p] for g in grads], names) for p in range(len(shapes))]
                # One element of every result: waits for all of them, copies almost nothing.
                return tf.stack([tf.reshape(t, [-1])[0] for out in outs for t in out])

            for _ in range(warmup):
                all_parameters(grads).numpy()
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                all_parameters(grads).numpy()
                times.append(time.perf_counter() - start)
            median = statistics.median(times)
            rows.append({"model": model, "parameters": size, "tensors": len(shapes),
                         "devices": devices, "allreduce": kind, "median_ms": median * 1e3,
                         "min_ms": min(times) * 1e3, "max_ms": max(times) * 1e3,
                         "gradient_gb_per_s": size * 4 / median / 1e9})
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default="2,4")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out",
                        default=os.path.join(ROOT, "benchmarks", "results", "allreduce.json"))
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.repeats, args.warmup)))
        return
    rows = []
    for count in [int(c) for c in args.devices.split(",")]:
        child = subprocess.run([sys.executable, __file__, f"--child={count}",
                                f"--repeats={args.repeats}", f"--warmup={args.warmup}"],
                               capture_output=True, text=True, check=True)
        rows += json.loads(child.stdout.strip().splitlines()[-1])
    import platform

    import tensorflow as tf

    print(f"{'model':9} {'params':>10} {'devices':>7} {'allreduce':>9} {'median ms':>10} "
          f"{'min-max ms':>16} {'GB/s':>6} {'ring/naive':>10}")
    for row in rows:
        naive = next(r for r in rows if r["model"] == row["model"]
                     and r["devices"] == row["devices"] and r["allreduce"] == "naive")
        row["time_vs_naive"] = row["median_ms"] / naive["median_ms"]
        print(f"{row['model']:9} {row['parameters']:>10} {row['devices']:>7} {row['allreduce']:>9} "
              f"{row['median_ms']:>10.2f} {row['min_ms']:>7.2f}-{row['max_ms']:<8.2f} "
              f"{row['gradient_gb_per_s']:>6.2f} {row['time_vs_naive']:>10.2f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"command": " ".join(sys.argv), "repeats": args.repeats,
                   "warmup": args.warmup, "cpu_cores": os.cpu_count(),
                   "versions": {"python": platform.python_version(),
                                "tensorflow": tf.__version__},
                   "results": rows}, f, indent=2)
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
