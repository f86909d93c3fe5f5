"""The epochs: the host loop around an Engine's training calls, and what it hands its actions.

Each epoch trains from the engine's step to the epoch's end, one training call after another
(engine.train_steps), then evaluates each evaluation set in full (the validation part, when
there is one, and the test set) and makes the epoch's record. Everything else the run does
around the steps is an Action (actions.py: the progress lines, the report, the checkpoints,
the stop on request, the data service's watchdog, a trial's pruning, your Keras callbacks),
called at the moments below in the order given: adding one is one class.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

from tfmulti.accounting import flops, timing
from tfmulti.models.task import record_key
from tfmulti.training.xla import XlaFellBack

STOPPED_BY_CALLBACKS = "stopped_by_callbacks"  # an epoch row's key: the run ended there
WEIGHTS_SET_BY_CALLBACKS = "weights_set_by_callbacks"  # and: its figures are of those weights


class Preempted(Exception):
    """Training stopped on request (`by`: SIGTERM, Ctrl-C, or another worker's) after saving
    a checkpoint at `step`."""

    def __init__(self, step, by="SIGTERM"):
        super().__init__(f"stopped at step {step}")
        self.step, self.by = step, by


@dataclasses.dataclass(frozen=True)
class CallEnd:
    """A training call just ended."""
    epoch: int  # counted from 0
    step: int  # the global step after it
    done: int  # the epoch's steps done (a resumed epoch: its steps before the resume too)
    steps_per_epoch: int
    logs: dict[str, float]  # the epoch's running figures ("loss", metric names)
    call_loss: float  # the mean loss of this call's steps (nan: the model logs none)
    learning_rate: float
    stopping: bool  # a stop was asked (on any worker): the run stops after this call (its
    # epoch's last: after the epoch's record and checkpoint)

    @property
    def last(self) -> bool:
        """Whether the call ended the epoch."""
        return self.done == self.steps_per_epoch


@dataclasses.dataclass
class EpochRecord:
    """An epoch's figures; row() is its row in metrics.json (and in the history)."""
    epoch: int  # counted from 1
    step: int
    trained: dict[str, float]  # the training figures ("loss", metric names)
    evaluated: dict[str, dict[str, float]]  # by part ("val", "test"): its figures
    examples: dict[str, float]  # by part: the examples evaluated (the sum of their weights)
    seconds: float  # training, this worker
    eval_seconds: float
    images_per_sec: float
    # where the seconds went on this worker (timing.Spent.figures: waiting for the input
    # batch, computing the gradients, all-reducing them), with several workers each one's
    timing: dict[str, Any]
    learning_rate: float
    mfu: float | None = None  # model FLOPs utilization (None: not counted)
    peak_gflops: float | None = None  # its denominator (flops.Peak), and which rate it is
    peak_source: str = ""
    resumed_at_step: int | None = None  # an epoch this run began mid-way: its first step
    stopped_by_callbacks: bool = False  # your callbacks stopped the run here: it is complete
    weights_set_by_callbacks: bool = False  # its figures are of the weights they set at the end

    def row(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch, "step": self.step,
            "loss": self.trained.get("loss", float("nan")),  # a model's own step may log none
            **{record_key("train", name): value for name, value in self.trained.items()
               if name != "loss"},
            **{record_key(part, name): value for part, figures in self.evaluated.items()
               for name, value in figures.items()},
            **{f"{part}_examples": int(n) for part, n in self.examples.items()},
            "seconds": self.seconds, "eval_seconds": self.eval_seconds,
            "images_per_sec": self.images_per_sec, **self.timing,
            "learning_rate": self.learning_rate,
            **({"mfu": self.mfu} if self.mfu is not None else {}),
            **({"resumed_at_step": self.resumed_at_step} if self.resumed_at_step else {}),
            **({STOPPED_BY_CALLBACKS: True} if self.stopped_by_callbacks else {}),
            **({WEIGHTS_SET_BY_CALLBACKS: True} if self.weights_set_by_callbacks else {}),
        }


class Action:
    """Something the run does around its steps; the loop calls each method at its moment, in
    the order of the actions given. Every method does nothing unless overridden."""

    def train_begin(self) -> None:
        """Before the first epoch this run trains (not called when none is left)."""

    def epoch_begin(self, epoch: int, offset: int) -> None:
        """An epoch (counted from 0) begins; offset: its steps before a resume (else 0)."""

    def call_begin(self, done: int) -> None:
        """A training call begins, after the epoch's first `done` steps."""

    def call_end(self, call: CallEnd) -> bool:
        """A training call ended. True ends the epoch there and the run after it (as fit's
        stop_training does; every action is still called)."""
        return False

    def xla_fell_back(self, reason: str) -> None:
        """XLA failed to compile the first call: training goes on without it."""

    def evaluation_begin(self, part: str) -> None:
        """The evaluation of `part` ("val", "test") begins."""

    def evaluation_end(self, part: str, figures: dict[str, float]) -> None:
        """The evaluation of `part` ended with these figures."""

    def epoch_end(self, record: EpochRecord) -> bool:
        """The epoch's record is made (an action may mark it). True: the run ends with this
        epoch, complete (every action is still called)."""
        return False

    def train_end(self, records: list[EpochRecord]) -> bool:
        """The run ended (records: its epochs in this run). True: the model's weights changed
        (EarlyStopping's restore_best_weights): the loop evaluates again, then
        weights_set."""
        return False

    def weights_set(self, record: EpochRecord) -> None:
        """The last record's figures, made again on the weights set at train_end."""


def fit(eng, train_input_fn, evaluations, epochs, steps_per_epoch, actions=(), *,
        checkpoint_every=0, stop=None, peak_flops=None):
    """Trains engine `eng` from its current step (0, or a restored checkpoint's) to the end
    of epoch `epochs`; returns each epoch's row (EpochRecord.row()).

    train_input_fn must start its stream at that step (data.train_input_fn(start_step=)).
    evaluations: {part: (input_fn, steps)}, evaluated in that order at each epoch's end.
    actions: the Actions, called in this order at each moment. Calls end at multiples of
    checkpoint_every steps (the checkpoints' interval: a resumed run cuts its calls where the
    uninterrupted run did). stop(): what asked the run to stop, once it was ('' before):
    every worker learns it after the same call (CallEnd.stopping). peak_flops: the devices'
    peak (a flops.Peak), for the records' MFU (None: none reported).
    """
    iterator = iter(eng.distribute(train_input_fn))

    def calls(steps, spent):
        """eng.train_steps over the run's input; XLA failing to compile the first call falls
        back (the actions told), the input made again from the step the run is at."""
        nonlocal iterator
        try:
            yield from eng.train_steps(iterator, steps, checkpoint_every, stop, spent)
            return
        except XlaFellBack as fell:
            reason = fell.reason
        for action in actions:  # outside the except: the failed call's objects go with its
            action.xla_fell_back(reason)  # traceback
        iterator = None  # the failed call's input, let go before the new one is made
        iterator = iter(eng.distribute(train_input_fn))
        yield from eng.train_steps(iterator, steps, checkpoint_every, stop, spent)
    evaluated = {part: (eng.distribute(input_fn), steps)
                 for part, (input_fn, steps) in evaluations.items()}
    records = []
    first_epoch = eng.step // steps_per_epoch
    if first_epoch < epochs:
        for action in actions:
            action.train_begin()
    for epoch in range(first_epoch, epochs):
        offset = eng.step - epoch * steps_per_epoch  # > 0 when resuming mid-epoch
        if not offset:  # resumed mid-epoch: the metrics of its steps so far are restored
            eng.reset_train_metrics()
        for action in actions:
            action.epoch_begin(epoch, offset)
        start = time.perf_counter()
        spent = timing.Spent(eng.workers)  # where the epoch's seconds go, by the step's clocks
        # (steps, their mean loss) this epoch before the call
        before = (offset, eng.train_results().get("loss", 0.0) if offset else 0.0)
        done, ended = 0, False
        for action in actions:
            action.call_begin(offset)
        for done, stopping in calls(steps_per_epoch - offset, spent):
            # Reading the metrics waits for the steps: the timer below is honest.
            trained = eng.train_results()
            loss = trained.get("loss", float("nan"))  # a model's own step may log none
            call_loss = ((loss * (offset + done) - before[1] * before[0])  # every step
                         / (offset + done - before[0]))  # weighs the same
            before = (offset + done, loss)
            call = CallEnd(epoch, eng.step, offset + done, steps_per_epoch, trained, call_loss,
                           eng.learning_rate(), stopping)
            ended = any([action.call_end(call) for action in actions])  # each one called
            if ended:
                break
            if not call.last:
                for action in actions:
                    action.call_begin(call.done)
        seconds = time.perf_counter() - start
        record = epoch_record(eng, evaluated, actions, epoch, trained, seconds,
                              done * eng.global_batch_size / seconds, peak_flops,
                              spent.figures(eng.worker_index, seconds))
        if offset:  # an epoch this run began mid-way (a resume): the step it trained from
            record.resumed_at_step = epoch * steps_per_epoch + offset + 1
        records.append(record)
        if any([action.epoch_end(record) for action in actions]) or ended:  # each one called
            break
    if records and any([action.train_end(records) for action in actions]):
        figures, counted = evaluations_of(eng, evaluated)
        records[-1].evaluated, records[-1].examples = figures, counted
        records[-1].weights_set_by_callbacks = True
        for action in actions:
            action.weights_set(records[-1])
    return [record.row() for record in records]


def epoch_record(eng, evaluated, actions, epoch, trained, seconds, speed, peak_flops, spent):
    """The epoch's EpochRecord: its training figures, each evaluation (the actions told
    around each), its times."""
    start = time.perf_counter()
    figures, counted = evaluations_of(eng, evaluated, actions)
    cost = flops.step_cost(eng)
    peak = peak_flops.of_step(cost.kernels) if peak_flops is not None else None
    return EpochRecord(
        epoch=epoch + 1, step=eng.step, trained=trained, evaluated=figures, examples=counted,
        seconds=seconds, eval_seconds=time.perf_counter() - start, images_per_sec=speed,
        timing=spent, learning_rate=eng.learning_rate(),
        mfu=flops.utilization(cost.per_example, speed, peak),
        peak_gflops=peak / 1e9 if peak else None,
        peak_source=peak_flops.source if peak_flops is not None else "")


def evaluations_of(eng, evaluated, actions=()):
    """({part: its figures}, {part: examples counted}) of each part of `evaluated` in full,
    the actions told before and after each."""
    figures, counted = {}, {}
    for part, (dataset, steps) in evaluated.items():
        for action in actions:
            action.evaluation_begin(part)
        figures[part], counted[part] = eng.evaluate(dataset, steps)
        for action in actions:
            action.evaluation_end(part, figures[part])
    return figures, counted


def stopped_by_callbacks(history):
    """Whether the run's last epoch row says your callbacks stopped it (it is complete)."""
    return bool(history) and bool(history[-1].get(STOPPED_BY_CALLBACKS))
