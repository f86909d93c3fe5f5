"""The per-replica tf.data pipelines, and what a stored image becomes on its way to the model.

The training stream is a pure function of (seed, epoch, step): each epoch is a stateless
permutation of all examples, cut into global batches; input pipeline p (one per worker) takes
its contiguous slice of each global batch and deals it to its replicas as consecutive
per-replica batches. So replicas see distinct examples, an epoch covers the data set (less the
remainder of a global batch), and a run can restart at any step by rebuilding the stream
there: that, not the tf.data iterator (tf.distribute's iterators cannot be checkpointed), is
what a checkpoint needs to hold for the data.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import tensorflow as tf

from tfmulti.data import checks
from tfmulti.data import service as data_service
from tfmulti.data.dataset import example_count
from tfmulti.errors import DataError
from tfmulti.run.plan import eval_steps, steps_per_epoch

if TYPE_CHECKING:
    from collections.abc import Callable

    from tfmulti.data.folder import ImageFiles


UINT8_SCALE = 255.0  # a uint8 image's values divided by it: [0, 1]


def to_model_input(images: tf.Tensor,
                   scale: float | tf.Variable = UINT8_SCALE) -> tf.Tensor:
    """A stored batch as the model takes it: float32 [b, h, w, c], uint8 divided by `scale`
    (255) into [0, 1]. Training, evaluation, the doctor and the exported SavedModel all call
    this. The SavedModel passes its scale as a variable: a graph optimizer would turn a
    division by the constant into a product by its reciprocal, one unit in the last place
    away from what training computed (seen), and a variable is not folded."""
    x = tf.cast(images, tf.float32)
    if images.dtype == tf.uint8:
        x = x / scale
    return x[..., None] if images.shape.rank == 3 else x


def _reader(arrays):
    """idx -> the examples at idx of arrays (an array, or a dict / tuple of them) as stored:
    gathered from memory, or, for a folder's images (folder.ImageFiles) and records in files
    (records.Records), read from their files, so a pipeline reads only its own batches'
    examples."""
    if hasattr(arrays, "gather_batch"):
        return arrays.gather_batch
    if hasattr(arrays, "read_batch"):
        paths = tf.constant(arrays.paths)
        return lambda idx: arrays.read_batch(tf.gather(paths, idx))
    constants = tf.nest.map_structure(tf.constant, arrays)
    return lambda idx: tf.nest.map_structure(lambda a: tf.gather(a, idx), constants)


def _gatherer(arrays, images=False):
    """_reader(arrays), images made model input (to_model_input)."""
    read = _reader(arrays)
    return (lambda idx: to_model_input(read(idx))) if images else read


def _pipeline_layout(input_context, per_replica_batch_size):
    """(global batch, replicas this pipeline feeds, this pipeline's index, pipeline count)."""
    replicas = input_context.num_replicas_in_sync // input_context.num_input_pipelines
    return (per_replica_batch_size * input_context.num_replicas_in_sync, replicas,
            input_context.input_pipeline_id, input_context.num_input_pipelines)


def _my_batches(global_order, steps, layout, per_replica_batch_size):
    """This pipeline's per-replica index batches, [steps * replicas, per_replica_batch]."""
    _, replicas, pipeline_id, pipelines = layout
    order = tf.reshape(global_order, [steps, pipelines, replicas * per_replica_batch_size])
    return tf.reshape(order[:, pipeline_id], [steps * replicas, per_replica_batch_size])


def _finish(dataset):
    """The pipeline's end: batches in order, prefetched, and no tf.data autotuning thread
    (checks.untuned: freeing the iterator at the end of a run, of an evaluation, of a tuning
    trial could wait for it, up to a minute; docs/performance.md)."""
    options = tf.data.Options()
    options.deterministic = True
    return checks.untuned(dataset.prefetch(tf.data.AUTOTUNE).with_options(options))


def train_input_fn(features: np.ndarray | ImageFiles | dict, targets: np.ndarray | dict,
                   per_replica_batch_size: int, seed: int, start_step: int = 0,
                   images: bool = True, service: str = "", job_name: str | None = None,
                   weights: np.ndarray | None = None
                   ) -> Callable[[tf.distribute.InputContext], tf.data.Dataset]:
    """dataset_fn for distribute_datasets_from_function: endless (features, targets)
    batches, each of the structure the data set has (images: made model input); with
    `weights` (float32 [n], each example's: your sample weights, class weights) (features,
    targets, weights) batches, as fit takes them.

    Starts at global step `start_step` (counted from the start of training), so a resumed run
    continues exactly where the checkpoint was taken. service: grpc://HOST:PORT, the batches
    read by the tf.data service's workers instead, each epoch in the order they come
    (service.py; records in TFRecord files streamed, the run's workers sharing the job
    `job_name`): the stored examples cross the network, and become model input here.
    """
    num_examples = example_count(features)

    def dataset_fn(input_context):
        layout = _pipeline_layout(input_context, per_replica_batch_size)
        global_batch, replicas = layout[0], layout[1]
        steps = steps_per_epoch(num_examples, global_batch)
        if steps < 1:
            raise DataError(f"global batch {global_batch} is larger than the {num_examples} "
                            "training examples")
        if service and data_service.streams(features):
            dataset = data_service.served_records(features, _reader(targets),
                                                  per_replica_batch_size, global_batch, seed,
                                                  start_step, service, job_name)
        elif service:
            read, read_targets = _reader(features), _reader(targets)
            dataset = data_service.served(lambda idx: (read(idx), read_targets(idx)), layout,
                                          per_replica_batch_size, steps, num_examples, seed,
                                          start_step, service)
        if service:
            if images:
                dataset = dataset.map(lambda f, t: (to_model_input(f), t),
                                      num_parallel_calls=tf.data.AUTOTUNE)
            return _finish(dataset.apply(
                tf.data.experimental.assert_cardinality(tf.data.INFINITE_CARDINALITY)))
        take = _gatherer(features, images)
        take_targets = _gatherer(targets) if targets is not None else None
        if take_targets is None:  # features alone, as fit(x) gives them with no y
            example = take
        elif weights is None:
            def example(idx):
                return take(idx), take_targets(idx)
        else:
            take_weights = _gatherer(np.asarray(weights, np.float32))

            def example(idx):
                return take(idx), take_targets(idx), take_weights(idx)

        def epoch_batches(epoch):
            order = tf.random.experimental.stateless_shuffle(
                tf.range(num_examples), seed=tf.stack([tf.constant(seed, tf.int64), epoch]))
            batches = _my_batches(order[:steps * global_batch], steps, layout,
                                  per_replica_batch_size)
            return tf.data.Dataset.from_tensor_slices(batches)

        dataset = (tf.data.Dataset.counter(start_step // steps)
                   .flat_map(epoch_batches)
                   .skip((start_step % steps) * replicas)
                   .map(example, num_parallel_calls=tf.data.AUTOTUNE)
                   # Endless, and said so: tf.distribute cannot see it through flat_map, and
                   # across workers it would then agree on "does every worker still have a
                   # batch?" with an all-reduce before every step.
                   .apply(tf.data.experimental.assert_cardinality(tf.data.INFINITE_CARDINALITY)))
        return _finish(dataset)

    return dataset_fn


def eval_input_fn(features: np.ndarray | ImageFiles | dict, targets: np.ndarray | dict,
                  per_replica_batch_size: int, images: bool = True,
                  weights: np.ndarray | None = None
                  ) -> Callable[[tf.distribute.InputContext], tf.data.Dataset]:
    """dataset_fn giving every test example exactly once, as (features, targets, present);
    with `weights` (your sample weights, float32 [n]) (features, targets, present, weights).

    The set is padded to whole global batches; padding is not present (0), so metrics count
    each real example once whatever the batch and replica counts.
    """
    num_examples = example_count(features)

    def dataset_fn(input_context):
        layout = _pipeline_layout(input_context, per_replica_batch_size)
        steps = eval_steps(num_examples, layout[0])
        take = _gatherer(features, images)
        take_targets = _gatherer(targets) if targets is not None else None
        batches = _my_batches(tf.range(steps * layout[0]), steps, layout, per_replica_batch_size)

        take_weights = _gatherer(np.asarray(weights, np.float32)) if weights is not None else None

        def gather(idx):
            real = tf.minimum(idx, num_examples - 1)
            present = tf.cast(idx < num_examples, tf.float32)
            given = (take(real),) if take_targets is None else (take(real), take_targets(real))
            if take_weights is None:
                return (*given, present)
            return (*given, present, take_weights(real))

        return _finish(tf.data.Dataset.from_tensor_slices(batches).map(gather))

    return dataset_fn
