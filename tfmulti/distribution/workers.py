"""Several workers (machines or processes) as one MultiWorkerMirroredStrategy: the cluster
from --worker_hosts/--task_index or a scheduler's TF_CONFIG, who is chief, how long to wait
for the others, and what to say when some never come.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import socket
from typing import TYPE_CHECKING, Any

import tensorflow as tf

from tfmulti import quiet, tfprivate
from tfmulti.distribution import slurm
from tfmulti.distribution.startup import WORKER_TIMEOUT
from tfmulti.errors import UsageError

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence


def cluster_config(worker_hosts=None, task_index=0, tf_config=None, environ=None):
    """This worker's TF_CONFIG as a dict, from --worker_hosts/--task_index, an existing
    TF_CONFIG (a scheduler's), or the variables of a Slurm step (srun, slurm.py); None for a
    single-machine run."""
    if worker_hosts:
        hosts = [h.strip() for h in worker_hosts.split(",") if h.strip()]
        for host in hosts:
            name, _, port = host.rpartition(":")
            if not name or not port.isdigit():
                raise UsageError(f"--worker_hosts: {host!r} is not host:port")
            if not 1 <= int(port) <= 65535:
                raise UsageError(f"--worker_hosts: {host!r}: a port is 1 to 65535")
        if not 0 <= task_index < len(hosts):
            raise UsageError(f"--task_index={task_index} is not one of the {len(hosts)} workers "
                             f"(0 to {len(hosts) - 1})")
        return {"cluster": {"worker": hosts}, "task": {"type": "worker", "index": task_index}}
    if tf_config:
        try:
            parsed = json.loads(tf_config)
            workers, task = parsed["cluster"]["worker"], parsed["task"]
            assert task["type"] in ("worker", "chief") and isinstance(task["index"], int)
        except (ValueError, KeyError, TypeError, AssertionError):
            raise UsageError("TF_CONFIG is set but is not a cluster with workers and a task "
                             "(see the TensorFlow multi-worker guide)") from None
        return parsed if len(workers) + len(parsed["cluster"].get("chief", [])) > 1 else None
    return slurm.cluster(os.environ if environ is None else environ)


def is_chief(cluster):
    """The worker that writes reports and the real checkpoints: the chief, or worker 0."""
    if cluster is None:
        return True
    task = cluster["task"]
    return task["type"] == "chief" or ("chief" not in cluster["cluster"] and task["index"] == 0)


def task_place(cluster):
    """(this task's place, the task count) in the cluster, chiefs first: a share of work
    split among the tasks (a folder's files checked before a run); (0, 1) without one."""
    if cluster is None:
        return 0, 1
    jobs, task = cluster["cluster"], cluster["task"]
    chiefs = len(jobs.get("chief", []))
    index = task["index"] if task["type"] == "chief" else chiefs + task["index"]
    return index, chiefs + len(jobs["worker"])


def smallest_across(strategy: tf.distribute.Strategy,
                    place: tuple[int, int]) -> Callable[[int], int]:
    """smallest(value) -> the smallest of every task's int `value`, known to all: one SUM
    all-reduce of a vector with a slot per task (each task's replicas fill its slot with a
    share of value + 1). A collective: every task calls it once, in the same order."""
    index, count = place
    local = strategy.num_replicas_in_sync // count

    def smallest(value):
        slot = tf.one_hot(index, count, dtype=tf.float64) * (value + 1) / local
        summed = strategy.reduce(tf.distribute.ReduceOp.SUM,
                                 strategy.experimental_distribute_values_from_function(
                                     lambda _: tf.identity(slot)), axis=None)
        return int(round(float(tf.reduce_min(summed)))) - 1

    return smallest


def gathered(strategy: tf.distribute.Strategy, numbers: Sequence[int]) -> list[list[int]]:
    """Every worker's `numbers` (whole numbers in 0..2**52, as many on each), in worker order,
    known to all: one SUM all-reduce of a vector with a row per worker, which the first
    replica of each worker fills (float64 holds such numbers exactly). A collective: every
    worker calls it once, in the same order. Works under any strategy (one worker: [numbers])."""
    local = len(strategy.extended.worker_devices)
    count = strategy.num_replicas_in_sync // local
    mine = tf.constant(numbers, tf.float64)

    def value(context):
        replica = context.replica_id_in_sync_group
        row = mine if replica % local == 0 else tf.zeros_like(mine)
        return tf.reshape(tf.one_hot(replica // local, count, dtype=tf.float64)[:, None]
                          * row[None, :], [-1])

    summed = strategy.reduce(tf.distribute.ReduceOp.SUM,
                             strategy.experimental_distribute_values_from_function(value),
                             axis=None)
    rows = summed.numpy().reshape(count, len(numbers))
    return [[int(x) for x in row] for row in rows]


FINGERPRINT_SHIFTS = (48, 32, 16, 0)  # a fingerprint's 64 bits as 4 numbers of 16 bits (exact
# in the float64 all-reduce)


def _sum_over_replicas(strategy: tf.distribute.Strategy, value: Callable[[], Any]) -> Any:
    """The sum over every replica of every worker of `value()` (a float per replica)."""
    return strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(
        lambda: tf.identity(value())), axis=None)


def broadcast_from_chief(strategy: tf.distribute.Strategy, value: int) -> int:
    """The chief's integer `value` on every worker (a collective: all must call it). Only
    the first replica of the chief, global replica 0, contributes."""
    def first_replica_only():
        replica = tf.distribute.get_replica_context().replica_id_in_sync_group
        return tf.where(tf.equal(replica, 0), tf.constant(float(value), tf.float64),
                        tf.constant(0.0, tf.float64))

    return int(tf.function(lambda: _sum_over_replicas(strategy, first_replica_only))().numpy())


class AnyWorker:
    """any_worker(flag): whether `flag` is true on any worker (a collective with several
    workers: all must call it, with their own flag); one worker: flag itself."""

    def __init__(self, strategy: tf.distribute.Strategy):
        self.strategy = strategy
        local = len(strategy.extended.worker_devices)
        self.multi_worker = strategy.num_replicas_in_sync > local
        self._sum = None  # the collective, traced at its first call

    def __call__(self, flag: bool) -> bool:
        if not self.multi_worker:
            return bool(flag)
        if self._sum is None:
            self._sum = tf.function(lambda mine: _sum_over_replicas(self.strategy, lambda: mine))
        return float(self._sum(tf.constant(float(bool(flag)), tf.float64))) > 0


def replica_values(strategy: tf.distribute.Strategy, variable: Any, count: int = 4
                   ) -> list[tuple[str, Any]]:
    """[(device, first values)] of one variable on every local replica: the same copy on
    each."""
    return [(v.device.split("device:")[-1], v.numpy().ravel()[:count])
            for v in strategy.experimental_local_results(variable.value)]


def every_workers_fingerprint(strategy: tf.distribute.Strategy, model: Any) -> list[str]:
    """The weights fingerprint of each worker's model, in worker order (one on one machine):
    metrics.json's weights_fingerprints. A collective with several workers."""
    mine = int(weights_fingerprint(model), 16)
    rows = gathered(strategy, [(mine >> s) & 0xFFFF for s in FINGERPRINT_SHIFTS])
    return [f"{sum(c << s for c, s in zip(row, FINGERPRINT_SHIFTS)):016x}" for row in rows]


def fingerprint_line(prints: Sequence[str]) -> str:
    """What the chief says of its workers' weights."""
    if len(set(prints)) == 1:
        return (f"weights: the same on all {len(prints)} workers (fingerprint {prints[0]}, "
                "in metrics.json)")
    return ("weights DIFFER between the workers (a defect; please report it): fingerprints "
            + ", ".join(f"worker {i}: {p}" for i, p in enumerate(prints)))


def weights_fingerprint(model: Any) -> str:
    """The first 16 hex digits of a SHA-256 of every weight's bytes, in order."""
    digest = hashlib.sha256()
    for weight in model.get_weights():
        digest.update(weight.tobytes())
    return digest.hexdigest()[:16]


def leave_together(strategy: tf.distribute.Strategy) -> None:
    """Wait here until every worker is here (after the chief has written its reports): a
    worker that exits first stops its heartbeats, and the chief's coordination service,
    still writing, reports it as crashed (E0000 ... tasks are unhealthy). Bounded: a worker
    that dies instead is noticed by the service's heartbeat check, an UnavailableError."""
    gathered(strategy, [0])


# A worker that is not the chief adds about this much to its wait for the chief (TensorFlow's
# retry of its first call, measured here: 5 s timeout -> 10.0 s, 20 s -> 25.0 s).
CHIEF_CONNECT_SECONDS = 5.0


class WorkersMissing(UsageError):
    """The workers did not all join within --worker_timeout."""


def _coordination_timeout_ms(worker_timeout, leader):
    """The chief waits worker_timeout; the others ask for CHIEF_CONNECT_SECONDS less, so they
    too stop within worker_timeout (for a worker_timeout of 6 s or more)."""
    seconds = worker_timeout if leader else max(1.0, worker_timeout - CHIEF_CONNECT_SECONDS)
    return int(seconds * 1000)


def configure_group_formation(cluster, worker_timeout):
    """TensorFlow's coordination service, set up as MultiWorkerMirroredStrategy would, but
    with a time limit: all tasks must register within worker_timeout seconds, or the
    strategy's creation fails naming those that did not (without it, a worker that never
    arrives leaves the others waiting for ever). Must run before the runtime starts."""
    hosts = cluster["cluster"]
    leader_job = "chief" if "chief" in hosts else "worker"
    task = cluster["task"]
    leader = task["type"] == leader_job and task["index"] == 0
    tfprivate.join_within({job: len(hosts[job]) for job in ("chief", "worker") if job in hosts},
                          leader_job, leader, _coordination_timeout_ms(worker_timeout, leader))


def missing_workers_message(error_text, cluster, worker_timeout):
    """One line for a group that did not form: who did not answer, and what to check."""
    jobs = cluster["cluster"]
    names = []
    if "timed out task names:" in error_text:  # one task a line, then a blank line
        for line in error_text.split("timed out task names:", 1)[1].strip().splitlines():
            found = re.fullmatch(r"/job:(\w+)/replica:\d+/task:(\d+)", line.strip())
            if not found:
                break
            if found.groups() not in names:
                names.append(found.groups())

    def where(job, index):
        return f"{job} {index} ({jobs[job][int(index)]})"

    if names:
        who = ", ".join(where(job, i) for job, i in names)
        return (f"{who} did not join within --worker_timeout={worker_timeout:g} s; check that "
                "every worker was started with the same --worker_hosts and can reach the others")
    leader_job = "chief" if "chief" in jobs else "worker"
    return (f"the chief, {where(leader_job, 0)}, did not answer within --worker_timeout="
            f"{worker_timeout:g} s; check --worker_hosts and that the chief is running (restart "
            "every worker with the same command)")


def check_multi_worker_plan(plan, worker_timeout):
    """What a worker of several can be given (checked before anything starts)."""
    if plan.kind == "cpu" and plan.count > 1:
        raise UsageError("with several workers each CPU worker is one replica; drop "
                         "--cpu_replicas (or start more workers)")
    if worker_timeout <= 0:
        raise UsageError(f"--worker_timeout={worker_timeout:g}: give the seconds to wait for the "
                         "other workers")


def check_own_port(cluster: Mapping[str, Any]) -> None:
    """UsageError when this worker's port is held by another process. gRPC binds with
    SO_REUSEPORT, so a second TensorFlow server on a taken port would start and share it
    with the first (two jobs talking to each other); this bind, without it, fails instead."""
    task = cluster["task"]
    address = cluster["cluster"][task["type"]][task["index"]]
    port = int(address.rpartition(":")[2])
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is free
        try:
            probe.bind(("", port))
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                raise
            raise UsageError(f"port {port} of this worker ({address}) is taken by another "
                             "process (another job on this machine, or a worker of an earlier "
                             "run still running); free it or give the workers other ports"
                             ) from None


def make_multi_worker_strategy(cluster, plan, worker_timeout=WORKER_TIMEOUT):
    """MultiWorkerMirroredStrategy over every worker's devices: NCCL between GPUs, gRPC ring
    between CPUs. Must be made before TensorFlow starts its runtime. Waits at most
    worker_timeout seconds for the other workers (WorkersMissing names who did not come)."""
    check_multi_worker_plan(plan, worker_timeout)
    check_own_port(cluster)
    os.environ["TF_CONFIG"] = json.dumps(cluster)
    configure_group_formation(cluster, worker_timeout)
    implementation = (tf.distribute.experimental.CommunicationImplementation.NCCL
                      if plan.kind == "gpu" else
                      tf.distribute.experimental.CommunicationImplementation.RING)
    # TensorFlow logs a missing worker at length (several error lines); the one line below
    # says it. Other failures are shown with TensorFlow's lines.
    missing = None
    with quiet.captured_stderr():
        try:
            return tf.distribute.MultiWorkerMirroredStrategy(
                communication_options=tf.distribute.experimental.CommunicationOptions(
                    implementation=implementation))
        except (tf.errors.DeadlineExceededError, tf.errors.UnavailableError) as e:
            missing = missing_workers_message(str(e.message), cluster, worker_timeout)
    raise WorkersMissing(missing)
