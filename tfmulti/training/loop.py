"""The epochs: the host loop around an Engine's training calls.

Each epoch trains from the engine's step to the epoch's end with a progress bar, evaluates on
each evaluation set in full (the validation part, when there is one, and the test set),
and hands a record to on_epoch_end (the run's report and checkpoint).
Periodic checkpoints and a SIGTERM's stop happen between calls (engine.train_steps cuts its
calls at multiples of the checkpoint interval).
"""
import sys
import time

import keras

from tfmulti.accounting import timing
from tfmulti.models.task import record_key
from tfmulti.run.callbacks import fit_logs as callbacks_logs
from tfmulti.training.xla import XlaFellBack

STOPPED_BY_CALLBACKS = "stopped_by_callbacks"  # an epoch record's key: the run ended there
WEIGHTS_SET_BY_CALLBACKS = "weights_set_by_callbacks"  # and: its figures are of those weights


class Preempted(Exception):
    """Training stopped on request (`by`: SIGTERM, Ctrl-C, or another worker's) after saving
    a checkpoint at `step`."""

    def __init__(self, step, by="SIGTERM"):
        super().__init__(f"stopped at step {step}")
        self.step, self.by = step, by


def fit(eng, train_input_fn, evaluations, epochs, steps_per_epoch,
        on_epoch_end=None, verbose=1, checkpoint_every=0, save=None, stop=None,
        on_steps=None, examples="images", on_call=None, callbacks=None):
    """Trains engine `eng` from its current step (0, or a restored checkpoint's) to the end
    of epoch `epochs`; returns one record per epoch finished.

    train_input_fn must start its stream at that step (data.train_input_fn(start_step=)).
    evaluations: {part: (input_fn, steps)}, evaluated in that order at each epoch's end, its
    figures recorded as part_loss, part_<metric> (part "val", "test").
    save(step) is called every checkpoint_every steps; when stop() turns true between
    calls, save(step) runs and Preempted is raised (after the epoch's end when it turned
    true in the epoch's last call: on_epoch_end must then save). on_steps(step, loss,
    learning_rate) is called after every training call: the mean loss of that call's steps
    (TensorBoard's per-step curve). examples: what the lines count ("images", "examples").
    on_call(step) runs after every training call and after each epoch's evaluation (the
    data service's watchdog). callbacks: your Keras callbacks (callbacks.UserCallbacks),
    called at fit's moments; when they stop the run, its last record says so
    (STOPPED_BY_CALLBACKS) and the run is complete.
    """
    iterator = iter(eng.distribute(train_input_fn))

    def calls(steps):
        """eng.train_steps over the run's input; XLA failing to compile the first call falls
        back (one line), the input made again from the step the run is at."""
        nonlocal iterator
        try:
            yield from eng.train_steps(iterator, steps, checkpoint_every, stop)
            return
        except XlaFellBack as fell:
            reason = fell.reason
        if verbose:  # outside the except: the failed call's objects go with its traceback
            print(f"XLA: off, training without it: {reason}", flush=True)
        iterator = None  # the failed call's input, let go before the new one is made
        iterator = iter(eng.distribute(train_input_fn))
        yield from eng.train_steps(iterator, steps, checkpoint_every, stop)
    evaluated = {part: (eng.distribute(input_fn), steps)
                 for part, (input_fn, steps) in evaluations.items()}
    history = []
    first_epoch = eng.step // steps_per_epoch
    if callbacks is not None and first_epoch < epochs:
        callbacks.train_begin()
    logs = {}
    for epoch in range(first_epoch, epochs):
        offset = eng.step - epoch * steps_per_epoch  # > 0 when resuming mid-epoch
        if not offset:  # resumed mid-epoch: the metrics of its steps so far are restored
            eng.reset_train_metrics()
        if verbose:
            print(f"Epoch {epoch + 1}/{epochs}" + (f" (resumed at step {offset + 1} of "
                                                   f"{steps_per_epoch})" if offset else ""))
        # A live bar on a terminal; in logs (not a tty) one line per epoch.
        bar = None  # made at the first call: the figures shown are the first call's
        start = time.perf_counter()
        eng.reset_timing()
        # (steps, their mean loss) this epoch before the call
        before = (offset, eng.train_results().get("loss", 0.0) if offset else 0.0)
        stopping = asked = False  # asked: by your callbacks
        done = 0
        if callbacks is not None:
            callbacks.epoch_begin(epoch)
            callbacks.call_begin(offset)
        for done, stopping in calls(steps_per_epoch - offset):
            # Reading the metrics waits for the steps: the timer below is honest.
            trained = eng.train_results()
            loss = trained.get("loss", float("nan"))  # a model's own step may log none
            if on_steps and offset + done > before[0]:  # every step weighs the same
                on_steps(eng.step, (loss * (offset + done) - before[1] * before[0])
                         / (offset + done - before[0]), eng.learning_rate())
            before = (offset + done, loss)
            if on_call:
                on_call(eng.step)
            if verbose:
                shown = list(trained)  # every figure, as fit shows them
                if bar is None:
                    bar = keras.utils.Progbar(steps_per_epoch,
                                              verbose=1 if sys.stdout.isatty() else 2,
                                              stateful_metrics=[*shown, "lr"])
                bar.update(offset + done, [*((name, trained[name]) for name in shown),
                                           ("lr", eng.learning_rate())])
            if stopping and done < steps_per_epoch - offset:
                save(eng.step)
                raise Preempted(eng.step, (stop and stop()) or "another worker's stop request")
            if callbacks is not None:
                asked = callbacks.call_end(offset + done - 1, trained)
                if asked:  # as fit: the epoch ends here (evaluated, recorded, saved)
                    break
                if done < steps_per_epoch - offset:
                    callbacks.call_begin(offset + done)
            last = done == steps_per_epoch - offset  # on_epoch_end saves it after the
            # report: saved here, a kill before the report would resume past the epoch
            # without ever recording it
            if (checkpoint_every and eng.step % checkpoint_every == 0 and save is not None
                    and not (last and on_epoch_end is not None)):
                save(eng.step)
        seconds = time.perf_counter() - start
        start = time.perf_counter()
        figures, counted, names, validated = evaluations_of(eng, evaluated, callbacks)
        if on_call:
            on_call(eng.step)
        speed = done * eng.global_batch_size / seconds  # images/s
        mfu = eng.utilization(speed)
        record = {
            "epoch": epoch + 1, "step": eng.step, "loss": loss,
            **{record_key("train", name): value for name, value in trained.items()
               if name != "loss"},
            **figures,
            **{f"{part}_examples": int(n) for part, n in counted.items()},
            "seconds": seconds, "eval_seconds": time.perf_counter() - start,
            "images_per_sec": speed,
            # where the epoch's seconds went on this worker (timing.py): waiting for the
            # input batch (the pipeline, not the devices, bound the steps then), computing the
            # gradients, all-reducing them (waiting for the slowest replica included)
            **accounting(eng, seconds),
            "learning_rate": eng.learning_rate(),
            # model FLOPs utilization: the model's FLOPs at this speed over the devices' peak
            **({"mfu": mfu} if mfu is not None else {}),
            # an epoch this run began mid-way (a resume): the global step it trained from
            **({"resumed_at_step": epoch * steps_per_epoch + offset + 1} if offset else {}),
        }
        if verbose:
            said = "".join(f"{evaluation_text(record, part, names[part], int(n), examples)}"
                           f"{'; ' if i < len(counted) - 1 else ', '}"
                           for i, (part, n) in enumerate(counted.items()))
            print(f"  {said}{seconds:.1f} s, {record['images_per_sec']:.0f} {examples}/s, "
                  f"input {record['input_wait_share']:.0%}, compute "
                  f"{record['compute_share']:.0%}, all-reduce {record['allreduce_share']:.0%}"
                  + (f", MFU {record['mfu']:.1%}" if "mfu" in record else ""))
            if "straggler" in record:
                print("  " + straggler_text(record))
        if callbacks is not None:  # before the checkpoint: a rate they set is in it
            logs = callbacks_logs(trained, validated)
            asked = callbacks.epoch_end(epoch, logs) or asked
            if asked:
                record[STOPPED_BY_CALLBACKS] = True
                if verbose:
                    print(f"  your callbacks stopped the run (model.stop_training) at step "
                          f"{eng.step}: it is complete")
        history.append(record)
        if on_epoch_end:
            on_epoch_end(record)
        if stopping and not asked:  # asked during the epoch's last call: the epoch ended
            # first (evaluated, recorded, its checkpoint saved), else a resumed run would
            # never record it
            if on_epoch_end is None:
                save(eng.step)
            raise Preempted(eng.step, (stop and stop()) or "another worker's stop request")
        if asked:
            break
    if callbacks is not None and history and callbacks.train_end(logs):
        weights_set(eng, evaluated, history[-1], verbose, examples)
        if save is not None:  # the checkpoint holds the weights the run ends with
            save(eng.step)
    return history


def weights_set(eng, evaluated, record, verbose, examples):
    """Your callbacks set the model's weights at the end (EarlyStopping's
    restore_best_weights): the last record's evaluations are made again on them, so the
    figures reported are those of the model saved."""
    figures, counted, names, _ = evaluations_of(eng, evaluated)
    record.update(figures)
    record[WEIGHTS_SET_BY_CALLBACKS] = True
    if verbose:
        said = "; ".join(evaluation_text(record, part, names[part], int(n), examples)
                         for part, n in counted.items())
        print(f"  your callbacks set the model's weights at the end of training (as "
              f"EarlyStopping(restore_best_weights=True) does); evaluated again: {said}")


def evaluations_of(eng, evaluated, callbacks=None):
    """(the record's figures of every evaluation, examples counted by part, metric names by
    part, the validation part's figures or None): each part of `evaluated` in full, your
    callbacks' on_test_begin/end around the validation part."""
    figures, counted, names, validated = {}, {}, {}, None
    for part, (dataset, steps) in evaluated.items():
        if callbacks is not None and part == "val":
            callbacks.test_begin()
        tested, counted[part] = eng.evaluate(dataset, steps)
        if callbacks is not None and part == "val":
            validated = tested
            callbacks.test_end(tested)
        figures.update({record_key(part, name): value for name, value in tested.items()})
        names[part] = [name for name in tested if name != "loss"]
    return figures, counted, names, validated


def stopped_by_callbacks(history):
    """Whether the run's last epoch record says your callbacks stopped it (it is complete)."""
    return bool(history) and bool(history[-1].get(STOPPED_BY_CALLBACKS))


def accounting(eng, seconds):
    """The record's timing figures: this worker's seconds waiting for input, computing and
    all-reducing, their shares of the epoch's `seconds`; with several workers each worker's
    compute and all-reduce seconds and the straggler, when one is (timing.straggler)."""
    worker = eng.worker_index
    figures = {"input_wait_seconds": eng.input_wait,
               "compute_seconds": float(eng.compute_time[worker]),
               "allreduce_seconds": float(eng.allreduce_time[worker])}
    figures.update({f"{kind}_share": figures[f"{kind}_seconds"] / seconds
                    for kind in ("input_wait", "compute", "allreduce")})
    if len(eng.compute_time) > 1:
        figures["worker_compute_seconds"] = [float(s) for s in eng.compute_time]
        figures["worker_allreduce_seconds"] = [float(s) for s in eng.allreduce_time]
        slow = timing.straggler(eng.compute_time)
        if slow:
            figures["straggler"] = {"worker": slow[0], "ratio": slow[1]}
    return figures


def straggler_text(record):
    """'worker 1 is a straggler: ...', the line naming the slow worker of an epoch."""
    slow = record["straggler"]["worker"]
    computed = record["worker_compute_seconds"]
    others = sorted(s for w, s in enumerate(computed) if w != slow)
    span = " to ".join(dict.fromkeys(f"{s:.2f}" for s in (others[0], others[-1])))
    return (f"worker {slow} is a straggler: its steps computed {computed[slow]:.2f} s, "
            f"{record['straggler']['ratio']:.1f}x the median of the other workers' ({span} s), "
            f"and every worker waited for it in the all-reduce (named above "
            f"{timing.STRAGGLER_MARGIN}x)")


def evaluation_text(record, part, names, counted, examples="images"):
    """'test acc 0.9100, test loss 0.2500 (10000 images)': one evaluation of an epoch."""
    figures = [f"{part} {'acc' if name == 'accuracy' else name} "
               f"{record[record_key(part, name)]:.4f}" for name in names]
    loss = (f"{part} loss {record[f'{part}_loss']:.4f} " if f"{part}_loss" in record
            else "")  # a model's own test_step may log none
    return ", ".join([*figures, f"{loss}({counted} {examples})"])
