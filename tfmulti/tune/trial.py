"""One trial in its process: the main job, trained in a run folder of its own inside the
session (trials/trial_<id>/run/: run.json, metrics.json per epoch, TensorBoard, checkpoints
while it trains), scored on the validation part alone; stopped early when --prune=median
finds it hopeless; its hyperparameters written for TensorBoard's HParams dashboard.

A trial's folder is a run's: a trial whose process was killed resumes from its checkpoint
when keras-tuner runs it again (a retry, or a resumed session)."""
from __future__ import annotations

import dataclasses
import glob
import json
import os
import statistics
import time
from typing import TYPE_CHECKING, Any

from tfmulti.distribution import startup, storage
from tfmulti.run.plan import run_plan
from tfmulti.rundir.names import METRICS_FILE

if TYPE_CHECKING:
    from tfmulti.data.dataset import DataSet
    from tfmulti.distribution.devices import DevicePlan
    from tfmulti.run.config import RunConfig
    from tfmulti.tune.objective import SessionObjective

RUN_DIR = "run"  # inside keras-tuner's trials/trial_<id>/
PRUNES = ("none", "median")
# A trial is compared only with completed trials (Optuna's MedianPruner counts those too), and
# only once this many have reached its epoch (Optuna waits for 5; sessions here are smaller).
PRUNE_STARTUP_TRIALS = 3
HPARAMS_DIR = "tensorboard"  # the session's: its HParams experiment (the trials' own runs
# hold each trial's hyperparameters and figures)


@dataclasses.dataclass(frozen=True)
class TrialWork:
    """What a trial's process is given (pickled into it)."""
    plan: DevicePlan
    dataset: DataSet
    cfg: RunConfig
    threads: tuple[int, int]
    objective: SessionObjective
    folder: str  # the trial's run folder
    trial_id: str
    hparams: dict[str, Any]  # every hyperparameter of the trial, keras-tuner's names
    prune: str = "none"


class Pruned(Exception):
    """The trial is worse than the median of the completed trials at this epoch."""

    def __init__(self, record, median, count):
        super().__init__(f"pruned at epoch {record['epoch']}")
        self.record, self.median, self.count = record, median, count


def trial_metrics(cfg, replicas, objective, value, seconds, pruned=0, learning_rate=None):
    """What a trial reports: its objective and time, the global batch and learning rate it
    trained with (learning_rate: the run's, as its metrics.json says: a model's own compiled
    rate where it kept it; else the plan's, as the engine got them), and the epoch it was
    pruned at (0: not pruned)."""
    resolved = run_plan(cfg, replicas)
    rate = resolved.learning_rate if learning_rate is None else learning_rate
    return {objective.name: value, "learning_rate": rate,
            "global_batch_size": resolved.global_batch_size, "seconds": seconds,
            "pruned": pruned}


def run_folder(trial_dir: str) -> str:
    return os.path.join(trial_dir, RUN_DIR)


def trial_history(trial_dir: str) -> tuple[list[dict[str, Any]], bool]:
    """(the epoch records of the trial's run, whether it completed); ([], False) before its
    first epoch."""
    path = os.path.join(run_folder(trial_dir), METRICS_FILE)
    try:
        with open(path) as f:
            metrics = json.load(f)
    except (OSError, ValueError):
        return [], False
    return metrics.get("epochs", []), "summary" in metrics


def median_rule(work: TrialWork):
    """after_epoch for train_and_evaluate: raises Pruned when the trial's objective at an
    epoch (not its last: stopping then saves nothing) is worse than the median of the
    completed trials' at the same epoch, once PRUNE_STARTUP_TRIALS of them reached it."""
    trials = os.path.dirname(os.path.dirname(work.folder))  # .../trials/trial_<id>/run

    def after_epoch(record):
        if record["epoch"] >= work.cfg.epochs:
            return
        others = []
        for trial_dir in glob.glob(os.path.join(trials, "trial_*")):
            if os.path.basename(trial_dir) == f"trial_{work.trial_id}":
                continue
            history, completed = trial_history(trial_dir)
            figures = [r[work.objective.key] for r in history if r["epoch"] == record["epoch"]]
            if completed and figures:
                others.append(figures[-1])
        if len(others) < PRUNE_STARTUP_TRIALS:
            return
        median = statistics.median(others)
        if work.objective.better(median, record[work.objective.key]):
            raise Pruned(record, median, len(others))

    return after_epoch


def train_trial(send, work: TrialWork):
    """The child process of one trial: the main job on its devices in the trial's run
    folder, evaluated on the validation part only (the test set stays untouched); sends
    the metrics. Its checkpoints are removed once it ends (its figures stay)."""
    try:
        from tfmulti.training import loop, train

        strategy = startup.Startup(work.plan, threads=work.threads,
                                   seed=work.cfg.seed if work.cfg.deterministic else None).start()
        write_hparams(work)
        start, pruned = time.perf_counter(), 0
        try:
            rule = median_rule(work) if work.prune == "median" else None
            _, history = train.train_and_evaluate(
                strategy, work.dataset, work.cfg, model_dir=work.folder, verbose=0, test=False,
                write_model=False, after_epoch=rule)
            value = history[-1][work.objective.key]
        except Pruned as e:
            value, pruned = e.record[work.objective.key], e.record["epoch"]
        except loop.Preempted as e:  # SIGTERM or Ctrl-C: the checkpoint is kept to go on from
            send.send(("stopped", {"by": e.by, "step": e.step}))
            return
        except FloatingPointError:
            value = work.objective.worst  # a diverged rate is a poor result, not a broken trial
        storage.remove(os.path.join(work.folder, "checkpoints"))
        send.send(("ok", trial_metrics(work.cfg, strategy.num_replicas_in_sync, work.objective,
                                       value, time.perf_counter() - start, pruned,
                                       _trained_rate(work.folder))))
    except Exception as e:  # the parent marks the trial failed (after its retries)
        send.send(("error", f"{type(e).__name__}: {e}"))


def _trained_rate(folder):
    """The learning rate the trial's run trained with (its metrics.json), None if unsaid."""
    path = os.path.join(folder, METRICS_FILE)
    return storage.read_json(path).get("learning_rate") if storage.exists(path) else None


def _plain(value):
    return value if isinstance(value, (bool, int, float, str)) else str(value)


def write_hparams(work: TrialWork) -> None:
    """The trial's hyperparameters for TensorBoard's HParams dashboard, in its run's
    tensorboard/ (its figures are in tensorboard/val/, the metric group the session's
    experiment names)."""
    import tensorflow as tf
    from tensorboard.plugins.hparams import api as hp

    with tf.summary.create_file_writer(os.path.join(work.folder, "tensorboard")).as_default():
        hp.hparams({name: _plain(v) for name, v in work.hparams.items()},
                   trial_id=f"trial_{work.trial_id}")


def write_experiment(session_dir: str, space: list, objective: SessionObjective) -> None:
    """The session's HParams experiment (once, in <session>/tensorboard/): every searched
    hyperparameter with its domain, and the objective and validation loss as metrics."""
    folder = os.path.join(session_dir, HPARAMS_DIR)
    if os.path.isdir(folder):
        return
    import keras_tuner as kt
    import tensorflow as tf
    from tensorboard.plugins.hparams import api as hp

    def domain(h):
        if isinstance(h, kt.engine.hyperparameters.Choice):
            return hp.Discrete([_plain(v) for v in h.values])
        if isinstance(h, kt.engine.hyperparameters.Boolean):
            return hp.Discrete([False, True])
        if isinstance(h, kt.engine.hyperparameters.Int):
            return hp.IntInterval(h.min_value, h.max_value)
        if isinstance(h, kt.engine.hyperparameters.Float):
            return hp.RealInterval(float(h.min_value), float(h.max_value))
        return hp.Discrete([_plain(h.value)])  # Fixed

    tags = dict.fromkeys([objective.tag, "epoch_loss"])
    with tf.summary.create_file_writer(folder).as_default():
        hp.hparams_config(
            hparams=[hp.HParam(h.name, domain(h)) for h in space
                     if not h.name.startswith("tuner/")],
            metrics=[hp.Metric(tag, group="val", display_name=f"val_{tag[len('epoch_'):]}")
                     for tag in tags])
