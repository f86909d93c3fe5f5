"""The engine's exact evaluation of a model without its own test_step: every test example
weighed once, whatever the replica count (the pipeline pads the last batch; a padded example
weighs 0), your sample weights as Keras's evaluate weighs them. A model's own test_step is
ownsteps.OwnSteps' instead."""
import keras
import tensorflow as tf

from tfmulti.models import task as tasks
from tfmulti.models import usermodel
from tfmulti.training.ownsteps import number


class EvalSteps:
    """Made in the strategy's scope (its metrics are replicated): `strategy`, `model` and
    `task` (task.Task) the engine's."""

    def __init__(self, strategy, model, task):
        self.strategy, self.model, self.task = strategy, model, task
        self.loss = keras.metrics.Mean("test_loss")
        # the model's own losses (model.losses: regularizers, add_loss), per batch: the
        # reported loss is the compiled one plus these, as evaluate reports it
        self.added = keras.metrics.Mean("test_added_losses")
        self._steps = tf.function(self._steps_fn)

    def _replica_step(self, features, targets, weights, sample_weights=None):
        """One batch: weights 1 for a real example, 0 for padding; sample_weights (yours,
        when given) weigh as Keras's evaluate does: the loss is the mean of weight x loss
        over the examples, a metric weighs each example."""
        outputs = self.model(features, training=False)
        per_example = self.task.per_example_loss(targets, outputs)
        if sample_weights is not None:
            per_example *= tf.cast(sample_weights, per_example.dtype)
        self.loss.update_state(per_example, sample_weight=weights)
        if self.model.losses:  # per batch, weighed by its real examples (as evaluate
            # weighs a batch by its size)
            self.added.update_state(tasks.added_losses(self.model.losses),
                                    tf.reduce_sum(weights))
        self.task.update(self.task.test_metrics, targets, outputs, sample_weights, weights)

    def _steps_fn(self, iterator, num_steps):
        for _ in tf.range(num_steps):
            self.strategy.run(self._replica_step, args=next(iterator))

    def evaluate(self, eval_dataset, num_steps):
        """({"loss": test loss, metric name: its value}, examples counted) over the whole
        evaluation set (its per-replica batches, num_steps of them)."""
        self.loss.reset_state()
        self.added.reset_state()
        for _, metric, _ in self.task.test_metrics:
            metric.reset_state()
        with usermodel.failure_said("evaluation"):
            self._steps(iter(eval_dataset), tf.constant(num_steps, tf.int64))
        counted = float(self.loss.count.numpy())  # the sum of the weights
        return ({"loss": float(self.loss.result() + self.added.result()),
                 **{name: number(metric.result()) for name, metric, _ in self.task.test_metrics}},
                counted)
