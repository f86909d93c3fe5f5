"""Starts N workers of the main job on this machine and streams their output.

    python -m tfmulti.launch --workers=2 -- --dataset=synthetic --width=16 --epochs=2

Each worker is `python -m tfmulti.main <your flags> --worker_hosts=localhost:P0,localhost:P1
--task_index=i` on free localhost ports, with the cores shared out (--intra_op_threads).
On a GPU machine each worker gets GPUs of its own (CUDA_VISIBLE_DEVICES and --num_gpus):
--gpus_per_worker of them, by default the GPUs split evenly; --gpus_per_worker=0 keeps the
workers on the CPU.
Output lines are prefixed [worker i]. When a worker fails, the others are given `--grace`
seconds to stop by themselves, then terminated; the exit code is the first failure's.
SIGTERM or Ctrl-C stops every worker (they save a checkpoint: exit code 75), and killing the
launcher kills them.
For a real cluster, run one `python -m tfmulti.main ... --worker_hosts=... --task_index=i`
per host (or let a scheduler set TF_CONFIG): see the README.
"""
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from tfmulti import cli  # first: it imports TensorFlow quietly
from tfmulti.distribution import child, devices
from tfmulti.tuning import parallel_trials
from tfmulti.cli import PREEMPTED_EXIT_CODE
from tfmulti.errors import UsageError

GRACE_SECONDS = 60


def free_ports(count):
    sockets = []
    for _ in range(count):
        s = socket.socket()
        s.bind(("localhost", 0))
        sockets.append(s)
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def worker_shares(workers, gpus_per_worker, available, visible=None, main_args=()):
    """Each worker's (extra flags, environment): its own GPUs, so that no two workers share a
    GPU (NCCL refuses duplicate GPUs in one group, or hangs) and none takes every GPU.

    gpus_per_worker: None splits the `available` GPUs evenly (the CPU when there are none);
    0 hides the GPUs from every worker. visible: CUDA_VISIBLE_DEVICES's ids, when set."""
    if gpus_per_worker is not None and gpus_per_worker < 0:
        raise UsageError(f"--gpus_per_worker={gpus_per_worker}: give 0 (the CPU) or more")
    if gpus_per_worker == 0:
        return [([], {"CUDA_VISIBLE_DEVICES": ""})] * workers
    if gpus_per_worker is None:
        if available == 0:
            return [([], {})] * workers
        if available < workers:
            raise UsageError(f"--workers={workers} on {available} GPU{'s' if available > 1 else ''}"
                             ": each worker needs a GPU of its own; start fewer workers, or "
                             "--gpus_per_worker=0 to run them on the CPU")
        gpus_per_worker = available // workers
    if workers * gpus_per_worker > available:
        raise UsageError(f"--workers={workers} x --gpus_per_worker={gpus_per_worker} needs "
                         f"{workers * gpus_per_worker} GPUs; TensorFlow sees {available}")
    given = [a for a in main_args if a.split("=")[0] in ("--num_gpus", "--cpu_replicas", "--gpus")]
    if given:
        raise UsageError(f"{given[0].split('=')[0]}: the launcher gives each worker its GPUs "
                         "(--gpus_per_worker); leave it out")
    plan = devices.DevicePlan("gpu", workers * gpus_per_worker)
    shares = parallel_trials.device_shares(plan, workers, devices.usable_core_ids(), visible)
    return [(share.flags, share.env) for share in shares]


def worker_commands(workers, main_args, ports, cores=None):
    hosts = ",".join(f"localhost:{p}" for p in ports)
    threads = [] if any(a.startswith("--intra_op_threads") for a in main_args) else [
        f"--intra_op_threads={max(1, (cores or devices.usable_cores()) // workers)}"]
    return [[sys.executable, "-m", "tfmulti.main", *main_args, *threads,
             f"--worker_hosts={hosts}", f"--task_index={i}"] for i in range(workers)]


def _stream(index, process):
    for line in process.stdout:
        print(f"[worker {index}] {line}", end="", flush=True)


def _say(message):
    print(f"[launch] {message}", flush=True)


class _Stop:
    """SIGTERM or Ctrl-C to the launcher: the first asks the workers to stop (they save a
    checkpoint and exit 75), a second Ctrl-C kills them."""

    def __init__(self):
        self.signals = []

    def __call__(self, signum, frame):
        self.signals.append(signum)


def _kill(processes):
    for p in processes:
        if p.poll() is None:
            p.kill()


def _stop(processes, grace, why):
    """SIGTERM to every live worker, then SIGKILL to those still there after `grace` s (a
    worker still forming its group ignores SIGTERM: TensorFlow holds it then)."""
    live = [p for p in processes if p.poll() is None]
    if live:
        _say(f"{why}: stopping {len(live)} worker{'s' if len(live) > 1 else ''} (SIGTERM, "
             f"SIGKILL after {grace:g} s)")
    for p in live:
        p.terminate()
    deadline = time.monotonic() + grace
    while any(p.poll() is None for p in live) and time.monotonic() < deadline:
        time.sleep(0.1)
    _kill(live)


def launch(commands, grace=GRACE_SECONDS, poll=0.2, envs=None):
    """Runs the worker commands (envs: each one's additions to the environment); returns the
    first failure's exit code, or 0.

    Every worker is watched, whichever one ends: when one fails, the others get `grace`
    seconds to stop by themselves (they usually do, within seconds: they lose contact), then
    are stopped. SIGTERM or SIGINT to the launcher stops them all the same way (exit code 75
    when they saved a checkpoint on the way, else 128 + the signal), and if the launcher itself
    is killed, so are they."""
    stop = _Stop()
    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    processes = []
    # Each worker dies with the launcher (cli.run reads the variable), and has a session of
    # its own, so a Ctrl-C on the terminal reaches only the launcher, which stops them in order.
    env = dict(os.environ, **{child.PARENT_VARIABLE: str(os.getpid())})
    try:
        for c, extra in zip(commands, envs or [{}] * len(commands)):
            processes.append(subprocess.Popen(c, stdout=subprocess.PIPE,
                                              stderr=subprocess.STDOUT, text=True,
                                              env=dict(env, **extra), start_new_session=True))
        readers = [threading.Thread(target=_stream, args=(i, p), daemon=True)
                   for i, p in enumerate(processes)]
        for reader in readers:
            reader.start()
        code = _watch(processes, grace, poll, stop)
        for reader in readers:
            reader.join(timeout=5)
        return code
    finally:
        _kill(processes)
        for s, handler in previous.items():
            signal.signal(s, handler)


def _watch(processes, grace, poll, stop):
    failed_at, code = None, 0
    while True:
        codes = [p.poll() for p in processes]  # every worker, every time
        if stop.signals:
            signum = stop.signals[0]
            name = signal.Signals(signum).name
            threading.Thread(target=_kill_on_second_interrupt, args=(processes, stop),
                             daemon=True).start()
            _stop(processes, grace, f"{name} received")
            codes = [p.poll() for p in processes]
            saved = all(c == PREEMPTED_EXIT_CODE for c in codes)
            return PREEMPTED_EXIT_CODE if saved else 128 + signum
        # A worker killed by a signal: 128 + its number, as a shell reports it.
        codes = [128 - c if c is not None and c < 0 else c for c in codes]
        failures = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
        if failures and failed_at is None:
            failed_at = time.monotonic()
            index, code = failures[0]
            _say(f"worker {index} exited with code {code}; the others get {grace:g} s to stop")
        if all(c is not None for c in codes):
            return code or next((c for c in codes if c), 0)
        if failed_at is not None and time.monotonic() - failed_at > grace:
            _stop(processes, min(grace, 10.0), f"still running {grace:g} s after worker "
                  f"{failures[0][0]} failed")
            return code
        time.sleep(poll)


def _kill_on_second_interrupt(processes, stop):
    while any(p.poll() is None for p in processes):
        if len(stop.signals) > 1:
            _say("interrupted again: killing the workers")
            _kill(processes)
            return
        time.sleep(0.1)


def main(*main_args):
    workers = cli.FLAGS.workers
    if workers < 1:
        raise UsageError(f"--workers={workers}: start at least one")
    if any(a.startswith(("--worker_hosts", "--task_index")) for a in main_args):
        raise UsageError("the launcher sets --worker_hosts and --task_index itself")
    if cli.FLAGS.grace < 0:
        raise UsageError(f"--grace={cli.FLAGS.grace:g}: give seconds, 0 or more")
    shares = worker_shares(workers, cli.FLAGS.gpus_per_worker, devices.gpus_available(),
                           parallel_trials.visible_gpus(), main_args)
    commands = worker_commands(workers, list(main_args), free_ports(workers))
    for i, (flags, env) in enumerate(shares):
        commands[i] += flags
        if env.get("CUDA_VISIBLE_DEVICES"):
            _say(f"worker {i}: GPU {env['CUDA_VISIBLE_DEVICES']}")
    code = launch(commands, cli.FLAGS.grace, envs=[env for _, env in shares])
    sys.exit(code)


if __name__ == "__main__":
    cli.run(main, "launch", passthrough=True)
