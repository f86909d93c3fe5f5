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
import socket
import sys

from tfmulti import cli  # first: it imports TensorFlow quietly
from tfmulti.distribution import devices, supervisor
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


def _say(message):
    print(f"[launch] {message}", flush=True)


def launch(commands, grace=GRACE_SECONDS, poll=supervisor.POLL_SECONDS, envs=None):
    """Runs the worker commands (envs: each one's additions to the environment) under the
    supervisor; returns the first failure's exit code, or 0.

    Every worker is watched, whichever one ends: when one fails, the others get `grace`
    seconds to stop by themselves (they usually do, within seconds: they lose contact), then
    are stopped. SIGTERM or SIGINT to the launcher stops them all the same way (exit code 75
    when they saved a checkpoint on the way, else 128 + the signal), a second one kills them,
    and if the launcher itself is killed, so are they."""
    envs = envs or [{}] * len(commands)
    with supervisor.Supervisor(_say, noun="worker", poll=poll) as workers:
        started = [workers.start(f"worker {i}", command, env, prefix=f"[worker {i}] ")
                   for i, (command, env) in enumerate(zip(commands, envs))]
        failed, signum, _ = workers.watch(grace)
        if signum is not None:
            saved = all(w.poll() == PREEMPTED_EXIT_CODE for w in started)
            return PREEMPTED_EXIT_CODE if saved else 128 + signum
        return supervisor.shell_code(failed.poll()) if failed is not None else 0


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
