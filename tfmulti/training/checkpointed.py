"""What a checkpoint holds: every variable of the model and the optimizer, found from them.

`tf.train.Checkpoint(model=..., optimizer=...)` saves what TensorFlow's object graph reaches
from the model, and Keras 3 keeps some state outside that graph: the seed generators of
Dropout, GaussianNoise, the random augmentation layers (RandomFlip, RandomRotation, ...) are
plain Python objects, so their `seed_generator_state` variables were not saved, and a resumed
run drew other masks than the uninterrupted one. Rather than list the layers that do this
(a list that goes stale with the next Keras), every variable the model and the optimizer
report is checked against what the checkpoint reaches; the ones it misses are added under
their position in that list (stable for the same model function, unlike Keras's names,
which depend on what else the process built); and a variable that still cannot be saved
stops the run before its first step, naming it.
"""
import tensorflow as tf

from tfmulti.errors import UsageError
from tfmulti.training import epoch_metrics

UNTRACKED = "untracked"  # the checkpoint's key of the variables Keras keeps outside its graph


def checkpoint(model, optimizer, **more):
    """A tf.train.Checkpoint of model, optimizer and `more` (named trackables) that holds
    every variable of the model and the optimizer; UsageError naming one it cannot hold."""
    parts = dict(model=model, optimizer=optimizer, **more)
    lists = {"model": list(model.variables), "optimizer": list(optimizer.variables)}
    whole = tf.train.Checkpoint(**parts)
    missed = unreached(whole, *lists.values())
    if missed:
        owners = {id(v): f"{kind}_{i}" for kind, variables in lists.items()
                  for i, v in enumerate(variables)}
        whole = tf.train.Checkpoint(**parts, **{UNTRACKED: {owners[id(v)]: v for v in missed}})
    left = unreached(whole, *lists.values())
    if left:
        raise UsageError(f"the model's variable {left[0].path} cannot be saved in a "
                         "checkpoint, so a resumed run would not continue where it stopped")
    return whole


class Saved:
    """What a checkpoint of the engine holds (`whole`): every variable of the model and the
    optimizer (checkpoint()), the step count, which is also the data position (see
    data/pipeline.py), and the epoch's training metrics so far (`metrics`, an
    epoch_metrics.EpochMetrics: a run resumed mid-epoch reports the whole epoch); `core`: the
    same without the metrics, as an earlier tfmulti saved it. multi_worker: replicas on other
    processes (the metrics are then kept at each call's end, not read at the save)."""

    def __init__(self, model, optimizer, steps_taken, metrics, multi_worker):
        self.core = checkpoint(model, optimizer, steps_taken=steps_taken)
        self.whole = checkpoint(model, optimizer, steps_taken=steps_taken,
                                **{epoch_metrics.CHECKPOINT_KEY: metrics.sums})
        self.metrics, self.multi_worker = metrics, multi_worker

    def manager(self, directory, max_to_keep=2):
        """A CheckpointManager of `whole` that takes the metrics at each save in one
        process (a bare whole.save() does not)."""
        before = None if self.multi_worker else (
            lambda: self.metrics.record(self.metrics.local_values()))
        return epoch_metrics.Manager(self.whole, directory, max_to_keep=max_to_keep,
                                     before_save=before)

    def restore(self, path, strategy, first_worker):
        """Restores the checkpoint at path, checking that it is this model and optimizer
        (AssertionError when it is not); the metrics where it holds them (a checkpoint of an
        earlier tfmulti does not). first_worker: this process is the first worker."""
        core = self.core.restore(path)
        core.assert_existing_objects_matched()
        core.expect_partial()  # the metrics it leaves are the next restore's
        self.whole.restore(path).expect_partial()
        self.metrics.restored(strategy, first_worker)


def unreached(root, *variable_lists):
    """The variables of variable_lists that a checkpoint of `root` would not save."""
    reached = set()
    for trackable in tf.train.TrackableView(root).descendants():
        reached.add(id(trackable))
        reached.add(id(getattr(trackable, "value", None)))  # a Keras variable's tf.Variable
    missed, seen = [], set()
    for variables in variable_lists:
        for v in variables:
            if id(v) not in reached and id(getattr(v, "value", v)) not in reached and (
                    id(v) not in seen):
                seen.add(id(v))
                missed.append(v)
    return missed
