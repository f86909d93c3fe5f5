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
