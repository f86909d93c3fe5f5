"""What `make run` prints and how long it takes, measured: the figures the README,
flags/quickstart.cfg and docs/main-job.md show (tests/test_docs.py checks that they show
these, and that the flags measured are today's flags/quickstart.cfg).

    python benchmarks/quickstart.py --out=benchmarks/results/quickstart.json \
        --picture=docs/images/quickstart-accuracy.png   # ~3 minutes

Runs make run's command, `python -m tfmulti.main --flagfile=flags/quickstart.cfg`, in a
process of its own with TCMalloc preloaded where it is installed (as make run does), into a
temporary --model_dir; records the book's line and the command's wall time (the install that
make run may do first is not in it).
"""
import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGFILE = os.path.join("flags", "quickstart.cfg")


def flags_digest(path):
    """sha256 of the flag lines of a flagfile (its comments left out: the figures they quote
    are what this measures)."""
    with open(path, encoding="utf-8") as f:
        lines = [line.strip() for line in f if line.strip() and not line.startswith("#")]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def where_measured():
    """What a benchmark's record says of where it ran: the CPU, its cores, the kernels."""
    return {"dataset": "synthetic (embedded, offline)", "cpu": cpu_name(),
            "cpu_cores": len(os.sched_getaffinity(0)),
            "onednn": os.environ.get("TF_ENABLE_ONEDNN_OPTS", "TensorFlow's default")}


def measure(picture=None):
    sys.path.insert(0, ROOT)
    from tfmulti.distribution import allocator

    tcmalloc = allocator.find_tcmalloc()
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    env.update(allocator.preload_environment({}, tcmalloc) if tcmalloc else {})
    with tempfile.TemporaryDirectory() as model_dir:
        start = time.monotonic()
        result = subprocess.run([sys.executable, "-m", "tfmulti.main", f"--flagfile={FLAGFILE}",
                                 f"--model_dir={model_dir}/run"], cwd=ROOT, env=env,
                                capture_output=True, text=True, timeout=3600)
        seconds = time.monotonic() - start
        if result.returncode != 0:
            sys.exit(f"make run's command failed:\n{result.stderr[-3000:]}")
        with open(os.path.join(model_dir, "run", "metrics.json")) as f:
            metrics = json.load(f)
        if picture:
            shutil.copyfile(os.path.join(model_dir, "run", "accuracy.png"), picture)
    line = next(x for x in result.stdout.splitlines() if x.startswith("test acc: "))
    return {"line": line, "seconds": round(seconds, 1),
            "test_acc": metrics["epochs"][-1]["test_acc"],
            "epochs": [{k: r[k] for k in ("epoch", "test_acc", "seconds", "images_per_sec")}
                       for r in metrics["epochs"]],
            "malloc": "tcmalloc" if tcmalloc else "system", "versions": metrics["versions"]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None, help="write the result here (JSON)")
    parser.add_argument("--picture", default=None, help="copy the run's accuracy.png here")
    args = parser.parse_args()
    result = {"command": "python benchmarks/quickstart.py"
                         + (f" --out={args.out}" if args.out else "")
                         + (f" --picture={args.picture}" if args.picture else ""),
              "flagfile": FLAGFILE, "flags_sha256": flags_digest(os.path.join(ROOT, FLAGFILE)),
              "cpu": cpu_name(), "cpu_cores": len(os.sched_getaffinity(0)),
              **measure(args.picture)}
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
