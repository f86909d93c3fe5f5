"""One worker's training steps with glibc's malloc and with TCMalloc: page faults, kernel
time and step time a step, each allocator in its own process, rounds alternating the order.

    python benchmarks/malloc.py                      # about 3 minutes on 2 cores

Each process is pinned to core 0 with one intra-op and one inter-op thread and runs the main
job's engine (measure.training_call: ResNet-18 at width 16, synthetic images), then counts
with getrusage over --calls calls of --steps steps. JSON goes to --out.
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def environment(setting):
    """The environment of a process using malloc `setting` (tfmulti/distribution/allocator.py)."""
    from tfmulti.distribution import allocator

    env = {k: v for k, v in os.environ.items()
           if k not in ("LD_PRELOAD", "TF_CONFIG")}
    library = allocator.choose(setting)
    return allocator.preload_environment(env, library) if library else env


def measure(args):
    """In the worker process: what one step costs here; prints RESULT {json}."""
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    from tfmulti.bench.measure import training_call
    from tfmulti.distribution import allocator

    call, _ = training_call(tf.distribute.OneDeviceStrategy("/cpu:0"), "resnet18",
                                     args.width, args.batch, args.steps)
    for _ in range(2):  # traces, compiles, and lets the allocator reach its working set
        call(args.steps)
    before = resource.getrusage(resource.RUSAGE_SELF)
    seconds = [call(args.steps) / args.steps for _ in range(args.calls)]
    after = resource.getrusage(resource.RUSAGE_SELF)
    steps = args.calls * args.steps
    print("RESULT " + json.dumps({
        "malloc": allocator.loaded_malloc(), "step_s": seconds,
        "page_faults_per_step": (after.ru_minflt - before.ru_minflt) / steps,
        "kernel_s_per_step": (after.ru_stime - before.ru_stime) / steps,
        "user_s_per_step": (after.ru_utime - before.ru_utime) / steps}), flush=True)


def run_one(setting, args):
    command = ["taskset", "-c", "0", sys.executable, os.path.abspath(__file__), "--worker",
               f"--width={args.width}", f"--batch={args.batch}", f"--steps={args.steps}",
               f"--calls={args.calls}"]
    result = subprocess.run(command, cwd=ROOT, env=environment(setting), capture_output=True,
                            text=True, timeout=900)
    if result.returncode != 0:
        sys.exit(f"the {setting} process failed (exit {result.returncode}): "
                 + (result.stderr.strip().splitlines() or ["(no output)"])[-1])
    return json.loads(result.stdout.split("RESULT ", 1)[1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--calls", type=int, default=6)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results",
                                                      "malloc.json"))
    args = parser.parse_args()
    if args.worker:
        return measure(args)
    from tfmulti.distribution import allocator

    if allocator.find_tcmalloc() is None:
        sys.exit(f"TCMalloc is not installed ({allocator.INSTALL_HINT})")
    runs = {"system": [], "tcmalloc": []}
    for round_ in range(args.rounds):
        for setting in (["system", "tcmalloc"] if round_ % 2 == 0 else ["tcmalloc", "system"]):
            print(f"round {round_ + 1}/{args.rounds}: {setting}", flush=True)
            runs[setting].append(run_one(setting, args))
            assert runs[setting][-1]["malloc"] == ("system" if setting == "system" else
                                                    "tcmalloc"), runs[setting][-1]["malloc"]
    summary = {}
    for setting, results in runs.items():
        summary[setting] = {
            "step_ms": 1e3 * statistics.median(s for r in results for s in r["step_s"]),
            "page_faults_per_step": statistics.median(r["page_faults_per_step"] for r in results),
            "kernel_ms_per_step": 1e3 * statistics.median(r["kernel_s_per_step"] for r in results)}
        print(f"{setting:>8}: step {summary[setting]['step_ms']:.1f} ms (median), "
              f"{summary[setting]['page_faults_per_step']:.0f} page faults and "
              f"{summary[setting]['kernel_ms_per_step']:.2f} ms kernel time a step")
    ratio = summary["system"]["step_ms"] / summary["tcmalloc"]["step_ms"]
    print(f"step time glibc / TCMalloc: {ratio:.3f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"command": " ".join(sys.argv), "args": vars(args), "summary": summary,
                   "step_time_ratio_system_over_tcmalloc": ratio, "runs": runs}, f, indent=2)
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
