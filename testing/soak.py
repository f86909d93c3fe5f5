"""Soak checks: what `make test` cannot afford (`make soak`, on 2 cores).

    make soak, or: .venv/bin/python -m testing.soak [--only=long,shared,kills,tune] [--rounds=10]

One line per check and a pass count at the end; exit 1 if any check failed.
- long:   a 60-epoch run of a tiny model, killed (kill -9) once past epoch 20 and rerun: it
          completes and its plot and metrics.json cover all 60 epochs.
- shared: 5 consecutive 2-worker launcher runs in one --model_dir (--overwrite): all finish,
          and every worker of every run ends with the same weights.
- kills:  rounds of kill -9 of one worker at a chosen moment (before the group forms,
          mid-epoch, during a checkpoint save, during evaluation): the launcher exits
          non-zero within its bound, and rerunning the same command finishes with the weights
          of an uninterrupted --deterministic run.
- lost:   two workers started by hand (no launcher), one killed (kill -9) mid-epoch: the
          other stops within 60 s with "lost contact with another worker", and both
          restarted with the same command resume at the last checkpoint, equal weights.
- elastic: a 2-replica run killed (kill -9) as a checkpoint's index appears, while a checkpoint
          is written, and between checkpoints, each run again on 1, 2 and 4 replicas: on 2 and
          on 1 (the 2 replicas' micro-batches) it ends with the uninterrupted run's weights bit
          for bit, from the newest whole checkpoint; on 4 within twice the gap between the
          uninterrupted runs on 4 and on 2 (the resume line's guarantee).
- tune:   a tuning session killed (kill -9) and rerun 3 times: no trial lost or run twice.
- tests:  the suite's tests marked `soak`, on 2 pytest workers, within SLOW_TESTS_LIMIT.
- isolated: the suite's tests marked `isolated`, each in a pytest process of its own.
- memory: the tuner's memory after each of 4 trials (each in a process of its own) grows by
          less than 40 MB from the second to the last (in one process: about 70 MB).
"""
import argparse
import csv
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GRACE = 10  # the launcher's --grace here
# A run of the launcher after a kill must end within: the grace, the SIGKILL wait (10 s),
# and the survivors' own noticing (TensorFlow's heartbeat, seconds).
EXIT_BOUND = GRACE + 10 + 30
MULTIWORKER = ["--dataset=synthetic", "--synthetic_train_size=1024", "--synthetic_test_size=200",
               "--model=resnet18", "--width=4", "--per_replica_batch_size=16", "--epochs=2",
               "--checkpoint_steps=5", "--steps_per_call=1", "--deterministic"]


def environment():
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CPP_MIN_LOG_LEVEL", "TF_CONFIG")}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def start(module, *args):
    return subprocess.Popen([sys.executable, "-m", module, *args], cwd=ROOT, env=environment(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(process, timeout=600, reread_s=30):
    """(exit code, output) of a started process. Past `timeout` seconds it and every process
    it started are killed (kill -9), and the output so far ends with a line saying so: the
    check fails with what was printed, and the other checks still run. A process that left
    its tree (a double fork) and still holds the pipe is waited for `reread_s` seconds more,
    then the output is given up."""
    try:
        out, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for _ in range(3):  # again for any started while the first were killed
            for pid in [process.pid, *descendants(process.pid)]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        try:  # a process it left behind may still hold the pipe: then what was read so far
            out, _ = process.communicate(timeout=reread_s)
        except subprocess.TimeoutExpired as e:
            process.stdout.close()
            process.wait(timeout=reread_s)
            out = e.output.decode(errors="replace") if isinstance(e.output, bytes) else (
                e.output or "")
        out = f"{out or ''}\nsoak: stopped with kill -9 at its time limit, {timeout} s"
    return process.returncode, out


def descendants(pid):
    """The processes `pid` started, and theirs (from /proc)."""
    parents = {}
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parents.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(
                    int(entry))
        except (OSError, ValueError, IndexError):
            continue
    found, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found += children
        todo += children
    return found


def fingerprints(model_dir):
    """Each worker's weights fingerprint at the end of the run in model_dir (metrics.json);
    [] when the run did not finish."""
    try:
        with open(os.path.join(model_dir, "metrics.json")) as f:
            return json.load(f).get("weights_fingerprints", [])
    except FileNotFoundError:
        return []


def child_pids(pid):
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:  # gone (FileNotFoundError, or ProcessLookupError while it exits)
        return []


def worker_pids(launcher_pid):
    """{task index: pid} of the launcher's workers, read from their command lines (the
    launcher also has a child that holds the workers' network: not a worker)."""
    found = {}
    for pid in child_pids(launcher_pid):
        try:
            with open(f"/proc/{pid}/cmdline") as f:
                args = f.read().split("\0")
        except OSError:  # a short-lived child, gone since it was listed
            continue
        if "tfmulti.main" in args:
            index = [a for a in args if a.startswith("--task_index=")]
            if index:
                found[int(index[0].split("=")[1])] = pid
    return found


class Checks:
    def __init__(self):
        self.results = []

    def record(self, name, ok, detail):
        self.results.append(ok)
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}", flush=True)


# ----------------------------------------------------------------------------- long

def long_run(checks, workdir):
    model_dir = os.path.join(workdir, "long")
    args = ["--dataset=synthetic", "--synthetic_train_size=512", "--synthetic_test_size=128",
            "--model=lenet", "--width=2", "--per_replica_batch_size=64", "--epochs=60",
            "--num_gpus=0", "--checkpoint_steps=4", f"--model_dir={model_dir}"]
    began = time.monotonic()
    process = start("tfmulti.main", *args)
    metrics = os.path.join(model_dir, "metrics.json")
    killed_after = None
    while process.poll() is None:
        try:
            with open(metrics) as f:
                epochs = len(json.load(f)["epochs"])
        except (OSError, ValueError, KeyError):
            epochs = 0
        if epochs >= 23:
            process.kill()
            killed_after = epochs
            break
        time.sleep(0.05)
    process.communicate()
    code, out = finish(start("tfmulti.main", *args))
    with open(metrics) as f:
        written = json.load(f)
    covered = [r["epoch"] for r in written["epochs"]]
    with open(os.path.join(model_dir, "accuracy.png"), "rb") as f:
        png = f.read(4) == b"\x89PNG"
    ok = (killed_after is not None and code == 0 and covered == list(range(1, 61)) and png
          and "summary" in written)
    checks.record("60-epoch run, kill -9 past epoch 20, rerun", ok,
                  f"killed after epoch {killed_after}, rerun exit {code}, metrics.json epochs "
                  f"{covered[0]}..{covered[-1]} ({len(covered)}), plot {'ok' if png else 'missing'}"
                  f", {time.monotonic() - began:.0f} s" + ("" if ok else f"\n{out[-2000:]}"))


# ----------------------------------------------------------------------------- shared

def launch_args(model_dir, *extra):
    return [f"--grace={GRACE}", "--workers=2", "--", *MULTIWORKER,
            f"--model_dir={model_dir}", *extra]


def shared_model_dir(checks, workdir):
    model_dir = os.path.join(workdir, "shared")
    os.makedirs(model_dir)
    prints, codes, began, failed = [], [], time.monotonic(), ""
    for _ in range(5):
        code, out = finish(start("tfmulti.launch", *launch_args(model_dir, "--overwrite")))
        codes.append(code)
        prints.append(fingerprints(model_dir) if code == 0 else [])
        if code and not failed:  # why the first failure failed, in the check's line
            failed = "; first failure's last lines: " + " | ".join(out.strip().splitlines()[-4:])
    ok = codes == [0] * 5 and all(len(p) == 2 for p in prints) and len(
        {f for p in prints for f in p}) == 1
    checks.record("5 launcher runs of 2 workers in one --model_dir, --overwrite", ok,
                  f"exit codes {codes}, fingerprints {sorted({f for p in prints for f in p})}, "
                  f"{time.monotonic() - began:.0f} s{failed}")
    return prints[0][0] if ok else None


# ----------------------------------------------------------------------------- kills

MOMENTS = ["before the group forms", "mid-epoch", "during a checkpoint save", "during evaluation"]


def kill_at(moment, launcher, model_dir, victim_index, rng):
    """Waits for `moment` in the launcher's run and kills one worker with SIGKILL; returns
    (what was seen when it was killed, the launcher's output so far)."""
    seen = []
    workers = {}
    deadline = time.monotonic() + 120
    while len(workers) < 2 and time.monotonic() < deadline:
        workers = worker_pids(launcher.pid)
        time.sleep(0.01)
    victim = workers[victim_index]
    checkpoints = os.path.join(model_dir, "checkpoints")
    if moment == "before the group forms":
        time.sleep(rng.uniform(0.2, 2.0))  # TensorFlow is still importing or connecting
        what = "at start-up"
    elif moment == "during a checkpoint save":
        what = None
        while what is None and time.monotonic() < deadline and launcher.poll() is None:
            names = os.listdir(checkpoints) if os.path.isdir(checkpoints) else []
            if any("_temp" in n for n in names):  # TensorFlow writes into ckpt-N_temp/
                what = f"while writing {[n for n in names if '_temp' in n][0]}"
            time.sleep(0.002)
    else:
        want = "Epoch 1/2" if moment == "mid-epoch" else re.compile(r"32/32")
        for line in launcher.stdout:
            seen.append(line)
            if (want in line) if isinstance(want, str) else want.search(line):
                break
        if moment == "mid-epoch":
            time.sleep(rng.uniform(0.5, 3.0))
        what = "after: " + (seen[-1].strip()[:60] if seen else "nothing")
    os.kill(victim, signal.SIGKILL)
    return what, seen


# TensorFlow's and gRPC's own log lines (E0000 00:00:... file.cc:12] ...) shown by the
# launcher: a worker's death is the survivors' one tfmulti line, not these.
RUNTIME_LOG = re.compile(r"^\[worker \d+\] ([EWIF]\d{4} \d\d:\d\d:\d\d|WARNING: All log messages)")


def kills(checks, workdir, rounds, reference):
    rng = random.Random(0)
    if reference is None:
        code, out = finish(start("tfmulti.launch", *launch_args(os.path.join(workdir, "ref"))))
        reference = fingerprints(os.path.join(workdir, "ref"))[0] if code == 0 else None
    for round_ in range(rounds):
        moment, victim = MOMENTS[round_ % len(MOMENTS)], rng.choice([0, 1])
        model_dir = os.path.join(workdir, f"kill{round_}")
        began = time.monotonic()
        launcher = start("tfmulti.launch", *launch_args(model_dir))
        what, seen = kill_at(moment, launcher, model_dir, victim, rng)
        killed = time.monotonic()
        try:
            code, rest = finish(launcher, timeout=EXIT_BOUND + 60)
        except subprocess.TimeoutExpired:
            launcher.kill()
            code, rest = None, ""
        stopped = time.monotonic() - killed
        rerun_code, out = finish(start("tfmulti.launch", *launch_args(model_dir)))
        final = set(fingerprints(model_dir)) if rerun_code == 0 else set()
        shown = ("".join(seen) + rest).splitlines()
        # the killed run and the resumed run that ends well: neither shows the runtime's logs
        noise = [line for line in shown + out.splitlines() if RUNTIME_LOG.match(line)]
        said = [line.split("] ", 1)[1] for line in shown if "] tfmulti: " in line]
        repeated = sorted({line for line in said if said.count(line) > 1})
        ok = (code not in (0, None) and stopped < EXIT_BOUND and rerun_code == 0
              and final == {reference} and not noise and not repeated)
        checks.record(f"kill -9 worker {victim} {moment}", ok,
                      f"{what}; launcher exit {code} {stopped:.1f} s after the kill "
                      f"({len(noise)} lines of the runtime's logs, {len(repeated)} repeated) "
                      f"(bound {EXIT_BOUND} s); rerun exit {rerun_code}, weights "
                      f"{'as uninterrupted' if final == {reference} else final}, "
                      f"{time.monotonic() - began:.0f} s" +
                      ("" if ok else "\n" + ("".join(seen) + rest)[-1500:] + out[-1500:]))


# ----------------------------------------------------------------------------- elastic

ELASTIC = ["--dataset=synthetic", "--synthetic_train_size=1024", "--synthetic_test_size=128",
           "--model=lenet", "--width=16", "--global_batch_size=64", "--epochs=3",
           "--checkpoint_steps=5", "--steps_per_call=1", "--deterministic", "--seed=5"]
# 48 steps, a checkpoint every 5 and at each epoch's end (16, 32)
ELASTIC_MOMENTS = ("as the index of the checkpoint at step 10 appears",
                   "while the checkpoint at step 15 is written",
                   "between the checkpoints at 20 and 25")


def final_weights(model_dir):
    """Every weight array of the run's model.keras, in the file's order (h5py: no Keras)."""
    import zipfile

    import h5py
    import numpy as np

    arrays = []
    with zipfile.ZipFile(os.path.join(model_dir, "model.keras")) as z, \
            h5py.File(z.open("model.weights.h5"), "r") as h5:
        h5.visititems(lambda name, item: arrays.append((name, np.array(item)))
                      if isinstance(item, h5py.Dataset) else None)
    return [a for _, a in sorted(arrays, key=lambda pair: pair[0])]


def largest_gap(a, b):
    """The largest difference of any weight, relative to the largest weight."""
    import numpy as np

    scale = max(float(np.abs(x).max()) for x in a if x.size)
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b, strict=True) if x.size) / scale


def elastic_kill(moment, process, model_dir, rng):
    """Waits for `moment` in the run and kills it (SIGKILL); what was seen then."""
    checkpoints = os.path.join(model_dir, "checkpoints")
    deadline = time.monotonic() + 300

    def names():
        return os.listdir(checkpoints) if os.path.isdir(checkpoints) else []

    def wait_for(seen):
        while process.poll() is None and time.monotonic() < deadline:
            found = [n for n in names() if seen(n)]
            if found:
                return found[0]
            time.sleep(0.001)
        return None

    if moment.startswith("as the index"):
        what = wait_for(lambda n: n == "ckpt-10.index")
    elif moment.startswith("while"):
        what = wait_for(lambda n: n.startswith("ckpt-15_temp"))
    else:
        what = wait_for(lambda n: n == "ckpt-20.index")
        time.sleep(rng.uniform(0.01, 0.05))
    process.kill()
    process.communicate()
    steps = sorted(int(n[len("ckpt-"):-len(".index")]) for n in names() if n.endswith(".index"))
    return f"killed at {what}, checkpoints then at steps {steps}", steps


def elastic(checks, workdir):
    rng = random.Random(5)
    references = {}
    for count in (2, 1, 4):
        model_dir = os.path.join(workdir, f"elastic-ref{count}")
        code, out = finish(start("tfmulti.main", *ELASTIC, f"--cpu_replicas={count}",
                                 f"--model_dir={model_dir}"))
        if code:
            checks.record(f"elastic resume: the uninterrupted run on {count}", False, out[-2000:])
            return
        references[count] = final_weights(model_dir)
    allowed = {count: 2 * largest_gap(references[count], references[2]) for count in (1, 4)}
    for i, moment in enumerate(ELASTIC_MOMENTS):
        for count in (2, 1, 4):
            model_dir = os.path.join(workdir, f"elastic{i}-{count}")
            began = time.monotonic()
            what, saved = elastic_kill(moment, start("tfmulti.main", *ELASTIC, "--cpu_replicas=2",
                                              f"--model_dir={model_dir}"), model_dir, rng)
            code, out = finish(start("tfmulti.main", *ELASTIC, f"--cpu_replicas={count}",
                                     f"--model_dir={model_dir}"))
            resumed = [line for line in out.splitlines() if line.startswith("Resuming")]
            gap = largest_gap(final_weights(model_dir), references[2]) if code == 0 else None
            # from the newest whole checkpoint (its index is written last; killed as the index
            # appears, the state file may not list it yet), or, said, from the one before it
            at = re.search(r" at step (\d+)", resumed[0]) if len(resumed) == 1 else None
            at = int(at.group(1)) if at else None
            newest = saved[-1] if saved else None
            if "is unreadable" in out and len(saved) > 1:
                newest = saved[-2]
            # on 1: the 2 replicas' micro-batches with a replica's threads, bit for bit
            ok = code == 0 and at is not None and at - 1 == newest and (
                gap == 0 if count in (1, 2) else gap is not None and gap <= allowed[count])
            bound = "0" if count in (1, 2) else f"{allowed[count]:.2g}"
            checks.record(
                f"kill -9 {moment}, resumed on {count} replica(s)", ok,
                f"{what}; resumed at step {at}; gap to the "
                f"uninterrupted 2-replica run {gap if gap is None else f'{gap:.2g}'} "
                f"(allowed {bound}), {time.monotonic() - began:.0f} s"
                + ("" if ok else f"\n{out[-2000:]}"))


# ----------------------------------------------------------------------------- lost

def free_ports(count):
    from tfmulti.processes import launcher

    return launcher.free_ports(count)


def lost_worker(checks, workdir):
    """Without a launcher a survivor must notice the dead peer itself (TensorFlow's
    coordination service) and say so in one line."""
    model_dir = os.path.join(workdir, "lost")
    hosts = ",".join(f"localhost:{p}" for p in free_ports(2))
    args = [*MULTIWORKER, "--synthetic_train_size=16384", "--epochs=3", f"--model_dir={model_dir}",
            f"--worker_hosts={hosts}"]
    began = time.monotonic()

    def workers(*extra):
        return [subprocess.Popen([sys.executable, "-m", "tfmulti.main", *args, *extra,
                                  f"--task_index={i}"], cwd=ROOT, env=environment(),
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for i in range(2)]

    first = workers()
    for line in first[0].stdout:
        if line.startswith("Epoch 1/"):
            break
    folder = os.path.join(model_dir, "checkpoints")
    deadline = time.monotonic() + 300  # past the first checkpoint (every 5 steps), then kill
    while time.monotonic() < deadline and not (os.path.isdir(folder) and any(
            n.endswith(".index") for n in os.listdir(folder))):
        time.sleep(0.1)
    first[1].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    _, stderr = first[0].communicate(timeout=120)
    noticed = time.monotonic() - killed
    last = (stderr.strip().splitlines() or [""])[-1]
    first[1].wait()
    folder = os.path.join(model_dir, "checkpoints")
    saved = sorted(int(n[5:-6]) for n in os.listdir(folder) if n.endswith(".index")) if (
        os.path.isdir(folder)) else []
    restarted = workers("--epochs=1")
    outputs = [p.communicate(timeout=600) for p in restarted]
    prints = fingerprints(model_dir)
    resumed = bool(saved) and f"at step {saved[-1] + 1}" in outputs[0][0]
    ok = (first[0].returncode == 1 and noticed < 60 and last.startswith(
        "tfmulti: error: lost contact with another worker") and resumed and len(prints) == 2
        and len(set(prints)) == 1 and [p.returncode for p in restarted] == [0, 0]
        and not any("E0000" in err for _, err in outputs))  # no shutdown noise after a success
    checks.record("kill -9 one of two workers without a launcher, restart both", ok,
                  f"survivor exit {first[0].returncode} {noticed:.1f} s after the kill: "
                  f"{last[:300]!r}; restart resumed after step {saved[-1] if saved else None}: "
                  f"{resumed}, fingerprints {sorted(prints)}, {time.monotonic() - began:.0f} s"
                  + ("" if ok else f"\n{outputs[0][1][-1500:]}"))


# ----------------------------------------------------------------------------- tune

def trial_states(session):
    states = {}
    trials = os.path.join(session, "trials")
    for name in sorted(os.listdir(trials)) if os.path.isdir(trials) else []:
        path = os.path.join(trials, name, "trial.json")
        if name.startswith("trial_") and os.path.exists(path):
            with open(path) as f:
                trial = json.load(f)
            states[name] = (trial["status"], trial.get("score"), os.stat(path).st_mtime_ns)
    return states


def tune_kills(checks, workdir, kills=3, max_trials=5):
    session = os.path.join(workdir, "tune")
    args = ["--flagfile=flags/tune_smoke.cfg", "--synthetic_train_size=1024",
            f"--max_trials={max_trials}", f"--model_dir={session}"]
    rng, notes, rerun, began = random.Random(1), [], [], time.monotonic()
    for _ in range(kills):
        done_before = {k: v for k, v in trial_states(session).items() if v[0] == "COMPLETED"}
        process = start("tfmulti.tune", *args)
        wait = rng.uniform(6, 20)
        time.sleep(wait)
        process.kill()
        process.communicate()
        after = trial_states(session)
        rerun += [k for k, v in done_before.items() if after.get(k) != v]
        notes.append(f"{wait:.0f} s")
    code, out = finish(start("tfmulti.tune", *args))
    final = trial_states(session)
    with open(os.path.join(session, "trials.csv")) as f:
        rows = list(csv.DictReader(f))
    ok = (code == 0 and not rerun and len(rows) == max_trials
          and all(r["status"] == "COMPLETED" for r in rows)
          and sorted(final) == [f"trial_{i}" for i in range(max_trials)])
    checks.record(f"tuning session killed {kills} times and rerun", ok,
                  f"killed after {', '.join(notes)}; final exit {code}, {len(rows)} of "
                  f"{max_trials} trials completed, rerun after completing: {rerun or 'none'}, "
                  f"{time.monotonic() - began:.0f} s" + ("" if ok else f"\n{out[-2000:]}"))


# ----------------------------------------------------------------------------- memory

def tune_memory(checks):
    began = time.monotonic()
    code, out = finish(subprocess.Popen(
        [sys.executable, "-m", "testing.tune_memory"], cwd=ROOT,
        env=environment(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        marks = json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        marks = []
    ok = code == 0 and len(marks) == 4 and marks[-1] - marks[1] < 40
    checks.record("the tuner's memory over 4 trials", ok,
                  f"RSS after each trial {marks} MB, growth from the second "
                  f"{marks[-1] - marks[1] if len(marks) == 4 else '?'} MB (limit 40), "
                  f"{time.monotonic() - began:.0f} s" + ("" if ok else f"\n{out[-2000:]}"))


# ----------------------------------------------------------------------------- slow tests

# The suite's soak tests, two pytest workers (a file each at a time): 40 minutes on the faster
# CPU kind (past 40 one after another); the slower kind is about 3 times slower.
SLOW_TESTS_LIMIT = 9000


def pytest_passed(code: int, summary: str) -> bool:
    """Whether a pytest run, by its exit code and last line, ran tests and all passed
    (pytest-xdist's last line names no deselected tests, so that is not asked for)."""
    return (code == 0 and re.search(r"\b[1-9]\d* passed", summary) is not None
            and re.search(r"\b\d+ (failed|errors?)\b", summary) is None)


def slow_tests(checks):
    """The suite's tests marked `soak`: too slow for `make test`, run here."""
    began = time.monotonic()
    code, out = finish(start("pytest", "-q", "-m", "soak and not isolated", "-n", "2",
                             "--dist", "loadfile", "--durations=5", "tests"),
                       timeout=SLOW_TESTS_LIMIT)
    summary = out.strip().splitlines()[-1] if out.strip() else "no output"
    ok = pytest_passed(code, summary)
    slowest = [line for line in out.splitlines() if re.match(r"\d+\.\d+s (call|setup)", line)]
    checks.record("the suite's tests marked soak", ok, f"{summary}, "
                  f"{time.monotonic() - began:.0f} s; slowest: {'; '.join(slowest)}"
                  + ("" if ok else f"\n{failures_of(out)}"))


def failures_of(out, limit=12000):
    """What a failed pytest run says of its failures (its FAILURES and ERRORS sections, at
    most `limit` characters), else its last 3000 characters: the warnings summary after the
    failures would hide them."""
    found = re.search(r"^=+ (FAILURES|ERRORS) =+$(.*?)(?=^=+ (warnings summary|short test "
                      r"summary info|slowest \d+ durations) =+$)", out, re.M | re.S)
    return found.group(0)[:limit] if found else out[-3000:]


def isolated_tests(checks):
    """The suite's tests marked `isolated`, each in a pytest process of its own: a crash of
    TensorFlow's in one (see tests/test_xla.py) is that test's, said with its exit code."""
    listed = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-m",
                             "isolated", "tests"], cwd=ROOT, env=environment(),
                            capture_output=True, text=True, timeout=600)
    for test in [line for line in listed.stdout.splitlines() if "::" in line]:
        began = time.monotonic()
        code, out = finish(start("pytest", "-q", "-p", "no:cacheprovider", test), timeout=900)
        summary = out.strip().splitlines()[-1] if out.strip() else "no output"
        checks.record(test.split("::")[-1], code == 0, f"exit {code}, {summary}, "
                      f"{time.monotonic() - began:.0f} s" + ("" if code == 0 else
                                                              f"\n{out[-3000:]}"))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only",
                        default="long,shared,kills,elastic,lost,tune,memory,tests,isolated")
    parser.add_argument("--rounds", type=int, default=10)
    options = parser.parse_args()
    checks, began = Checks(), time.monotonic()
    workdir = tempfile.mkdtemp(prefix="tfmulti-soak-")
    try:
        only = options.only.split(",")
        reference = None
        if "long" in only:
            long_run(checks, workdir)
        if "shared" in only:
            reference = shared_model_dir(checks, workdir)
        if "kills" in only:
            kills(checks, workdir, options.rounds, reference)
        if "elastic" in only:
            elastic(checks, workdir)
        if "lost" in only:
            lost_worker(checks, workdir)
        if "tune" in only:
            tune_kills(checks, workdir)
        if "memory" in only:
            tune_memory(checks)
        if "tests" in only:
            slow_tests(checks)
        if "isolated" in only:
            isolated_tests(checks)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    passed = sum(checks.results)
    print(f"soak: {passed} of {len(checks.results)} checks passed in "
          f"{(time.monotonic() - began) / 60:.1f} min")
    sys.exit(0 if passed == len(checks.results) else 1)


if __name__ == "__main__":
    main()
