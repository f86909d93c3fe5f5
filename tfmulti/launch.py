"""Starts N workers of the main job on this machine and streams their output.

    python -m tfmulti.launch --workers=2 -- --dataset=synthetic --width=16 --epochs=2

Each worker is `python -m tfmulti.main <your flags> --worker_hosts=localhost:P0,localhost:P1
--task_index=i` on free localhost ports, with the cores shared out (--intra_op_threads).
Output lines are prefixed [worker i]. When a worker fails, the others are given `--grace`
seconds to stop by themselves, then terminated; the exit code is the first failure's.
For a real cluster, run one `python -m tfmulti.main ... --worker_hosts=... --task_index=i`
per host (or let a scheduler set TF_CONFIG): see the README.
"""
import os
import socket
import subprocess
import sys
import threading
import time

from tfmulti import cli  # first: it imports TensorFlow quietly
from tfmulti import devices
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


def worker_commands(workers, main_args, ports, cores=None):
    hosts = ",".join(f"localhost:{p}" for p in ports)
    threads = [] if any(a.startswith("--intra_op_threads") for a in main_args) else [
        f"--intra_op_threads={max(1, (cores or devices.usable_cores()) // workers)}"]
    return [[sys.executable, "-m", "tfmulti.main", *main_args, *threads,
             f"--worker_hosts={hosts}", f"--task_index={i}"] for i in range(workers)]


def _stream(index, process):
    for line in process.stdout:
        print(f"[worker {index}] {line}", end="", flush=True)


def launch(commands, grace=GRACE_SECONDS):
    """Runs the worker commands; returns the first non-zero exit code, or 0."""
    processes = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for c in commands]
    readers = [threading.Thread(target=_stream, args=(i, p), daemon=True)
               for i, p in enumerate(processes)]
    for reader in readers:
        reader.start()
    failed_at, code = None, 0
    try:
        while any(p.poll() is None for p in processes):
            failures = [p.returncode for p in processes if p.returncode not in (None, 0)]
            if failures and failed_at is None:
                failed_at, code = time.monotonic(), failures[0]
                print(f"[launch] a worker exited with code {code}; the others get {grace} s",
                      flush=True)
            if failed_at is not None and time.monotonic() - failed_at > grace:
                for p in processes:
                    if p.poll() is None:
                        p.terminate()
                break
            time.sleep(0.2)
    except KeyboardInterrupt:
        for p in processes:
            p.terminate()
        code = 130
    for p in processes:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
    for reader in readers:
        reader.join(timeout=5)
    return code or next((p.returncode for p in processes if p.returncode), 0)


def main(*main_args):
    workers = cli.FLAGS.workers
    if workers < 1:
        raise UsageError(f"--workers={workers}: start at least one")
    if any(a.startswith(("--worker_hosts", "--task_index")) for a in main_args):
        raise UsageError("the launcher sets --worker_hosts and --task_index itself")
    code = launch(worker_commands(workers, list(main_args), free_ports(workers)))
    sys.exit(code)


if __name__ == "__main__":
    cli.run(main, passthrough=True)
