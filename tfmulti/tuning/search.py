"""The search: the hypermodel, keras-tuner's tuners running one process per trial.

A trial's settings are the session's RunConfig with the searched values put in
(trial_settings), so a trial trains exactly as `tfmulti.main` with those flags would, and
its global batch and learning rate are the plan's (run/plan.py), as the main job's are.
"""
import dataclasses
import json
import os
import time

import keras_tuner as kt

from tfmulti.errors import UsageError
from tfmulti.models import usermodel, zoo
from tfmulti.processes import child
from tfmulti.run.plan import run_plan
from tfmulti.tuning import keras_tuner_fixes, parallel_trials

TUNERS = ("random", "bayesian", "hyperband")
OBJECTIVE = "test_acc"


def trial_settings(base, values, epochs=None):
    """The RunConfig of a trial: `base` with the searched values (RunConfig field -> value)
    put in, its batch given per replica. Raises RunConfig's UsageError for a value it
    refuses, and the plan's for a batch that cannot work."""
    cfg = dataclasses.replace(base, global_batch_size=None, epochs=epochs or base.epochs,
                              **values)
    run_plan(cfg, 1)  # the plan's rules too (the batch splits into the micro-batches)
    return cfg


class TrainingHyperModel(kt.HyperModel):
    """build(hp): the search space and the main job's model; each trial trains in a process
    of its own (run_trial), on every device of `plan`, with the main job's engine.

    choices: RunConfig field -> the values to try (one value: fixed); a field not given keeps
    the value of `base`. base_lr is searched on a log scale over lr_range.

    A process per trial is the isolation: TensorFlow keeps each trial's traced functions and
    input pipelines, and a tuner running trials in one process grew by about 35 MB a trial
    (measured, with or without keras.backend.clear_session()); a child process gives all of
    it back, and starts a runtime with its own logical devices.
    """

    def __init__(self, plan, dataset, base, choices, lr_range, threads=(0, 0)):
        super().__init__(name="tfmulti")
        self.plan, self.dataset, self.base, self.threads = plan, dataset, base, threads
        self.epochs = base.epochs
        self.choices = {name: list(values) for name, values in choices.items()}
        self.lr_range = tuple(lr_range)

    def searched(self):
        """The searched names in the order keras-tuner draws them (kept: a session resumed
        draws as it drew before): the batch, base_lr, then the rest as given."""
        names = [n for n in self.choices if n != "per_replica_batch_size"]
        first = ["per_replica_batch_size"] if "per_replica_batch_size" in self.choices else []
        return first + ["base_lr"] + names

    def build(self, hp):
        for name in self.searched():
            values = self.choices.get(name)
            if name == "base_lr":
                hp.Float("base_lr", *self.lr_range, sampling="log")
            elif len(values) == 1:
                hp.Fixed(name, values[0])
            else:
                hp.Choice(name, values)
        cfg = self.base  # your model's own hyperparameters (an hp parameter) join the space;
        for name, value in json.loads(cfg.model_hparams or "{}").items():  # those given: fixed
            hp.Fixed(usermodel.scoped(name), value)
        return zoo.build(cfg.model, cfg.width, self.dataset.input_shape,
                            self.dataset.num_classes, dtype=cfg.dtype, init=cfg.init,
                            seed=cfg.seed, hp=hp)

    def trial_config(self, hp, epochs=None):
        """The RunConfig a trial trains with (and best.cfg holds). A trial of a session begun
        before a hyperparameter was searched has the value it trained with: the default.
        Your model's hyperparameters (the others hp holds) go in as --model_hparams."""
        values = {name: hp.values.get(name, getattr(self.base, name))
                  for name in self.searched()}
        own = usermodel.yours(hp.values)  # your names, as you wrote them
        if own:
            values["model_hparams"] = json.dumps(own, sort_keys=True, separators=(",", ":"))
        return trial_settings(self.base, values, epochs)

    def run_trial(self, hp, epochs=None):
        """Trains one trial in a child process; returns its metrics or raises its error."""
        try:
            status, payload = child.run(_train_trial, (self.plan, self.dataset,
                                                       self.trial_config(hp, epochs),
                                                       self.threads), what="the trial's process")
        except child.Died as e:
            status, payload = "error", str(e)
        if status != "ok":
            raise RuntimeError(payload)
        return payload


def check_objective(cfg, dataset):
    """UsageError, before the first trial, when the model reports no accuracy (a session
    chooses by test accuracy): your model is built once here, on the CPU, to see what it
    reports."""
    if not usermodel.is_spec(cfg.model):
        return  # tfmulti's models are classifiers
    from tfmulti.models.task import ACCURACY, Task

    model = zoo.build(cfg.model, cfg.width, dataset.input_shape, dataset.num_classes,
                      hp=kt.HyperParameters(), hparams=cfg.model_hparams)
    names = Task(model, dataset, cfg.model).metric_names
    if ACCURACY not in names:
        raise UsageError(f"--model={cfg.model} reports {', '.join(['loss', *names])} and no "
                         "accuracy; a tuning session chooses its trials by test accuracy "
                         "(another objective is not built yet): tune a classifier")


def trial_metrics(cfg, replicas, accuracy, seconds):
    """What a trial reports: its accuracy and time, and the global batch and learning rate
    it trained with (the plan's, as the engine got them)."""
    resolved = run_plan(cfg, replicas)
    return {OBJECTIVE: accuracy, "learning_rate": resolved.learning_rate,
            "global_batch_size": resolved.global_batch_size, "seconds": seconds}


def _train_trial(send, plan, dataset, cfg, threads):
    """The child process of one trial: the main job on its devices; sends the metrics."""
    try:
        from tfmulti.distribution import startup
        from tfmulti.training import train

        strategy = startup.Startup(plan, threads=threads).start()
        start = time.perf_counter()
        try:
            _, history = train.train_and_evaluate(strategy, dataset, cfg, verbose=0)
            accuracy = history[-1]["test_acc"]
        except FloatingPointError:
            accuracy = 0.0  # a diverged rate is a poor result, not a broken trial
        send.send(("ok", trial_metrics(cfg, strategy.num_replicas_in_sync, accuracy,
                                       time.perf_counter() - start)))
    except Exception as e:  # the parent marks the trial failed (after its retries)
        send.send(("error", f"{type(e).__name__}: {e}"))


class _Isolated:
    """Mixed into each tuner: every trial runs in its own process (see TrainingHyperModel)."""

    def run_trial(self, trial, *args, **kwargs):
        return self.hypermodel.run_trial(trial.hyperparameters, kwargs.get("epochs"))

    def reload(self):
        """A trial left RUNNING by a kill goes back in the retry queue (keras_tuner_fixes)."""
        super().reload()
        if not self._is_worker():
            keras_tuner_fixes.requeue_running(self.oracle)

    def on_trial_end(self, trial):
        super().on_trial_end(trial)
        if self._is_worker():  # the chief shows the session; a worker logs what it ran
            print(f"{self.tuner_id}: trial {trial.trial_id} {trial.status}"
                  f"{': ' + trial.message.strip().splitlines()[-1] if trial.message else ''}",
                  flush=True)


class RandomSearch(_Isolated, kt.RandomSearch):
    pass


class BayesianOptimization(_Isolated, kt.BayesianOptimization):
    pass


class Hyperband(_Isolated, kt.Hyperband):
    """Epochs are the budget: each trial trains anew for its bracket's epochs (a trial's
    process keeps no weights to warm-start the next bracket from)."""

    def run_trial(self, trial, *args, **kwargs):
        return self.hypermodel.run_trial(trial.hyperparameters,
                                         trial.hyperparameters.values["tuner/epochs"])


def make_tuner(kind, hypermodel, directory, max_trials, max_retries_per_trial=0, seed=0):
    _keep_session(directory)
    common = dict(objective=kt.Objective(OBJECTIVE, "max"), directory=directory,
                  project_name="trials", overwrite=False, seed=seed,
                  max_retries_per_trial=max_retries_per_trial,
                  max_consecutive_failed_trials=max(3, max_retries_per_trial + 2))
    if kind == "random":
        return RandomSearch(hypermodel, max_trials=max_trials, **common)
    if kind == "bayesian":
        return BayesianOptimization(hypermodel, max_trials=max_trials, **common)
    if kind == "hyperband":
        return Hyperband(hypermodel, max_epochs=hypermodel.epochs, factor=3, **common)
    raise ValueError(f"unknown tuner {kind!r}")


def _keep_session(directory):
    """keras-tuner reloads a session only if this process's tuner file exists (tuner0.json
    serial, chief.json parallel); without it, it would start over and write over trial_0.
    The file holds no state ({}), so a session begun one way resumes the other way too."""
    tuner_id = os.environ.get("KERASTUNER_TUNER_ID", "tuner0")
    project = os.path.join(directory, "trials")
    own = os.path.join(project, f"{tuner_id}.json")
    if (parallel_trials.role().leads and os.path.exists(os.path.join(project, "oracle.json"))
            and not os.path.exists(own)):
        with open(own, "w") as f:
            f.write("{}")
