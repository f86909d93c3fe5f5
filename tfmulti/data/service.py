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
every service worker gone): a step then waits for its batch forever. `Watchdog` bounds that
wait: no call of steps finished for --worker_timeout seconds past three times the longest
call so far, the
run stops with one line (exit code STALLED_EXIT_CODE); its last checkpoint stays, and the same
command resumes from it.

The servers: `python -m tfmulti.dataservice dispatcher|worker` (tools/dataservice.py).
"""
from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import time
from typing import TYPE_CHECKING

import tensorflow as tf

from tfmulti.errors import UsageError

if TYPE_CHECKING:
    from tfmulti.data.dataset import DataSet

STALLED_EXIT_CODE = 3  # no batch came from the service within the bound
GUARANTEE = ("each example at most once an epoch, in the service's order; a resume "
             "continues at its step, not bit for bit")
LAST_BATCH = 2 ** 62  # the numbered batches never end before the run does
FIRST_CALL = 2  # the first call (tracing, compiling) may take this many --worker_timeout


def check_servable(dataset: DataSet) -> None:
    """UsageError in one line for training data the service's workers cannot read: records
    read by index (tfds:, tfrecord:) go through Python (tf.numpy_function), which a dataset
    sent to the service cannot hold."""
    if hasattr(dataset.train_features, "gather_batch"):
        raise UsageError(f"--data_service with --dataset={dataset.name}: its records are read "
                         "by index through Python, which the tf.data service's workers cannot "
                         "run; the service serves folder: images and data made in memory")


def check_reachable(service: str, timeout: float = 10.0) -> None:
    """UsageError in one line unless the dispatcher at grpc://HOST:PORT takes a connection
    within `timeout` seconds."""
    host, port = service.removeprefix("grpc://").rsplit(":", 1)
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


class Watchdog:
    """Stops the process with one line when no training call ends for `limit` seconds past
    three times the longest call so far (FIRST_CALL times `limit` for the first, which traces
    and compiles): the tf.data service stopped serving. tick() after every call (and after
    an epoch's evaluation); stop() at the end. exit: what stops the process (os._exit: the
    main thread is blocked in the step, and its checkpoints are on disk)."""

    def __init__(self, limit: float, service: str, exit=os._exit, checked_every: float = 1.0):
        self.limit, self.service, self._exit = limit, service, exit
        self._last = time.monotonic()  # when the last call ended (or the watch started)
        self._longest = None  # the longest gap between calls after the first (None: first)
        self._steps = 0
        self._paused = 0  # > 0: a checkpoint is being written, never cut
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, args=(checked_every,),
                                        name="data-service-watchdog", daemon=True)
        self._thread.start()

    def tick(self, steps: int):
        now = time.monotonic()
        self._longest = 0.0 if self._longest is None else max(self._longest, now - self._last)
        self._last, self._steps = now, steps

    @contextlib.contextmanager
    def paused(self):
        """Not stopping the process within the block (a checkpoint being written); the wait
        counts again from its end."""
        self._paused += 1
        try:
            yield
        finally:
            self._last = time.monotonic()
            self._paused -= 1

    def bound(self) -> float:
        if self._longest is None:
            return FIRST_CALL * self.limit
        return self.limit + 3 * self._longest

    def _watch(self, every):
        while not self._done.wait(every):
            if not self._paused and time.monotonic() - self._last > self.bound():
                where = self.service.removeprefix("grpc://")
                print(f"tfmulti: error: no batch from the tf.data service at {where} for "
                      f"{self.bound():.0f} s after step {self._steps} (--worker_timeout="
                      f"{self.limit:g}); is its dispatcher up, with workers? The run stops; "
                      "its last checkpoint stays, and the same command resumes from it",
                      file=sys.stderr, flush=True)
                self._done.set()
                self._exit(STALLED_EXIT_CODE)

    def stop(self):
        self._done.set()
