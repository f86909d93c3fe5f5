"""What a run does around its steps, one class each (loop.Action): the progress lines, the
report, the checkpoints, the stop on request, the data service's watchdog, a trial's
pruning and your Keras callbacks. train.actions_of() lists them in the order they act:

    Progress, Watched, YourCallbacks, Reported, Checkpoints, AfterEpoch, Preemption

At each epoch's end your callbacks come before the report and the checkpoint (a rate they
set is in it, and so is their stop), the report before the checkpoint (a kill in between
trains the epoch again, never skips its record), the pruning after both, and a stop asked in
the epoch's last call last of all: the epoch is then recorded and saved before the run stops.
"""
from __future__ import annotations

import contextlib
import sys
from typing import Any

import keras
import numpy as np

from tfmulti.accounting import flops, timing
from tfmulti.run.callbacks import ModelSeenByCallbacks, fit_logs
from tfmulti.rundir import report
from tfmulti.training.loop import Action, CallEnd, EpochRecord, Preempted


class Progress(Action):
    """What you read: 'Epoch 2/10', a live bar on a terminal (in a log, one line per
    epoch) with every training figure, as fit shows them, and the epoch's evaluations and
    speed."""

    def __init__(self, epochs: int, steps_per_epoch: int, examples: str = "images"):
        self.epochs, self.steps, self.examples = epochs, steps_per_epoch, examples
        self.bar = None

    def epoch_begin(self, epoch: int, offset: int) -> None:
        print(f"Epoch {epoch + 1}/{self.epochs}" + (f" (resumed at step {offset + 1} of "
                                                    f"{self.steps})" if offset else ""))
        self.bar = None  # made at the first call: the figures shown are the first call's

    def call_end(self, call: CallEnd) -> bool:
        shown = list(call.logs)  # every figure, as fit shows them
        if self.bar is None:
            self.bar = keras.utils.Progbar(self.steps, verbose=1 if sys.stdout.isatty() else 2,
                                           stateful_metrics=[*shown, "lr"])
        self.bar.update(call.done, [*((name, call.logs[name]) for name in shown),
                                    ("lr", call.learning_rate)])
        return False

    def xla_fell_back(self, reason: str) -> None:
        print(f"XLA: off, training without it: {reason}", flush=True)

    def epoch_end(self, record: EpochRecord) -> bool:
        row = record.row()
        parts = list(record.examples)
        said = "".join(f"{evaluation_text(record, part, self.examples)}"
                       f"{'; ' if i < len(parts) - 1 else ', '}" for i, part in enumerate(parts))
        print(f"  {said}{record.seconds:.1f} s, {record.images_per_sec:.0f} {self.examples}/s, "
              f"input {row['input_wait_share']:.0%}, compute {row['compute_share']:.0%}, "
              f"all-reduce {row['allreduce_share']:.0%}"
              + (f", MFU {record.mfu:.1%}" if record.mfu is not None else ""))
        if "straggler" in row:
            print("  " + straggler_text(row))
        return False

    def weights_set(self, record: EpochRecord) -> None:
        said = "; ".join(evaluation_text(record, part, self.examples) for part in record.examples)
        print(f"  your callbacks set the model's weights at the end of training (as "
              f"EarlyStopping(restore_best_weights=True) does); evaluated again: {said}")


def evaluation_text(record: EpochRecord, part: str, examples: str = "images") -> str:
    """'test acc 0.9100, test loss 0.2500 (10000 images)': one evaluation of an epoch."""
    figures = record.evaluated[part]
    named = [f"{part} {'acc' if name == 'accuracy' else name} {value:.4f}"
             for name, value in figures.items() if name != "loss"]
    loss = (f"{part} loss {figures['loss']:.4f} " if "loss" in figures
            else "")  # a model's own test_step may log none
    return ", ".join([*named, f"{loss}({int(record.examples[part])} {examples})"])


def straggler_text(row: dict[str, Any]) -> str:
    """'worker 1 is a straggler: ...', the line naming the slow worker of an epoch."""
    slow = row["straggler"]["worker"]
    computed = row["worker_compute_seconds"]
    others = sorted(s for w, s in enumerate(computed) if w != slow)
    span = " to ".join(dict.fromkeys(f"{s:.2f}" for s in (others[0], others[-1])))
    return (f"worker {slow} is a straggler: its steps computed {computed[slow]:.2f} s, "
            f"{row['straggler']['ratio']:.1f}x the median of the other workers' ({span} s), "
            f"and every worker waited for it in the all-reduce (named above "
            f"{timing.STRAGGLER_MARGIN}x)")


class Watched(Action):
    """The data service's watchdog (processes/watchdog.py) watching the training calls, the
    only waits for the service's batches: told after each call, paused from then until the
    next call begins (the evaluation, the report and the checkpoint between them may take
    longer than its bound, and wait for nothing of the service's)."""

    def __init__(self, watchdog: Any):
        self.watchdog = watchdog
        self.held = False  # since the last call's end

    def call_begin(self, done: int) -> None:
        if self.held:
            self.watchdog.release()
            self.held = False

    def call_end(self, call: CallEnd) -> bool:
        self.watchdog.tick(call.step)
        self.watchdog.hold()
        self.held = True
        return False


class Checkpoints(Action):
    """The run's checkpoints (a tf.train.CheckpointManager): every `every` steps within an
    epoch, at each epoch's end, on a stop request (Preemption), and again when your callbacks
    set the weights at the end (the checkpoint holds the weights the run ends with).
    pause(): a context in which nothing may cut the save (the watchdog's)."""

    def __init__(self, manager: Any, every: int, pause: Any = contextlib.nullcontext):
        self.manager, self.every, self.pause = manager, every, pause
        self.saved = None  # the step of the last checkpoint saved
        self.due = None  # a periodic checkpoint's step, saved before the next call

    def save(self, step: int) -> None:
        with self.pause():
            self.manager.save(checkpoint_number=step)
        self.saved = step

    def call_end(self, call: CallEnd) -> bool:
        self.due = (call.step if self.every and call.step % self.every == 0 and not call.last
                    else None)  # the last: saved at the epoch's end, after its record
        return False

    def call_begin(self, done: int) -> None:
        if self.due is not None:  # the epoch goes on (not ended by your callbacks: then the
            self.save(self.due)  # checkpoint is the epoch's, after its record)
            self.due = None

    def epoch_end(self, record: EpochRecord) -> bool:
        self.due = None
        self.save(record.step)
        return False

    def weights_set(self, record: EpochRecord) -> None:
        self.save(record.step)


class Preemption(Action):
    """A stop asked (SIGTERM, Ctrl-C, another worker's: stop() says which) ends the run after
    the call it came in (loop.Preempted), with a checkpoint there; in the epoch's last call,
    after the epoch's record and checkpoint, unless your callbacks ended the run there. Last
    of the actions: the others have seen the call and the epoch."""

    def __init__(self, stop: Any, checkpoints: Checkpoints):
        self.stop, self.checkpoints = stop, checkpoints
        self.stopping = False

    def _by(self) -> str:
        return self.stop() or "another worker's stop request"

    def call_end(self, call: CallEnd) -> bool:
        self.stopping = call.stopping
        if call.stopping and not call.last:
            if self.checkpoints.saved != call.step:  # not already the call's checkpoint
                self.checkpoints.save(call.step)
            raise Preempted(call.step, self._by())
        return False

    def epoch_end(self, record: EpochRecord) -> bool:
        if self.stopping and not record.stopped_by_callbacks:
            raise Preempted(record.step, self._by())
        return False


class Reported(Action):
    """The run's report (rundir/report.RunReport): the per-call loss curve, each epoch's row
    and what the engine learnt while training (its FLOPs, XLA kept or not, a model's own
    figures' names)."""

    def __init__(self, run: report.RunReport, eng: Any):
        self.run, self.eng = run, eng

    def call_end(self, call: CallEnd) -> bool:
        if self.run.write_files:
            self.run.on_steps(call.step, call.call_loss, call.learning_rate)
        return False

    def epoch_end(self, record: EpochRecord) -> bool:
        eng, info = self.eng, self.run.run_info
        per_example = flops.step_cost(eng).per_example  # counted from the first call
        if per_example:
            info["flops_per_example"] = per_example
        if record.peak_gflops:  # the step's kernels timed at its first epoch's end
            info["peak_gflops"], info["peak_source"] = record.peak_gflops, record.peak_source
        info["xla"] = eng.jit_compile  # off when its first step failed to compile
        row = record.row()
        if eng.own_training or eng.own_evaluation:  # its steps' logs name the figures
            info["metrics"] = eng.metric_names
            info["primary_metric"] = report.primary_metric(row, eng.task.primary)
        self.run.on_epoch_end(row)
        return False

    def weights_set(self, record: EpochRecord) -> None:
        self.run.history[-1] = record.row()  # written with the run's end


class AfterEpoch(Action):
    """function(row) after each epoch's report and checkpoint: it may end the run by raising
    (a tuning trial pruned)."""

    def __init__(self, function: Any):
        self.function = function

    def epoch_end(self, record: EpochRecord) -> bool:
        self.function(record.row())
        return False


class YourCallbacks(Action):
    """Your Keras callbacks (--callbacks, run/callbacks.py), called at fit's moments. Their
    stop (model.stop_training) is agreed between the workers (one collective each time)."""

    def __init__(self, callbacks: list, eng: Any, epochs: int, steps: int, verbose: int):
        self.callbacks, self.eng, self.verbose = callbacks, eng, verbose
        self.model = ModelSeenByCallbacks(eng.model, eng.optimizer)
        for callback in callbacks:
            callback.set_model(self.model)
            callback.set_params({"verbose": verbose, "epochs": epochs, "steps": steps})
        self.asked = False  # in this epoch's calls
        self.validated = None  # this epoch's validation figures
        self.logs = {}  # the last epoch's, as fit names them

    def _each(self, method: str, *args: Any) -> None:
        for callback in self.callbacks:
            getattr(callback, method)(*args)

    def _stop_asked(self) -> bool:
        """Whether a callback asked to stop, on any worker (a collective with several)."""
        return self.eng.any_worker(bool(getattr(self.eng.model, "stop_training", False)))

    def train_begin(self) -> None:
        self.eng.model.stop_training = False
        self._each("on_train_begin", {})

    def epoch_begin(self, epoch: int, offset: int) -> None:
        self.asked, self.validated = False, None
        self._each("on_epoch_begin", epoch, {})

    def call_begin(self, done: int) -> None:
        self._each("on_train_batch_begin", done, {})

    def call_end(self, call: CallEnd) -> bool:
        self._each("on_train_batch_end", call.done - 1, dict(call.logs))
        self.asked = self._stop_asked()  # as fit: the epoch ends here (evaluated, recorded,
        return self.asked  # saved)

    def evaluation_begin(self, part: str) -> None:
        if part == "val":
            self._each("on_test_begin", {})

    def evaluation_end(self, part: str, figures: dict[str, float]) -> None:
        if part == "val":
            self.validated = figures
            self._each("on_test_end", dict(figures))

    def epoch_end(self, record: EpochRecord) -> bool:
        self.logs = fit_logs(record.trained, self.validated)
        self._each("on_epoch_end", record.epoch - 1, dict(self.logs))
        if self._stop_asked() or self.asked:
            record.stopped_by_callbacks = True
            if self.verbose:
                print(f"  your callbacks stopped the run (model.stop_training) at step "
                      f"{record.step}: it is complete")
        return record.stopped_by_callbacks

    def train_end(self, records: list[EpochRecord]) -> bool:
        """on_train_end; whether a callback set the model's weights there
        (EarlyStopping(restore_best_weights=True) does)."""
        before = self.eng.model.get_weights()
        self._each("on_train_end", dict(self.logs))
        after = self.eng.model.get_weights()
        return any(not np.array_equal(b, a) for b, a in zip(before, after))
