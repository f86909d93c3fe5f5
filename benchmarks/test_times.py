"""How long `make test`'s suite takes on this machine, and on a stand-in for the slower kind.

    python benchmarks/test_times.py --out=benchmarks/results/test_times.json
    python benchmarks/test_times.py --slower --out=benchmarks/results/test_times.json  # root

Runs the suite as `make test` runs it (the same pytest command, after `make test` has set up
.venv) and records its wall time and pytest's summary line under this machine's CPU. With
--slower it runs under a stand-in for the 2-core machines without AVX-512 these sessions also
get (about twice as slow): the suite's processes share one core's worth of CPU time (a cgroup
v1 quota over both cores, 10 ms periods: needs root) and Eigen's kernels
(`TF_ENABLE_ONEDNN_OPTS=0`, TensorFlow's default there, which tfmulti keeps: kernels.py). It
is a stand-in, not that machine: each figure is recorded with how it was made.
"""
import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from quickstart import cpu_name  # noqa: E402

PYTEST = ["-m", "pytest", "-q", "-m", "not soak", "-n", "3", "--dist", "loadfile",
          "--no-loadscope-reorder", "--max-worker-restart=0", "--durations=15",
          "tests"]  # as the Makefile's
CGROUP = "/sys/fs/cgroup/cpu/tfmulti-slower"


def one_core_group():
    """A cgroup whose processes share one core's worth of CPU time; its tasks file."""
    os.makedirs(CGROUP, exist_ok=True)
    with open(os.path.join(CGROUP, "cpu.cfs_period_us"), "w") as f:
        f.write("10000")
    with open(os.path.join(CGROUP, "cpu.cfs_quota_us"), "w") as f:
        f.write("10000")
    return os.path.join(CGROUP, "tasks")


def seconds_per_file(junit_path):
    """Each test file's summed test time from pytest's JUnit XML, slowest first."""
    per_file = {}
    for case in ElementTree.parse(junit_path).iter("testcase"):
        name = case.get("classname", "").split(".")[1] if "." in case.get("classname", "") else "?"
        per_file[name] = per_file.get(name, 0.0) + float(case.get("time", 0))
    return {name: round(s, 1) for name, s in sorted(per_file.items(), key=lambda kv: -kv[1])}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slower", action="store_true")
    parser.add_argument("--out", default="")
    options = parser.parse_args()
    env = dict(os.environ)
    preexec = None
    if options.slower:
        tasks = one_core_group()
        env["TF_ENABLE_ONEDNN_OPTS"] = "0"

        def preexec():
            with open(tasks, "w") as f:
                f.write(str(os.getpid()))

    python = os.path.join(ROOT, ".venv", "bin", "python")
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    began = time.monotonic()
    with tempfile.TemporaryDirectory() as scratch:
        junit = os.path.join(scratch, "junit.xml")
        done = subprocess.run([python, *PYTEST, f"--junitxml={junit}"], cwd=ROOT, env=env,
                              capture_output=True, text=True, preexec_fn=preexec)
        wall = time.monotonic() - began
        per_file = seconds_per_file(junit) if os.path.exists(junit) else {}
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - used.ru_utime) + (after.ru_stime - used.ru_stime)
    lines = done.stdout.strip().splitlines()
    summary = lines[-1] if lines else "no output"
    slowest = [line for line in lines if re.match(r"[\d.]+s (setup|call|teardown) ", line)]
    seconds = re.search(r" in ([\d.]+)s", summary)
    result = {
        "cpu": cpu_name(), "cores": os.cpu_count(),
        "how": ("stand-in for the slower kind: one core's CPU time (cgroup quota) and "
                "TF_ENABLE_ONEDNN_OPTS=0" if options.slower else "this machine as it is"),
        "pytest_summary": summary, "pytest_s": float(seconds.group(1)) if seconds else None,
        "wall_s": round(wall, 1),
        # the CPU time of the suite's processes (those their parents waited for): steadier
        # than the wall time between runs on a shared machine
        "cpu_s": round(cpu, 1), "exit": done.returncode, "slowest_tests": slowest,
        "seconds_per_file": per_file,
    }
    print(json.dumps(result, indent=2))
    if options.out:
        try:
            with open(options.out) as f:
                recorded = json.load(f)
        except FileNotFoundError:
            recorded = {"runs": []}
        recorded["command"] = ("python benchmarks/test_times.py [--slower] "
                               f"--out={os.path.relpath(options.out, ROOT)}")
        recorded["runs"] = [r for r in recorded["runs"]
                            if (r["cpu"], r["how"]) != (result["cpu"], result["how"])] + [result]
        with open(options.out, "w") as f:
            json.dump(recorded, f, indent=2)
            f.write("\n")
    sys.exit(done.returncode)


if __name__ == "__main__":
    main()
