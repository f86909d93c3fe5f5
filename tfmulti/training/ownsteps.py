"""A model's own train_step / test_step (or compute_loss, ...) run by the engine as model.fit
runs them (models/ownstep.py has the steps themselves): Keras's state for them built once,
the names of the logs they return, the last training logs, and the evaluation with the
model's own test_step, every example weighed once.
"""
import keras
import numpy as np
import tensorflow as tf

from tfmulti.accounting import timing
from tfmulti.models import ownstep, usermodel


class OwnSteps:
    """The engine's part for a model's own steps: `strategy` and `model` the engine's;
    targetless: the data has no targets (the task's); epoch_metrics
    (epoch_metrics.EpochMetrics) placed once the metrics' state is built; worker_index: this
    worker's."""

    def __init__(self, strategy, model, targetless, epoch_metrics, worker_index):
        self.strategy, self.model, self.targetless = strategy, model, targetless
        self.epoch_metrics, self.worker_index = epoch_metrics, worker_index
        self.local_replicas = len(strategy.extended.worker_devices)
        self.multi_worker = strategy.num_replicas_in_sync > self.local_replicas
        self.log_names = {}  # "train", "test": the names of the logs the steps return (traced)
        self.train_logs = {}  # the last training call's last step's logs
        self.built = False  # Keras's state for the steps
        self._eval_steps = tf.function(self._eval_steps_fn)

    def build_state(self, iterator):
        """Keras's state for the model's own steps (its compiled loss's and metrics'
        variables), made once before the first traced step, as fit makes it."""
        if self.built:
            return
        with self.strategy.scope():
            ownstep.build_state(self.model, iterator.element_spec)
        self.built = True
        self.epoch_metrics.place(self.strategy, first_worker=self.worker_index == 0)

    def reset_metrics(self):
        for metric in self.model.metrics:
            metric.reset_state()

    # The training figures of the epoch so far, as trainfigures.TrainFigures gives the
    # engine's: variables, reset, results, names

    def variables(self):
        """The state of the metrics the model's own steps update (built at its first step)."""
        return [v for metric in self.model.metrics for v in metric.variables]

    def reset(self):
        """At an epoch's start, as fit resets them."""
        self.reset_metrics()
        self.train_logs = {}

    def names(self):
        """The logs besides the loss the model's own train_step returned (None before it
        ran)."""
        if "train" not in self.log_names:
            return None
        return [name for name in self.log_names["train"] if name != "loss"]

    def step(self, batch):
        """One step of the model's own train_step on every local replica, inside the
        engine's training call: (this worker's share of the loss, each local replica's clock
        when it was done, the same again (its optimizer sums the gradients: not timed apart),
        the logs meaned over every replica as fit means them)."""
        vectors, ready = (self.strategy.experimental_local_results(part) for part
                          in self.strategy.run(self.replica_train_step, args=(batch,)))
        mean = tf.add_n(vectors) / self.strategy.num_replicas_in_sync
        names = self.log_names["train"]
        share = mean[names.index("loss")] if "loss" in names else tf.constant(0.0)
        return share, ready, ready, mean

    def replica_train_step(self, data):
        """(the logs the model's own train_step returns as a vector, the clock after it)."""
        vector = ownstep.train_logs(self.model, data, self.log_names)
        return vector, timing.clock_after([vector])

    def took(self, logs):
        """The last step's logs of a training call (a vector in log_names["train"]'s order)."""
        self.train_logs = dict(zip(self.log_names["train"], map(float, logs)))

    def results(self):
        """The logs the last step returned, averaged over the replicas; a log that is a
        metric's result: the metric over every replica's examples (its variables read across
        the replicas), as fit's epoch logs give it (a weighted metric is not the mean of the
        replicas' ratios). {} before the first step (a resumed epoch)."""
        if not self.train_logs:
            return {}
        exact = {name: number(value) for name, value
                 in ownstep.flat_logs(self.model.get_metrics_result()).items()}
        return {name: exact.get(name, value) for name, value in self.train_logs.items()}

    def evaluate(self, eval_dataset, num_steps):
        """({log name: its value}, examples counted) with the model's own test_step (or
        Keras's): its metrics reset first, as fit's evaluate resets them (the training logs
        were read before)."""
        self.reset_metrics()
        iterator = iter(eval_dataset)
        self.build_state(iterator)
        with usermodel.failure_said("evaluation"):
            row = self._eval_steps(iterator, tf.constant(num_steps, tf.int64)).numpy()
        names = self.log_names["test"]
        present, examples = row[len(names)], row[len(names) + 1]
        # a log that is a metric's result: the metric over every replica's examples (its
        # variables read across the replicas), as one device's evaluate gives it
        exact = {name: number(value)
                 for name, value in ownstep.flat_logs(self.model.get_metrics_result()).items()}
        return ({name: exact.get(name, float(v) / max(present, 1.0))
                 for name, v in zip(names, row)}, examples)

    def _replica_eval_step(self, features, targets, weights, sample_weights=None):
        return ownstep.test_logs(self.model, features, targets, weights, self.log_names,
                                 sample_weights)

    def _eval_steps_fn(self, iterator, num_steps):
        """[the last batch's logs summed over the replicas that had examples in it, their
        count, the examples evaluated], summed over the workers."""
        rows = tf.TensorArray(tf.float32, size=tf.cast(num_steps, tf.int32))
        examples = tf.constant(0.0)
        for i in tf.range(num_steps):
            batch = next(iterator)  # (features, targets, present[, your weights])
            if self.targetless:  # (features, present): no targets
                batch = (batch[0], None, *batch[1:])
            weights = batch[2]
            vectors, present = (self.strategy.experimental_local_results(part) for part in
                                self.strategy.run(self._replica_eval_step, args=batch))
            rows = rows.write(tf.cast(i, tf.int32), tf.concat(
                [tf.add_n([v * p for v, p in zip(vectors, present)]),
                 tf.reshape(tf.add_n(list(present)), [1])], 0))
            examples += tf.add_n([tf.reduce_sum(tf.cast(w > 0, tf.float32)) for w in
                                  self.strategy.experimental_local_results(weights)])
        last = tf.concat([rows.read(tf.cast(num_steps, tf.int32) - 1),
                          tf.reshape(examples, [1])], 0)
        if not self.multi_worker:
            return last

        def first_local_replica():
            replica = tf.distribute.get_replica_context().replica_id_in_sync_group
            return tf.where(tf.equal(replica % self.local_replicas, 0), last,
                            tf.zeros_like(last))

        return self.strategy.reduce(tf.distribute.ReduceOp.SUM,
                                    self.strategy.run(first_local_replica), axis=None)


def number(value):
    """A metric's result as a float (a metric with several values, as their mean)."""
    return float(np.mean(keras.ops.convert_to_numpy(value)))
