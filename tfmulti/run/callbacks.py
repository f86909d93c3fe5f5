"""Your Keras callbacks (--callbacks=MODULE:FUNCTION), called as model.fit calls them
(training/actions.YourCallbacks): the checks they pass, the model and logs they see.

FUNCTION() returns a list of `keras.callbacks.Callback`s. The loop calls them at the moments
fit does: on_train_begin; each epoch on_epoch_begin(epoch), on_train_batch_begin/end around
each training call (a call runs --steps_per_call steps, as fit's steps_per_execution: the
batch numbers are the call's first and last step in the epoch, the logs the epoch's running
figures), on_test_begin/end around the validation part, on_epoch_end(epoch, logs) with fit's
names (loss, accuracy, ..., val_loss, val_accuracy, ...); on_train_end. `self.model` is your
model, its `optimizer` the one that trains (a rate a callback sets is the rate that trains,
and is in the checkpoint); `self.model.stop_training = True` stops the run as fit stops, on
every worker at the same step (each worker runs the callbacks; their votes are agreed in one
collective), and the run is then complete.

What fit would not do either: a callback's own state (EarlyStopping's patience count, ...)
starts again when a run resumes, as with Keras's BackupAndRestore. BackupAndRestore itself is
refused: tfmulti's checkpoints resume the run exactly, mid-epoch too.
"""
from __future__ import annotations

from typing import Any

import keras

from tfmulti.errors import UsageError

# Callbacks that would fight tfmulti's own work: what to do instead
REFUSED = {
    keras.callbacks.BackupAndRestore: "tfmulti's checkpoints (--model_dir, --checkpoint_steps) "
                                      "already resume the run exactly, mid-epoch too",
    keras.callbacks.ProgbarLogger: "tfmulti shows its own progress bar",
}
# Keras's callbacks that set the optimizer's learning rate (a number, not a schedule)
SETS_RATE = (keras.callbacks.ReduceLROnPlateau, keras.callbacks.LearningRateScheduler)


class ModelSeenByCallbacks:
    """The model as your callbacks see it: your model, whose `optimizer` is the one the run
    trains with (a compiled model's own optimizer is rebuilt by the engine: compiled.py)."""

    def __init__(self, model: keras.Model, optimizer: keras.optimizers.Optimizer):
        object.__setattr__(self, "_model", model)
        object.__setattr__(self, "optimizer", optimizer)

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __setattr__(self, name, value):
        if name == "optimizer":
            raise UsageError("your callback replaced model.optimizer; set its learning_rate "
                             "instead (tfmulti's engine owns the optimizer)")
        setattr(self._model, name, value)


def checked(callbacks: Any, spec: str, settable_rate: bool) -> list:
    """The list FUNCTION returned, each a Keras callback that can work with this run;
    UsageError in one line otherwise. settable_rate: whether the optimizer's rate is a
    number a callback may set (no --warmup_epochs, --lr_schedule=cosine or schedule of your
    optimizer's own, which would drive it)."""
    if isinstance(callbacks, keras.callbacks.Callback):
        callbacks = [callbacks]
    if not isinstance(callbacks, (list, tuple)):
        raise UsageError(f"--callbacks={spec} returned {type(callbacks).__name__}; return a list "
                         "of keras.callbacks.Callback")
    for callback in callbacks:
        if not isinstance(callback, keras.callbacks.Callback):
            raise UsageError(f"--callbacks={spec} returned {type(callback).__name__} in its "
                             "list; each must be a keras.callbacks.Callback")
        for kind, instead in REFUSED.items():
            if isinstance(callback, kind):
                raise UsageError(f"--callbacks={spec}: leave {kind.__name__} out: {instead}")
        if isinstance(callback, SETS_RATE) and not settable_rate:
            raise UsageError(f"--callbacks={spec}: {type(callback).__name__} sets the learning "
                             "rate, which a schedule drives in this run (--warmup_epochs, "
                             "--lr_schedule=cosine or your optimizer's own schedule): leave "
                             "one or the other out")
    return list(callbacks)


def fit_logs(trained: dict[str, float], validated: dict[str, float] | None) -> dict[str, float]:
    """The epoch's logs as fit names them: the training figures, then val_ ones."""
    return {**trained, **{f"val_{name}": value for name, value in (validated or {}).items()}}
