"""The training figures of an epoch so far, for a model the engine's own step trains (a
model with its own train_step reports its logs: ownsteps.OwnSteps, the same four methods):
the mean loss as fit reports it (the compiled loss plus the model's own losses) and the
task's metrics, each replica counting the examples it trains on."""
import keras

from tfmulti.training.ownsteps import number


class TrainFigures:
    """Made in the strategy's scope (its metrics are replicated); `task` the engine's."""

    def __init__(self, task):
        self.task = task
        self.loss = keras.metrics.Mean("loss")
        # the model's own losses (model.losses: regularizers, add_loss), per batch: the
        # reported loss is the compiled one plus these, as fit reports it
        self.added = keras.metrics.Mean("added_losses")

    def update(self, per_example, added, targets, outputs, weights=None):
        """In a replica's step: one batch's (or micro-batch's) losses per example, the sum
        of the model's own losses (None: none), and its outputs for the metrics (weighed by
        `weights`, as fit's compiled metrics weigh them)."""
        self.loss.update_state(per_example)
        if added is not None:  # none: nothing to add on the hot path
            self.added.update_state(added)
        self.task.update(self.task.train_metrics, targets, outputs, sample_weight=weights)

    def variables(self):
        """The metrics' state (kept in checkpoints: epoch_metrics.py)."""
        metrics = [self.loss, self.added, *(metric for _, metric, _ in self.task.train_metrics)]
        return [v for metric in metrics for v in metric.variables]

    def reset(self):
        self.loss.reset_state()
        self.added.reset_state()
        for _, metric, _ in self.task.train_metrics:
            metric.reset_state()

    def results(self):
        """{"loss": the mean loss, metric name: its value} since the last reset (every
        worker must read them: a collective)."""
        return {"loss": float(self.loss.result() + self.added.result()),
                **{name: number(metric.result()) for name, metric, _ in self.task.train_metrics}}

    def names(self):
        """The figures besides the loss."""
        return list(self.task.metric_names)
