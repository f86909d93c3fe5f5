"""The few parts of TensorFlow's private API tfmulti uses, in one place, each with why.

TensorFlow does not promise these across versions; each is here so that a TensorFlow that
moves one breaks one function, found by the tests that use it (named below):

- the coordination service (`tensorflow.python.eager.context`): MultiWorkerMirroredStrategy
  starts it without a time limit, so a worker that never comes leaves the others waiting for
  ever (`join_within`, tests/test_multiworker.py); its key-value store is how workers agree
  that XLA failed to compile on all of them (`tell_workers`, `heard_from_every_worker`,
  tests/test_xla.py); and `stop_every_worker` ends every worker's collectives with one error.
- whether op determinism is on (`tensorflow.python.framework.config`): tf.timestamp is
  refused then, and the step's clock must take another way (accounting/timing.py).
- Slurm's host lists (`tensorflow.python.distribute.cluster_resolver`): TensorFlow's own
  reading of `SLURM_STEP_NODELIST`, as its SlurmClusterResolver reads it (slurm.py).
- the datasets tf.distribute makes for each device (`multi_device_iterator_ops`): they take
  tf.data's default options, autotuning on, and freeing an iterator with autotuning can
  wait up to a minute for its tuning thread (`no_autotuning_on_devices`,
  tests/test_engine.py).
- glibc's mmap threshold, which tf.data sets to 128 KB once per process when the first
  generator dataset's iterator runs (its log line "Memory patch applied: M_TRIM_THRESHOLD=128
  kb" names the other threshold; the call sets M_MMAP_THRESHOLD): `settle_tf_data_malloc`
  runs one first, so that a threshold set after it stays (distribution/allocator.py,
  tests/test_allocator.py).
- colocation (`tensorflow.python.framework.ops`): the public `tf.compat.v1.colocate_with`
  prints a deprecation warning in every run; the one tf.distribute uses does not
  (`colocated_with`, accounting/timing.py, tests/test_timing.py).

Imports are inside the functions: importing tfmulti never imports TensorFlow by itself.
"""
from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import tensorflow as tf


def join_within(jobs: dict, leader_job: str, leader: bool, timeout_ms: int) -> None:
    """Configures the coordination service as MultiWorkerMirroredStrategy would, with a time
    limit: every task of `jobs` ({job: task count}) registers within timeout_ms, or the
    strategy's creation fails naming those that did not. Before the runtime starts."""
    from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2
    from tensorflow.python.eager import context

    coordinated = [coordination_config_pb2.CoordinatedJob(name=job, num_tasks=count)
                   for job, count in jobs.items()]
    context.context().configure_coordination_service(
        service_type="standalone", service_leader=f"/job:{leader_job}/replica:0/task:0",
        cluster_register_timeout_in_ms=timeout_ms, coordinated_jobs=coordinated)
    # All tasks wait at a barrier at start-up; the timeout above bounds it.
    context.context().coordination_service.cluster_register_with_barrier = True


def tell_workers(key: str, value: str) -> None:
    """Puts key = value in the coordination service's store, for every worker to read."""
    from tensorflow.python.eager import context

    context.context().set_config_key_value(key, value)


def heard_from_every_worker(keys: list[str], wait_s: float) -> bool:
    """Whether every key of `keys` is in the coordination service's store within wait_s
    seconds (each read waits for its key until the deadline)."""
    import tensorflow as tf
    from tensorflow.python.eager import context

    ctx = context.context()
    deadline = time.monotonic() + wait_s
    try:
        for key in keys:
            ctx.get_config_key_value(key, max(1, int((deadline - time.monotonic()) * 1000)))
    except tf.errors.OpError:  # not said within the time, or the service is gone
        return False
    return True


def stop_every_worker(code: int, message: str) -> None:
    """Ends every worker's collectives with this error (the coordination service's); a
    service already gone is no reason to fail: the worker stops anyway."""
    from tensorflow.python.eager import context

    try:
        context.context().report_error_to_cluster(code, message)
    except Exception:  # noqa: BLE001 -- the worker stops anyway; the launcher stops the rest
        pass


def onednn_on() -> bool:
    """Whether TensorFlow runs oneDNN's CPU kernels in this process (decided as it loaded,
    from TF_ENABLE_ONEDNN_OPTS or the CPU; no public API says)."""
    from tensorflow.python.util import _pywrap_util_port

    return bool(_pywrap_util_port.IsMklEnabled())


def op_determinism_on() -> bool:
    """Whether tf.config.experimental.enable_op_determinism() is in force (tf.config has no
    public getter)."""
    from tensorflow.python.framework import config as tf_config

    return tf_config.is_op_determinism_enabled()


def slurm_hosts(nodelist: str, tasks_per_node: str) -> tuple[list[str], list[int]]:
    """(nodes, tasks per node) of Slurm's compressed lists (`node[1-3,5]`, `2(x3),1`), read
    by TensorFlow's own parser; ValueError for a list it cannot read."""
    from tensorflow.python.distribute.cluster_resolver.slurm_cluster_resolver import (
        expand_hostlist,
        expand_tasks_per_node,
    )

    return expand_hostlist(nodelist), expand_tasks_per_node(tasks_per_node)


def colocated_with(tensor: tf.Tensor) -> contextlib.AbstractContextManager[None]:
    """A context in which new ops are placed with the op that made `tensor` (a traced
    tensor names no device, so tf.device cannot say where it is)."""
    from tensorflow.python.framework import ops

    return ops.colocate_with(tensor)


def no_autotuning_on_devices() -> None:
    """Every dataset tf.distribute makes for a device (a MultiDeviceIterator's, one per
    replica) runs without tf.data's autotuning from now on in this process.

    tf.distribute builds them with default options, so each runs tf.data's autotuning
    thread, and freeing the iterator (at the end of training, of every evaluation, of every
    tuning trial) waits for that thread whenever its wake-up loses a race with the
    cancellation (Model::OptimizeLoop reads IsCancelled() before the cancellation manager
    sets it): it then sleeps out its optimization period, which doubles while the iterator
    lives, up to a minute. These datasets only hand on batches. Idempotent."""
    import tensorflow as tf
    from tensorflow.python.data.ops import multi_device_iterator_ops as devices

    made = devices._create_device_dataset
    if getattr(made, "without_autotuning", False):
        return
    options = tf.data.Options()
    options.autotune.enabled = False

    def create_device_dataset(*args, **kwargs):
        return made(*args, **kwargs).with_options(options)

    create_device_dataset.without_autotuning = True
    devices._create_device_dataset = create_device_dataset


def settle_tf_data_malloc() -> None:
    """Makes tf.data set glibc's mmap threshold now, as it does once per process when the
    first generator dataset's iterator runs (later in a run: the iterator of a distributed
    dataset on several devices): one element of a one-element generator dataset, without
    autotuning (whose thread freeing the iterator could wait for)."""
    import tensorflow as tf

    options = tf.data.Options()
    options.autotune.enabled = False
    one = tf.data.Dataset.from_generator(lambda: iter([0]),
                                         output_signature=tf.TensorSpec((), tf.int32))
    next(iter(one.with_options(options)))
