"""Several workers of the main job on this machine: free ports, each worker's share of the
devices and cores, their commands, and the supervisor that runs them (`python -m
tfmulti.launch`; the tool is tfmulti/tools/launch.py).

Each worker is `python -m tfmulti.main <flags> --worker_hosts=localhost:P0,localhost:P1
--task_index=i`. When a worker fails, the others get a grace to stop by themselves, then are
terminated; the exit code is the first failure's. SIGTERM or Ctrl-C stops every worker (they
save a checkpoint: exit code 75), and killing the launcher kills them.
"""
from __future__ import annotations

import dataclasses
import os
import select
import socket
import subprocess
import sys
from typing import TYPE_CHECKING

from tfmulti.distribution import allocator, devices
from tfmulti.errors import PREEMPTED_EXIT_CODE, UsageError
from tfmulti.processes import netns, supervisor

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

GRACE_SECONDS = 60


@dataclasses.dataclass(frozen=True)
class LaunchOptions:
    """The launcher's own settings (its flags)."""
    workers: int = 2
    gpus_per_worker: int | None = None
    grace: float = GRACE_SECONDS
    network: str = "private"
    program: str = "main"
    data_service_workers: int = 0  # a tf.data service for the workers: this many servers


def run(options: LaunchOptions, main_args: Sequence[str]) -> int:
    """Starts options.workers workers of the main job (or its doctor) with main_args and
    supervises them; returns the exit code (launch's)."""
    if options.workers < 1:
        raise UsageError(f"--workers={options.workers}: start at least one")
    if any(a.startswith(("--worker_hosts", "--task_index")) for a in main_args):
        raise UsageError("the launcher sets --worker_hosts and --task_index itself")
    if options.grace < 0:
        raise UsageError(f"--grace={options.grace:g}: give seconds, 0 or more")
    if options.data_service_workers < 0:
        raise UsageError(f"--data_service_workers={options.data_service_workers}: give 0 or "
                         "more")
    if options.data_service_workers and any(a.startswith("--data_service") for a in main_args):
        raise UsageError("--data_service_workers starts the workers' tf.data service and sets "
                         "their --data_service; leave that out")
    allocator.choose(os.environ.get(allocator.SETTING))  # a bad malloc: one line, first
    available = 0 if options.gpus_per_worker == 0 else gpus_seen_quietly()
    shares = worker_shares(options.workers, options.gpus_per_worker, available,
                           devices.visible_gpus(), main_args)
    # The ports are chosen where the workers will listen: in their own network, if they have one
    serving = options.data_service_workers > 0
    line, ports, holder = worker_network(options.network, main_args,
                                         options.workers + serving)
    say(line)
    added = {**(holder.env if holder is not None else {}), **runtime_logging(os.environ)}
    servers = []
    try:
        if serving:  # in the workers' network, on its last port
            port = ports.pop()
            servers = start_data_service(port, options.data_service_workers, added)
            main_args = [*main_args, f"--data_service=localhost:{port}"]
        commands = worker_commands(options.workers, list(main_args), ports,
                                   program=options.program)
        for i, (flags, env) in enumerate(shares):
            commands[i] += flags
            if env.get("CUDA_VISIBLE_DEVICES"):
                say(f"worker {i}: GPU {env['CUDA_VISIBLE_DEVICES']}")
        return launch(commands, options.grace, envs=[{**env, **added} for _, env in shares])
    finally:
        stop_data_service(servers)
        if holder is not None:
            holder.close()


def gpus_seen_quietly():
    """devices.gpus_available(), TensorFlow's start-up lines held (quiet.py) also where the
    user left TF_CPP_MIN_LOG_LEVEL unset: set for the import only, so that it stays unset for
    the workers (runtime_logging)."""
    unset = "TF_CPP_MIN_LOG_LEVEL" not in os.environ
    if unset:
        os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
    try:
        return devices.gpus_available()
    finally:
        if unset:
            del os.environ["TF_CPP_MIN_LOG_LEVEL"]


def runtime_logging(environ: Mapping[str, str]) -> dict[str, str]:
    """What the workers add to their environment for TensorFlow's and gRPC's own logs: none
    of them unless the user set TF_CPP_MIN_LOG_LEVEL. A worker's failure is tfmulti's one
    line; the runtime's logs of it (E0000 ... the task has crashed, a gRPC connection
    refused: several lines from each survivor of a killed worker) say the same at length."""
    if "TF_CPP_MIN_LOG_LEVEL" in environ:
        return {}
    return {"TF_CPP_MIN_LOG_LEVEL": "3", "GRPC_VERBOSITY": environ.get("GRPC_VERBOSITY", "NONE")}


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
    shares = devices.device_shares(plan, workers, devices.usable_core_ids(), visible)
    return [(share.flags, share.env) for share in shares]


def worker_commands(workers, main_args, ports, cores=None, program="main"):
    """Each worker's command: `python -m tfmulti.<program>` (main, or the doctor) with the
    main job's flags, its share of the cores, the cluster of localhost ports, its index."""
    hosts = ",".join(f"localhost:{p}" for p in ports)
    threads = [] if any(a.startswith("--intra_op_threads") for a in main_args) else [
        f"--intra_op_threads={max(1, (cores or devices.usable_cores()) // workers)}"]
    return [[sys.executable, "-m", f"tfmulti.{program}", *main_args, *threads,
             f"--worker_hosts={hosts}", f"--task_index={i}"] for i in range(workers)]


def worker_network(network, main_args, count):
    """(the line that says where the workers' servers can be reached, their ports, a
    netns.Holder or None). "private": a network of their own (netns.py); where they cannot
    have one (a URL among their flags: remote storage needs the machine's network; or the
    kernel refuses), UsageError in one line saying why, nothing started: their servers run
    code for whoever reaches them, so the open network is only taken when asked for
    (--network=host)."""
    if network == "private":
        remote = next((a for a in main_args if "://" in a), None)
        if remote is not None:
            raise UsageError(
                f"{remote.split('=')[0]} is remote storage, which the workers' own network "
                "cannot reach; their servers would listen on every interface and run code "
                "for whoever reaches them: pass --network=host to run them on the machine's "
                "network (with its ports closed to others), or keep the run on local disk")
        holder = netns.Holder(count)
        if holder.ports:
            return ("the workers have a network of their own: their servers are reachable "
                    "only by each other (--network=host for the machine's)", holder.ports,
                    holder)
        raise UsageError(
            f"the workers cannot have a network of their own here ({holder.why}); their "
            "servers would listen on every interface and run code for whoever reaches them: "
            "pass --network=host to run them on the machine's network (with its ports closed "
            "to others)")
    return ("--network=host: the workers' servers listen on every interface and run code for "
            "whoever reaches them", free_ports(count), None)


SERVER_START_SECONDS = 120  # longest wait for a tf.data service server to say it serves


def start_data_service(port, workers, env, timeout=SERVER_START_SECONDS):
    """A tf.data service dispatcher on `port` and `workers` worker servers (python -m
    tfmulti.dataservice, in the environment `env` adds: the workers' network), each waited
    for until it says it serves (at most `timeout` s each; UsageError in one line if not)."""
    servers = []
    # (trusted: the workers' network of their own, or --network=host, asked for by name)
    commands = [["dispatcher", f"--port={port}", "--trusted_network"]] + [
        ["worker", f"--dispatcher=localhost:{port}", "--advertise=localhost",
         "--trusted_network"]] * workers
    try:
        for i, command in enumerate(commands):
            name = "dispatcher" if i == 0 else f"service worker {i - 1}"
            process = subprocess.Popen([sys.executable, "-m", "tfmulti.dataservice", *command],
                                       env=supervisor.child_environment(env),
                                       stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                       text=True)
            servers.append(process)
            ready, _, _ = select.select([process.stdout], [], [], timeout)
            said = process.stdout.readline().strip() if ready else ""
            if "listening" not in said and "serving" not in said:
                raise UsageError(f"the tf.data service's {name} did not start within "
                                 f"{timeout:g} s" + (f" (exit code {process.poll()})"
                                                     if process.poll() is not None else ""))
            say(said)
    except BaseException:
        stop_data_service(servers)
        raise
    return servers


def stop_data_service(servers, timeout=10.0):
    """SIGTERM to each server (each exits at once, code 0), then SIGKILL after `timeout`."""
    for process in servers:
        if process.poll() is None:
            process.terminate()
    for process in servers:
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def say(message):
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
    with supervisor.Supervisor(say, noun="worker", poll=poll) as workers:
        started = [workers.start(f"worker {i}", command, env, prefix=f"[worker {i}] ")
                   for i, (command, env) in enumerate(zip(commands, envs))]
        failed, signum, _ = workers.watch(grace)
        if signum is not None:
            saved = all(w.poll() == PREEMPTED_EXIT_CODE for w in started)
            return PREEMPTED_EXIT_CODE if saved else 128 + signum
        return supervisor.shell_code(failed.poll()) if failed is not None else 0
