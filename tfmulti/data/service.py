"""The tf.data service (--data_service=HOST:PORT): the training batches read and decoded by a
dispatcher's workers, on other machines, for input-bound jobs.

Each training worker's input pipeline is registered with the dispatcher as a job of its own
with dynamic sharding: the dispatcher hands its service workers the numbers of the
per-replica batches, one at a time; a service worker turns a number into its examples (which
epoch, which place in it: a stateless permutation of the examples per epoch, computed for
those examples only, tf.random.experimental.index_shuffle), reads and decodes them where the
training worker would have, and sends the batch. So each epoch gives each example at most
once, in an order the service decides (whichever service worker is ready first): a run with
the service is not the bit-for-bit run without it, and its resume is not exact (it continues
at the checkpoint's step and epoch; the batches in flight when it stopped may be seen again
or not at all). A service worker that dies loses the batches it was making; the others go
on. The service workers must reach the data where the training workers would (the same
paths: a shared file system or bucket).

What the service cannot tell the training worker is that it stopped serving (a dispatcher or
every service worker gone): a step then waits for its batch forever. The run's watchdog
bounds that wait (processes/watchdog.py).

The servers: `python -m tfmulti.dataservice dispatcher|worker` (tools/dataservice.py).
"""
from __future__ import annotations

import hashlib
import json
import os
import socket
from typing import TYPE_CHECKING

import numpy as np
import tensorflow as tf

from tfmulti.errors import UsageError
from tfmulti.run.config import host_port

if TYPE_CHECKING:
    from tfmulti.data.dataset import DataSet

GUARANTEE = ("each example at most once an epoch, in the service's order; a resume "
             "continues at its step, not bit for bit")
STREAMED = ("each record at most once a pass over its files, in the service's order; a "
            "resume reads the pass it stopped in again from its start, not bit for bit")
FILES_AT_ONCE = 4  # TFRecord files a service worker reads at once (their records interleaved)
SHUFFLE_RECORDS = 1024  # serialized records a service worker shuffles among
LAST_BATCH = 2 ** 62  # the numbered batches never end before the run does


def streams(features: object) -> bool:
    """Whether the service streams these training features' files (TFRecord records) rather
    than reading examples by index."""
    return getattr(getattr(features, "files", None), "kind", "") == "tfrecord"


def guarantee(features: object) -> str:
    """What a run through the service keeps of its data's order and resume."""
    return STREAMED if streams(features) else GUARANTEE


def check_servable(dataset: DataSet) -> None:
    """UsageError in one line for training data the service's workers cannot read: records
    in ArrayRecord files (a tfds set prepared so) are read through Python, which a dataset
    sent to the service cannot hold; TFRecord files are streamed (served_records)."""
    if hasattr(dataset.train_features, "gather_batch") and not streams(dataset.train_features):
        raise UsageError(f"--data_service with --dataset={dataset.name}: its records are in "
                         "ArrayRecord files, which only Python reads and the tf.data "
                         "service's workers cannot; prepare the set as TFRecord "
                         "(tensorflow-datasets: file_format='tfrecord'), or train without the "
                         "service")


def check_reachable(service: str, timeout: float = 10.0) -> None:
    """UsageError in one line unless the dispatcher at grpc://HOST:PORT takes a connection
    within `timeout` seconds."""
    host, port = host_port(service).rsplit(":", 1)
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as e:
        raise UsageError(f"--data_service={host}:{port}: no tf.data service dispatcher answers "
                         f"there ({e.strerror or e}); start one with python -m "
                         f"tfmulti.dataservice dispatcher --port={port}") from None


def examples_of_batch(number, layout, per_replica_batch_size, steps, num_examples, seed):
    """The example indices of this pipeline's per-replica batch `number` (counted from the
    start of training: step number // replicas, replica number % replicas): its step's epoch
    shuffled statelessly (index_shuffle), so any batch is made without the others."""
    global_batch, replicas, pipeline_id, _ = layout
    step, replica = number // replicas, number % replicas
    epoch, place = step // steps, step % steps
    first = (place * global_batch + (pipeline_id * replicas + replica) * per_replica_batch_size)
    slots = first + tf.range(per_replica_batch_size, dtype=tf.int64)
    key = tf.stack([tf.constant(seed, tf.int64), epoch])
    return tf.random.experimental.index_shuffle(slots, key, tf.constant(num_examples - 1,
                                                                        tf.int64))


def served(read_batch, layout, per_replica_batch_size, steps, num_examples, seed, start_step,
           service):
    """The endless (features, targets) batches of one pipeline through the service at
    `service` (grpc://HOST:PORT), from global step start_step: the batch numbers are dealt
    to the service workers (dynamic sharding), which read them (read_batch(indices)); an
    anonymous job, the pipeline's own."""
    replicas = layout[1]
    numbers = tf.data.Dataset.range(start_step * replicas, LAST_BATCH)
    made = numbers.map(lambda n: read_batch(examples_of_batch(
        n, layout, per_replica_batch_size, steps, num_examples, seed)),
        num_parallel_calls=tf.data.AUTOTUNE)
    return made.apply(tf.data.experimental.service.distribute(
        processing_mode=tf.data.experimental.service.ShardingPolicy.DYNAMIC, service=service))


def passes_of_records(files, seed: int, first: int) -> tf.data.Dataset:
    """(pass, index in the split, serialized record) of the records of `files` (a split's
    records.RecordFiles in TFRecord files), pass after pass from pass `first`, endless: each
    number n of Dataset.range is file n % files of pass n // files (each pass the files in a
    stateless order of its own: index_shuffle), and becomes that file's records of the
    split, read from its start to its last one; up to FILES_AT_ONCE files at once, never
    more than a pass has. The numbers are what the service deals to its workers (dynamic
    sharding), one at a time."""
    count = len(files.paths)
    order = np.lexsort((files.ordinals, files.file_of))  # by file, then place in it
    bounds = tf.constant(np.searchsorted(files.file_of[order], np.arange(count + 1)), tf.int64)
    ordinals = tf.constant(files.ordinals[order], tf.int64)
    indices = tf.constant(order, tf.int64)
    paths = tf.constant([os.path.abspath(p) for p in files.paths])

    def records_of(number):
        of_pass = number // count
        key = tf.stack([tf.constant(seed, tf.int64), of_pass])
        file = tf.random.experimental.index_shuffle(number % count, key,
                                                    tf.constant(count - 1, tf.int64))
        wanted = ordinals[bounds[file]:bounds[file + 1]]  # ascending
        mine = indices[bounds[file]:bounds[file + 1]]
        last = tf.concat([[-1], wanted], 0)[-1]

        def place(ordinal):
            return tf.minimum(tf.searchsorted(wanted, [ordinal])[0], tf.size(wanted) - 1)

        return (tf.data.TFRecordDataset(paths[file]).enumerate().take(last + 1)
                .filter(lambda k, _: wanted[place(k)] == k)  # not empty: taken
                .map(lambda k, serialized: (of_pass, mine[place(k)], serialized)))

    return tf.data.Dataset.range(first * count, LAST_BATCH).interleave(
        records_of, cycle_length=min(FILES_AT_ONCE, count), num_parallel_calls=tf.data.AUTOTUNE,
        deterministic=False)


def served_records(records, read_targets, per_replica_batch_size, global_batch, seed,
                   start_step, service, job_name=None):
    """The endless (features, targets) per-replica batches of records in TFRecord files
    (records.Records) through the service at `service`. No TensorFlow op reads a record at
    an offset (TFRecordDatasetV2's byte_offsets is lost when its dataset is serialized, and
    FixedLengthRecordDataset reads its way to the offset), so the service streams the files
    (passes_of_records): a service worker reads FILES_AT_ONCE of them at once, shuffles their
    records among SHUFFLE_RECORDS, decodes them and batches them. The training workers of one
    run share one job (job_name: the same for all; None when alone), so each record comes
    once a pass to one of them. From start_step: the pass it falls in, from its start."""
    first = start_step * global_batch // len(records.files)
    made = (passes_of_records(records.files, seed, first)
            .shuffle(SHUFFLE_RECORDS, seed=seed)
            .map(lambda _, index, serialized: (records.decode(serialized),
                                               read_targets(index)),
                 num_parallel_calls=tf.data.AUTOTUNE, deterministic=False)
            .batch(per_replica_batch_size, drop_remainder=True))
    return made.apply(tf.data.experimental.service.distribute(
        processing_mode=tf.data.experimental.service.ShardingPolicy.DYNAMIC, service=service,
        job_name=job_name))


def shared_job(cluster: dict | None, model_dir: str | None, start_step: int) -> str | None:
    """The job name the training workers of one run agree on (their cluster, the run's
    folder as given, the step they start from); None for one worker (an anonymous job)."""
    if not cluster or sum(len(tasks) for tasks in cluster.values()) < 2:
        return None
    said = json.dumps([cluster, str(model_dir), start_step], sort_keys=True)
    return f"tfmulti-{hashlib.sha256(said.encode()).hexdigest()[:16]}"
