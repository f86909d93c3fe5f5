"""The all-reduce between two worker processes over gRPC: time and CPU it takes, and
TensorFlow's settings for its transport compared.

    python benchmarks/grpc_allreduce.py              # about 2 minutes on 2 cores

Two real worker processes (MultiWorkerMirroredStrategy, ring all-reduce over gRPC on
localhost), each pinned to its own core with one intra-op and one inter-op thread, as in
benchmarks/multiworker.py. Each runs --count all-reduces in a row inside one tf.function (no
Python between them) for each size: 2 bytes (the latency) and the 16-bit and 32-bit
gradients of ResNet-18 at width 16 (1.4 and 2.8 MB). Per all-reduce: the best of 3 timed
calls, and the share of its core the process used meanwhile (getrusage). A share near 100%
means the all-reduce is work on the worker's own core, not waiting on the other worker.

Settings of the server's ConfigProto, each in fresh processes, rounds alternating the order:
  default      as MultiWorkerMirroredStrategy makes it
  one_chunk    experimental.recv_buf_max_chunk = -1: a tensor in one piece instead of 4 KB
               ones (what DTensor sets)
  no_spinning  experimental.disable_thread_spinning: idle threads wait instead of spinning
The settings reach the server through the strategy's private _update_config_proto; this is
an experiment, not something tfmulti sets. JSON goes to --out.
"""
import argparse
import json
import os
import resource
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

SETTINGS = {"default": {}, "one_chunk": {"recv_buf_max_chunk": -1},
            "no_spinning": {"disable_thread_spinning": True}}
SIZES_MB = (0.000002, 1.4, 2.8)


def with_settings(settings):
    """MultiWorkerMirroredStrategy's server config with `settings` in its `experimental`."""
    from tensorflow.python.distribute import collective_all_reduce_strategy as cars

    extended = cars.CollectiveAllReduceExtended
    original = extended._update_config_proto

    def update(self, config_proto):
        updated = original(self, config_proto)
        for name, value in settings.items():
            setattr(updated.experimental, name, value)
        return updated

    extended._update_config_proto = update


def measure(args):
    """In a worker process: prints RESULT {json} with each size's time and CPU share."""
    os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": args.hosts.split(",")},
                                          "task": {"type": "worker", "index": args.worker}})
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    with_settings(SETTINGS[args.setting])
    from tfmulti.distribution import allocator

    ring = tf.distribute.experimental.CommunicationImplementation.RING
    strategy = tf.distribute.MultiWorkerMirroredStrategy(
        communication_options=tf.distribute.experimental.CommunicationOptions(
            implementation=ring))
    result = {"malloc": allocator.loaded_malloc(), "sizes": {}}
    for megabytes in SIZES_MB:
        elements = max(1, round(megabytes * 1e6 / 2))

        def one(previous):  # depends on the previous sum: the all-reduces run one at a time
            values = tf.ones([elements], tf.float16) + tf.cast(previous[:1] * 0, tf.float16)
            summed = tf.distribute.get_replica_context().all_reduce(
                tf.distribute.ReduceOp.SUM, values)
            return tf.cast(summed[:1], tf.float32)

        @tf.function
        def in_a_row():
            previous = tf.zeros([1])
            for _ in tf.range(args.count):
                previous = strategy.run(one, args=(previous,))
            return previous

        in_a_row().numpy()  # traces
        times, cpu, wall = [], 0.0, 0.0
        for _ in range(3):
            before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            in_a_row().numpy()
            times.append(time.perf_counter() - start)
            after = resource.getrusage(resource.RUSAGE_SELF)
            cpu += after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
            wall += times[-1]
        result["sizes"][str(megabytes)] = {"ms": 1e3 * min(times) / args.count,
                                           "core_share": cpu / wall}
    print("RESULT " + json.dumps(result), flush=True)


def label(megabytes):
    return f"{megabytes * 1e6:.0f} bytes" if megabytes < 1e-3 else f"{megabytes:g} MB"


def run_pair(setting, args):
    import multiworker

    from tfmulti.launch import free_ports

    hosts = ",".join(f"localhost:{p}" for p in free_ports(2))
    return multiworker.results([multiworker.start(
        ["taskset", "-c", str(i), sys.executable, os.path.abspath(__file__), f"--worker={i}",
         f"--hosts={hosts}", f"--setting={setting}", f"--count={args.count}"])
        for i in range(2)], timeout=600)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--count", type=int, default=200, help="all-reduces in a row")
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--malloc", default="auto", help="as benchmarks/multiworker.py")
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--hosts", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--setting", default="default", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results",
                                                      "grpc_allreduce.json"))
    args = parser.parse_args()
    if args.worker is not None:
        return measure(args)
    settings = args.settings.split(",")
    unknown = [s for s in settings if s not in SETTINGS]
    if unknown:
        sys.exit(f"--settings: no {', '.join(unknown)}; give some of {', '.join(SETTINGS)}")
    import multiworker

    multiworker.use_malloc(args.malloc)
    runs = {s: [] for s in settings}
    for round_ in range(args.rounds):
        for setting in (settings if round_ % 2 == 0 else settings[::-1]):
            print(f"round {round_ + 1}/{args.rounds}: {setting}", flush=True)
            runs[setting].append(run_pair(setting, args))  # [worker 0's, worker 1's]
    summary = {}
    for setting, pairs in runs.items():
        summary[setting] = {}
        for size in map(str, SIZES_MB):
            per_round = [statistics.fmean(w["sizes"][size]["ms"] for w in pair) for pair in pairs]
            summary[setting][size] = {
                "ms": statistics.median(per_round), "ms_each_round": per_round,
                "core_share": statistics.median(w["sizes"][size]["core_share"]
                                                for pair in pairs for w in pair)}
        print(f"{setting:>12}: " + ", ".join(
            f"{label(float(size))} {x['ms']:.2f} ms "
            f"({', '.join(f'{r:.2f}' for r in x['ms_each_round'])}; core {x['core_share']:.0%})"
            for size, x in summary[setting].items()))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"command": " ".join(sys.argv), "args": vars(args), "cpu_cores": os.cpu_count(),
                   "malloc": runs[settings[0]][0][0]["malloc"], "summary": summary,
                   "runs": runs}, f, indent=2)
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
