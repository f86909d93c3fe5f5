"""Two workers on one core each against one worker on one core, same per-worker batch.

    python benchmarks/multiworker.py                 # about 2 minutes on 2 cores
    python benchmarks/multiworker.py --per_worker_batch=64 --steps=10 --rounds=4 \
        --allreduce_dtypes=float32,float16 --out=benchmarks/results/multiworker_batch64.json

Each worker is a real process (`python -m tfmulti.bench scaling_point`) pinned to its own core
with taskset, with one intra-op and one inter-op thread, talking over gRPC on localhost
(MultiWorkerMirroredStrategy, ring all-reduce). The single worker runs the same way on core 0.
Each round also runs 2 single workers at once, one per core, computing apart (no all-reduce):
how much slower a worker computes next to the other (contention) and, from single steps timed
one call each, the spread of its step times, from which the expected wait of a synchronous
step for the slower of the two (the straggler) follows. Every set-up also times --step_times
single steps, one call each (steps_per_call 1): their medians and spread are printed and kept.
Rounds alternate the set-ups (odd rounds in reverse order); the figure is the median images/s
over rounds and repeats, and the ratio compares medians from the same invocation. With
--allreduce_dtypes=float32,float16 each round also runs the 2 workers with the gradients
all-reduced in 16 bits. JSON goes to --out.

The 2-worker processes then time all-reduces between them (a one-number one for the latency,
one of the gradients' size for the bus bandwidth), and the scaling predictor
(tfmulti/stepmodel.py) turns the 1-worker rate, the contention and step spread of the workers
apart and that link into a predicted ratio, with the time of a step each term takes: predicted
against measured in one run.
"""
import argparse
import json
import os
import platform
import signal
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def use_malloc(setting):
    """Every process the benchmark starts uses this malloc: the supervisor preloads what
    TFMULTI_MALLOC chooses (tfmulti/distribution/allocator.py)."""
    from tfmulti.distribution import allocator

    try:
        library = allocator.choose(setting)
    except allocator.AllocatorError as e:
        sys.exit(str(e))
    os.environ[allocator.SETTING] = setting
    print(f"workers' malloc: {library or 'the system one'}", flush=True)


def point(core, args, extra=()):
    """The command of one benchmark process on `core`."""
    return ["taskset", "-c", str(core), sys.executable, "-m", "tfmulti.bench", "scaling_point",
            "--num_gpus=0", "--intra_op_threads=1", "--inter_op_threads=1", "--model=resnet18",
            f"--width={args.width}", f"--per_replica_batch_size={args.per_worker_batch}",
            f"--steps={args.steps}", f"--repeats={args.repeats}", *extra]


def results(commands, timeout=900.0):
    """Runs the commands at once under the supervisor, their output in log files (read once
    they end: no pipe to fill); returns the JSON each printed after POINT or RESULT. When one
    fails, or they are not all done within `timeout` seconds (a worker waits for a dead
    peer's all-reduce for ever), the others are killed and the benchmark stops with one line."""
    from tfmulti.processes import supervisor

    with tempfile.TemporaryDirectory(prefix="tfmulti-benchmark-") as logs:
        with supervisor.Supervisor(noun="benchmark process") as group:
            children = [group.start(f"process {i}", command, {"TF_CONFIG": None}, cwd=ROOT,
                                    log=os.path.join(logs, f"{i}.log"))
                        for i, command in enumerate(commands)]
            failed, signum, timed_out = group.watch(grace=0, timeout=timeout)
        if signum is not None:
            sys.exit(f"stopped by {signal.Signals(signum).name}: the benchmark processes too")
        if timed_out:
            sys.exit(f"benchmark processes still running after {timeout:.0f} s: killed")
        if failed is not None:  # the first to fail, not one killed after it
            code = failed.poll()
            sys.exit(f"a benchmark process failed: killed by signal {-code}" if code < 0 else
                     f"a benchmark process failed (exit {code}): "
                     f"{failed.last_line() or '(no output)'}")
        return [_printed_json(c.log) for c in children]


def _printed_json(log):
    """The JSON on the line a benchmark process printed after POINT or RESULT."""
    with open(log) as f:
        text = f.read()
    marker = "POINT " if "POINT " in text else "RESULT "
    return json.loads(text.split(marker, 1)[1].splitlines()[0])


def prediction(compute, gradient_bytes, allreduce_dtype, links, args):
    """predict.py's ratio of 2 workers to 1: the 1-worker step (with the workers' measured
    contention and step spread), and the all-reduces the engine does (the gradients each step,
    in `allreduce_dtype`, one more each call) over the median measured link."""
    from tfmulti.bench import stepmodel

    link = stepmodel.Link("gRPC on localhost", statistics.median(x["gbytes_per_s"] for x in links),
                        statistics.median(x["latency_s"] for x in links))
    setup = stepmodel.Setup(machines=2, inter=link, steps_per_call=args.steps)
    model = stepmodel.Model(gradient_bytes, 1).sent_in(allreduce_dtype)
    result = stepmodel.predict(compute, model, setup, args.per_worker_batch)
    return {"ratio": result.speedup, "terms": result.terms, "link_gbytes_per_s": link.gbytes_per_s,
            "link_latency_s": link.latency_s}


def by_processes(args, dtypes):
    """Every set-up in its own processes, one after the other, rounds alternating the order."""
    from tfmulti.launch import free_ports

    m = measurements(dtypes)
    for round_ in range(args.rounds):
        rates = {}
        for setup in order(round_, dtypes):
            if setup == "one":
                print(f"round {round_ + 1}/{args.rounds}: 1 worker on 1 core", flush=True)
                alone = results([point(0, args, [f"--step_times={args.step_times}"])])[0]
                rates["one"] = alone["samples_images_per_s"]
                m["one"] += rates["one"]
                m["steps"]["one"] += alone["step_times_s"]
                continue
            if setup == "apart":
                print(f"round {round_ + 1}/{args.rounds}: 2 single workers at once, 1 core each, "
                      "computing apart", flush=True)
                points = results([point(i, args, [f"--step_times={args.step_times}"])
                                  for i in range(2)])
                m["apart"] += [rate for p in points for rate in p["samples_images_per_s"]]
                m["spread"] += relative([t for p in points for t in p["step_times_s"]])
                m["steps"]["apart"] += [t for p in points for t in p["step_times_s"]]
                continue
            print(f"round {round_ + 1}/{args.rounds}: 2 workers, 1 core each, gradients in "
                  f"{setup}", flush=True)
            hosts = ",".join(f"localhost:{p}" for p in free_ports(2))
            extra = [f"--worker_hosts={hosts}", f"--allreduce_dtype={setup}",
                     f"--step_times={args.step_times}"]
            if setup == dtypes[0]:
                extra.append(f"--link_mb={args.link_mb}")
            chief, _ = results([point(i, args, [*extra, f"--task_index={i}"]) for i in range(2)])
            assert chief["replicas"] == 2, chief
            m["malloc"] = chief["malloc"]
            rates[setup] = chief["samples_images_per_s"]
            m["two"][setup] += rates[setup]
            m["steps"][setup] += chief["step_times_s"]
            if "link" in chief:
                m["links"].append(chief["link"])
            m["gradient_bytes"] = chief["gradient_bytes"]
        for dtype in dtypes:
            m["rounds"][dtype].append(statistics.median(rates[dtype])
                                      / statistics.median(rates["one"]))
    return m


def measurements(dtypes):
    return {"one": [], "apart": [], "spread": [], "two": {d: [] for d in dtypes}, "links": [],
            "rounds": {d: [] for d in dtypes}, "gradient_bytes": None, "malloc": None,
            "steps": {s: [] for s in ("one", "apart", *dtypes)}}


def order(round_, dtypes):
    """Odd rounds run the set-ups in reverse order: a machine whose speed drifts during the
    run then favours neither."""
    return ["one", "apart", *dtypes] if round_ % 2 == 0 else [*dtypes[::-1], "apart", "one"]


def single_steps(times):
    """Median, spread and tails of single steps, in ms."""
    ms = sorted(1e3 * t for t in times)
    tenths = statistics.quantiles(ms, n=10) if len(ms) > 1 else ms * 9
    return {"median_ms": statistics.median(ms), "sd_ms": statistics.pstdev(ms),
            "p10_ms": tenths[0], "p90_ms": tenths[-1], "count": len(ms)}


def relative(times):
    mean = statistics.fmean(times)
    return [t / mean for t in times]


def interleaved(args, dtypes):
    """The same set-ups in one pair of worker processes that stay up, switching set-up every
    `repeats` calls (seconds), so that the machine's drift over minutes favours none."""
    from tfmulti.launch import free_ports

    hosts = ",".join(f"localhost:{p}" for p in free_ports(2))
    print(f"{args.rounds} rounds in one pair of worker processes, set-ups interleaved",
          flush=True)
    chief, other = results([["taskset", "-c", str(i), sys.executable, os.path.abspath(__file__),
                              *sys.argv[1:], f"--worker={i}", f"--hosts={hosts}"]
                             for i in range(2)], timeout=1800)
    batch = args.per_worker_batch * args.steps
    m = measurements(dtypes)
    m["one"] = [batch / t for t in chief["one"]]
    m["apart"] = [batch / t for w in (chief, other) for t in w["apart"]]
    for times_0, times_1 in zip(chief["step_times"], other["step_times"]):  # one per round
        m["spread"] += relative(times_0 + times_1)
        m["steps"]["apart"] += times_0 + times_1
    m["steps"]["one"] = chief["single_steps"]["one"]
    for dtype in dtypes:
        m["two"][dtype] = [2 * batch / t for t in chief[dtype]]
        m["steps"][dtype] = chief["single_steps"][dtype]
        for r in range(args.rounds):
            calls = slice(r * args.repeats, (r + 1) * args.repeats)
            m["rounds"][dtype].append(2 * statistics.median(chief["one"][calls])
                                      / statistics.median(chief[dtype][calls]))
    m["links"], m["gradient_bytes"] = [chief["link"]], chief["gradient_bytes"]
    m["idle_cpu_share"], m["malloc"] = other["idle_cpu_share"], chief["malloc"]
    print(f"while worker 0 trained alone, worker 1 (waiting in an all-reduce) used "
          f"{other['idle_cpu_share']:.1%} of its core")
    return m


def interleaved_worker(args, dtypes):
    """One of the two processes of `interleaved`; prints RESULT {json}."""
    from tfmulti.processes import child

    child.die_with_parent_from_environment()  # the benchmark's supervisor: not left running
    hosts = args.hosts.split(",")
    os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": hosts},
                                          "task": {"type": "worker", "index": args.worker}})
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    from tfmulti.bench import measure, stepmodel
    from tfmulti.distribution import allocator

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    engines = {"alone": measure.training_call(tf.distribute.OneDeviceStrategy("/cpu:0"),
                                            "resnet18", args.width, args.per_worker_batch,
                                            args.steps)}
    for dtype in dtypes:
        engines[dtype] = measure.training_call(strategy, "resnet18", args.width,
                                             args.per_worker_batch, args.steps,
                                             allreduce_dtype=dtype)
    # Every set-up starts together: a 4-byte all-reduce the other worker waits in.
    barrier = tf.function(lambda: strategy.reduce(
        tf.distribute.ReduceOp.SUM, strategy.run(lambda: tf.ones([1])), axis=None))
    for call, _ in engines.values():  # warm-up: traces every function
        call(args.steps)
    barrier()
    out = {"one": [], "apart": [], "step_times": [], "idle_cpu_s": 0.0, "one_wall_s": 0.0,
           **{d: [] for d in dtypes}, "single_steps": {s: [] for s in ("one", *dtypes)}}
    steps_per_round = -(-args.step_times // args.rounds)
    for round_ in range(args.rounds):
        for setup in order(round_, dtypes):
            barrier().numpy()
            if setup == "one":  # worker 0 alone; worker 1 waits in the next barrier
                wall, cpu = time.perf_counter(), time.process_time()
                if args.worker == 0:
                    call = engines["alone"][0]
                    out["one"] += [call(args.steps) for _ in range(args.repeats)]
                    out["single_steps"]["one"] += [call(1) for _ in range(steps_per_round)]
                barrier().numpy()
                out["idle_cpu_s"] += time.process_time() - cpu
                out["one_wall_s"] += time.perf_counter() - wall
            elif setup == "apart":
                call = engines["alone"][0]
                out["apart"] += [call(args.steps) for _ in range(args.repeats)]
                out["step_times"].append([call(1) for _ in range(steps_per_round)])
            else:
                call = engines[setup][0]
                out[setup] += [call(args.steps) for _ in range(args.repeats)]
                out["single_steps"][setup] += [call(1) for _ in range(steps_per_round)]
    barrier().numpy()
    link = measure.measured_link(strategy, args.link_mb)
    out["link"] = {"gbytes_per_s": link.gbytes_per_s, "latency_s": link.latency_s}
    out["gradient_bytes"] = stepmodel.Model.of_keras(engines[dtypes[0]][1].model).gradient_bytes
    out["idle_cpu_share"] = out["idle_cpu_s"] / out["one_wall_s"]
    out["malloc"] = allocator.loaded_malloc()
    print("RESULT " + json.dumps(out), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--per_worker_batch", type=int, default=256)
    parser.add_argument("--allreduce_dtypes", default="float32", help="comma separated: each "
                        "round runs the 2 workers once per dtype the gradients cross in")
    parser.add_argument("--step_times", type=int, default=40, help="single steps each set-up "
                        "times, one call each (the spread of the workers computing apart gives "
                        "the straggler)")
    parser.add_argument("--link_mb", type=float, default=2.8, help="all-reduce size for the "
                        "link's bandwidth: the gradients' (2.8 MB at width 16)")
    parser.add_argument("--interleaved", action="store_true", help="every set-up in one pair "
                        "of worker processes, switching every --repeats calls")
    parser.add_argument("--malloc", default="auto", help="the workers' malloc: auto (TCMalloc "
                        "if installed), tcmalloc, system (glibc's) or a library's path")
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--hosts", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results",
                                                      "multiworker.json"))
    args = parser.parse_args()
    dtypes = args.allreduce_dtypes.split(",")
    if args.worker is not None:
        return interleaved_worker(args, dtypes)
    use_malloc(args.malloc)
    m = (interleaved if args.interleaved else by_processes)(args, dtypes)
    one, apart, spread, two, links, rounds = (m[k] for k in ("one", "apart", "spread", "two",
                                                             "links", "rounds"))
    gradient_bytes = m["gradient_bytes"]
    from tfmulti.bench import stepmodel

    print(f"malloc the workers loaded: {m['malloc']}")
    print(f"1 worker x 1 core:  {statistics.median(one):.1f} images/s "
          f"({min(one):.1f}-{max(one):.1f})")
    compute = stepmodel.Compute(statistics.median(one),
                              contention=statistics.median(one) / statistics.median(apart),
                              step_spread=tuple(spread))
    print(f"2 workers computing apart: {statistics.median(apart):.1f} images/s each "
          f"({min(apart):.1f}-{max(apart):.1f}): contention {compute.contention:.3f}; single "
          f"steps spread by {statistics.pstdev(spread):.1%} (sd), the slower of 2 takes "
          f"{stepmodel.straggler_share(spread, 2):+.1%} on average")
    single = {setup: single_steps(times) for setup, times in m["steps"].items() if times}
    print("single steps, one call each (median, sd): " + ", ".join(
        f"{setup} {x['median_ms']:.1f} ms ({x['sd_ms']:.1f})" for setup, x in single.items()))
    summary = {}
    for dtype in dtypes:
        ratio = statistics.median(two[dtype]) / statistics.median(one)
        print(f"2 workers x 1 core, gradients in {dtype}: {statistics.median(two[dtype]):.1f} "
              f"images/s ({min(two[dtype]):.1f}-{max(two[dtype]):.1f})")
        print(f"  ratio: {ratio:.2f} (target >= 1.85 at batch 64); each round's: "
              + ", ".join(f"{r:.2f}" for r in rounds[dtype]) + " (a spread over 0.1 means the "
              "machine's speed changed during the run: rerun)")
        predicted = prediction(compute, gradient_bytes, dtype, links, args)
        predicted["error"] = predicted["ratio"] / ratio - 1
        print(f"  predicted: {predicted['ratio']:.2f} ({predicted['error']:+.1%} against the "
              f"measured {ratio:.2f}); link between the workers "
              f"{predicted['link_gbytes_per_s']:.2f} GB/s, "
              f"{predicted['link_latency_s'] * 1e6:.0f} us a hop; a step: " + ", ".join(
                  f"{name} {seconds * 1e3:.1f} ms" for name, seconds in predicted["terms"].items()))
        summary[dtype] = {"two_workers_images_per_s": two[dtype], "ratio": ratio,
                          "round_ratios": rounds[dtype], "predicted": predicted}
    import tensorflow as tf

    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    first = summary[dtypes[0]]
    with open(args.out, "w") as f:
        json.dump({"command": " ".join(sys.argv), "args": vars(args), "cpu_cores": os.cpu_count(),
                   "versions": {"python": platform.python_version(), "tensorflow": tf.__version__},
                   "one_worker_images_per_s": one, "apart_images_per_s": apart,
                   "contention": compute.contention, "step_spread": spread,
                   "idle_cpu_share": m.get("idle_cpu_share"), "malloc": m["malloc"], **first,
                   "single_steps": single, "single_steps_s": m["steps"],
                   "allreduce_dtypes": summary}, f,
                  indent=2)
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
