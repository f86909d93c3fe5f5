"""Data parallelism from scratch: the book's LeNet, every copy and every sum written out
(`python -m tfmulti.scratch`; the tool is tfmulti/tools/scratch.py).

No tf.distribute: `get_params` puts a copy of the parameters on each device, `split_batch`
deals a minibatch out, each device runs forward and backward on its share, `allreduce` sums the
gradients (the book's naive way, or a ring), and each device updates its own copy with
minibatch SGD. It is what MirroredStrategy does for you, spelled out (book section
"Multi-GPU training from scratch").
"""
from __future__ import annotations

import functools
import sys
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import tensorflow as tf

from tfmulti.data import pipeline
from tfmulti.errors import UsageError
from tfmulti.run.plan import steps_per_epoch

if TYPE_CHECKING:
    from tfmulti.data.dataset import DataSet

# ----------------------------------------------------------------------------- the model

def lenet(X, params):
    """The book's LeNet on parameters [W1, b1, W2, b2, W3, b3, W4, b4] (NHWC, HWIO kernels)."""
    W1, b1, W2, b2, W3, b3, W4, b4 = params
    h1 = tf.nn.relu(tf.nn.conv2d(X, W1, strides=1, padding="VALID") + b1)
    h1 = tf.nn.avg_pool2d(h1, ksize=2, strides=2, padding="VALID")
    h2 = tf.nn.relu(tf.nn.conv2d(h1, W2, strides=1, padding="VALID") + b2)
    h2 = tf.nn.avg_pool2d(h2, ksize=2, strides=2, padding="VALID")
    h2 = tf.reshape(h2, [tf.shape(h2)[0], -1])
    h3 = tf.nn.relu(tf.matmul(h2, W3) + b3)
    return tf.matmul(h3, W4) + b4


def init_params(width=20, seed=0):
    """The book's initial values: Normal(0, 0.01) weights, zero biases, as numpy arrays.

    Taken from the project's Keras LeNet so both hold the very same architecture and weights.
    """
    from tfmulti.models import zoo

    return zoo.lenet(width=width, seed=seed).get_weights()


def loss_sum(labels, logits):
    """Summed, not averaged: the update divides by the global batch (the book's sgd)."""
    return tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits))


# ----------------------------------------------------------------------------- the parts

def get_params(params, device):
    """A copy of every parameter on `device`, as variables the device updates itself."""
    with tf.device(device):
        return [tf.Variable(p, name=f"param{i}") for i, p in enumerate(params)]


def split_batch(X, y, devices, weights=None):
    """Splits a minibatch over the devices: lists of shards, each copied to its device.

    With a remainder the first (n mod k) devices take one example more. That uneven split
    needs no correction: each device sums its examples' losses and the update divides the
    all-reduced sum by the global batch, so the gradient is still the global mean.
    """
    n, k = int(X.shape[0]), len(devices)
    sizes = [n // k + (i < n % k) for i in range(k)]
    parts = [tf.split(t, sizes) for t in (X, y) + (() if weights is None else (weights,))]
    shards = []
    for part in parts:
        placed = []
        for device, shard in zip(devices, part):
            with tf.device(device):
                placed.append(tf.identity(shard))
        shards.append(placed)
    return tuple(shards)


def copy_to(tensor, device):
    with tf.device(device):
        return tf.identity(tensor)


def allreduce_naive(data, devices):
    """The book's allreduce: add everything onto the first device, copy the sum back out."""
    total = data[0]
    for i in range(1, len(data)):
        with tf.device(devices[0]):
            total = total + copy_to(data[i], devices[0])
    return [total] + [copy_to(total, device) for device in devices[1:]]


def allreduce_ring(data, devices):
    """Ring allreduce: reduce-scatter, then all-gather, over k chunks of each tensor.

    In each of the 2(k-1) steps every device sends one chunk (1/k of the tensor) to its
    neighbour, so no device ever sends or receives more than 2(k-1)/k of the tensor, whatever
    k is; the naive version pushes (k-1) whole tensors through the first device.
    """
    k = len(devices)
    if k == 1:
        return list(data)
    shape, size = data[0].shape, int(tf.size(data[0]))
    padded = -(-size // k) * k
    chunks = []
    for device, tensor in zip(devices, data):
        with tf.device(device):
            flat = tf.pad(tf.reshape(tensor, [-1]), [[0, padded - size]])
            chunks.append(tf.split(flat, k))
    # Reduce-scatter: at step s device i passes chunk (i - s) mod k on to device i + 1, which
    # adds its own. Afterwards device i holds the whole sum of chunk (i + 1) mod k.
    for step in range(k - 1):
        sent = [((i - step) % k, chunks[i][(i - step) % k]) for i in range(k)]
        for i, (c, value) in enumerate(sent):
            j = (i + 1) % k
            with tf.device(devices[j]):
                chunks[j][c] = chunks[j][c] + copy_to(value, devices[j])
    # All-gather: at step s device i passes its finished chunk (i + 1 - s) mod k on; the
    # receiver keeps the copy, so every device ends with the same bits.
    for step in range(k - 1):
        sent = [((i + 1 - step) % k, chunks[i][(i + 1 - step) % k]) for i in range(k)]
        for i, (c, value) in enumerate(sent):
            j = (i + 1) % k
            chunks[j][c] = copy_to(value, devices[j])
    out = []
    for device, parts in zip(devices, chunks):
        with tf.device(device):
            out.append(tf.reshape(tf.concat(parts, 0)[:size], shape))
    return out


ALLREDUCE = {"naive": allreduce_naive, "ring": allreduce_ring}


def train_batch(X, y, device_params, devices, lr, allreduce=allreduce_naive):
    """One step of minibatch SGD on all devices; returns (loss sum, correct) of the batch."""
    X_shards, y_shards = split_batch(X, y, devices)
    losses, corrects, grads = [], [], []
    for X_shard, y_shard, params, device in zip(X_shards, y_shards, device_params, devices):
        with tf.device(device):  # forward and backward separately on each device
            with tf.GradientTape() as tape:
                logits = lenet(X_shard, params)
                loss = loss_sum(y_shard, logits)
            grads.append(tape.gradient(loss, params))
            losses.append(loss)
            corrects.append(tf.reduce_sum(tf.cast(
                tf.argmax(logits, 1, output_type=y_shard.dtype) == y_shard, tf.float32)))
    batch_size = tf.cast(tf.shape(X)[0], tf.float32)
    for i in range(len(device_params[0])):  # sum each gradient over the devices
        reduced = allreduce([g[i] for g in grads], devices)
        for params, grad, device in zip(device_params, reduced, devices):
            with tf.device(device):  # each device updates its own copy
                params[i].assign_sub(lr * grad / batch_size)  # the global batch: the mean
    with tf.device(devices[0]):
        return tf.add_n([copy_to(shard_loss, devices[0]) for shard_loss in losses]), tf.add_n(
            [copy_to(c, devices[0]) for c in corrects])


def evaluate_batch(X, y, weights, device_params, devices):
    """(correct, loss sum, examples) of one evaluation batch, computed on all devices (the
    book's exercise 4); padding examples have weight 0."""
    shards = split_batch(X, y, devices, weights)
    results = []
    for X_shard, y_shard, w_shard, params, device in zip(*shards, device_params, devices):
        with tf.device(device):
            logits = lenet(X_shard, params)
            right = tf.cast(tf.argmax(logits, 1, output_type=y_shard.dtype) == y_shard, tf.float32)
            per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(y_shard, logits)
            results.append(tf.stack([tf.reduce_sum(right * w_shard),
                                     tf.reduce_sum(per_example * w_shard),
                                     tf.reduce_sum(w_shard)]))
    with tf.device(devices[0]):
        return tf.add_n([copy_to(r, devices[0]) for r in results])


# ----------------------------------------------------------------------------- the loop

def train(dataset: DataSet, devices: list[str], global_batch_size: int, lr: float, epochs: int,
          allreduce: str = "naive", width: int = 20, seed: int = 0,
          model_dir: str | None = None, verbose: int = 1,
          run_info: dict[str, Any] | None = None
          ) -> tuple[str, list[dict[str, Any]], list[list[tf.Variable]]]:
    """The book's train(): returns (its line, history); writes the report to model_dir."""
    from tfmulti.rundir import report

    steps = steps_per_epoch(len(dataset.train_features), global_batch_size)
    if steps < 1:
        raise UsageError(f"global batch {global_batch_size} is larger than the "
                         f"{len(dataset.train_features)} training examples")
    if global_batch_size < len(devices):
        raise UsageError(f"global batch {global_batch_size} leaves devices without examples; "
                         f"use at least {len(devices)}")
    context = tf.distribute.InputContext()  # one pipeline, whole global batches
    train_data = pipeline.train_input_fn(dataset.train_features, dataset.train_targets,
                                     global_batch_size, seed)(context)
    test_data = pipeline.eval_input_fn(dataset.test_features, dataset.test_targets,
                                   global_batch_size)(context)
    params = init_params(width, seed)
    device_params = [get_params(params, device) for device in devices]
    step = tf.function(functools.partial(train_batch, device_params=device_params,
                                         devices=devices, lr=lr, allreduce=ALLREDUCE[allreduce]))
    evaluate = tf.function(functools.partial(evaluate_batch, device_params=device_params,
                                             devices=devices))
    names = [d.lstrip("/") for d in devices]
    info = {"model": "lenet (from scratch)", "width": width, "allreduce": allreduce,
            "dataset": dataset.display_name, "dataset_source": dataset.source,
            "train_examples": len(dataset.train_features),
            "test_examples": len(dataset.test_features), "devices": names,
            "replicas": len(devices), "global_batch_size": global_batch_size,
            "learning_rate": lr, "steps_per_epoch": steps, "versions": report.versions(),
            **(run_info or {})}
    run = report.RunReport(model_dir, info, write_files=model_dir is not None)
    if verbose:
        print(f"Training LeNet from scratch on {dataset.display_name} on [{', '.join(names)}]: "
              f"batch {global_batch_size}, learning rate {lr:g}, {allreduce} allreduce")
    iterator = iter(train_data)
    for epoch in range(epochs):
        bar = _progress_bar(steps, verbose)
        start, loss, correct = time.perf_counter(), 0.0, 0.0
        for i in range(steps):
            batch_loss, batch_correct = step(*next(iterator))
            # Reading the results waits for the step, like the book's npx.waitall().
            loss, correct = loss + float(batch_loss), correct + float(batch_correct)
            seen = (i + 1) * global_batch_size
            if bar:
                bar.update(i + 1, [("loss", loss / seen), ("accuracy", correct / seen)])
        seconds = time.perf_counter() - start
        start = time.perf_counter()
        totals = np.sum([evaluate(*batch).numpy() for batch in test_data], axis=0).tolist()
        record = {"epoch": epoch + 1, "step": (epoch + 1) * steps, "loss": loss / seen,
                  "train_acc": correct / seen, "test_acc": totals[0] / totals[2],
                  "test_loss": totals[1] / totals[2], "test_examples": int(totals[2]),
                  "seconds": seconds, "eval_seconds": time.perf_counter() - start,
                  "images_per_sec": seen / seconds, "learning_rate": lr}
        if verbose:
            print(f"  test acc {record['test_acc']:.4f} ({record['test_examples']} images), "
                  f"{seconds:.1f} s, {record['images_per_sec']:.0f} images/s")
        run.on_epoch_end(record)
    return run.finish(None), run.history, device_params


def _progress_bar(steps, verbose):
    import keras

    if not verbose:
        return None
    return keras.utils.Progbar(steps, verbose=1 if sys.stdout.isatty() else 2,
                               stateful_metrics=["loss", "accuracy"])
