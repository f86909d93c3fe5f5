"""The search: the hypermodel, keras-tuner's tuners running one process per trial.

A trial's settings are the session's RunConfig with the searched values put in
(trial_settings), so a trial trains exactly as `tfmulti.main` with those flags would, and
its global batch and learning rate are the plan's (run/plan.py), as the main job's are.
"""
import dataclasses
import json
import os

import keras_tuner as kt
from keras_tuner.src.distribute import utils as dist_utils

from tfmulti.distribution import storage
from tfmulti.models import usermodel, zoo
from tfmulti.processes import child
from tfmulti.run.plan import run_plan
from tfmulti.tune import keras_tuner_fixes, parallel_trials, stopping, trial

TUNERS = ("random", "bayesian", "hyperband")


def trial_settings(base, values, epochs=None, replicas=1, train_examples=None):
    """The RunConfig of a trial: `base` with the searched values (RunConfig field -> value)
    put in, its batch given per replica. Raises RunConfig's UsageError for a value it
    refuses, and the plan's for a batch that cannot work (on `replicas`, and on
    train_examples when given)."""
    cfg = dataclasses.replace(base, global_batch_size=None, epochs=epochs or base.epochs,
                              **values)
    run_plan(cfg, replicas, train_examples, 0 if train_examples else None)
    return cfg


class TrainingHyperModel(kt.HyperModel):
    """build(hp): the search space and the main job's model; each trial trains in a process
    of its own (run_trial), on every device of `plan`, with the main job's engine.

    choices: RunConfig field -> the values to try (one value: fixed); a field not given keeps
    the value of `base`. base_lr is searched on a log scale over lr_range (empty: not
    searched, nor a choice without values: runner.own_rate).

    A process per trial is the isolation: TensorFlow keeps each trial's traced functions and
    input pipelines, and a tuner running trials in one process grew by about 35 MB a trial
    (measured, with or without keras.backend.clear_session()); a child process gives all of
    it back, and starts a runtime with its own logical devices.
    """

    def __init__(self, plan, dataset, base, choices, lr_range, objective, threads=(0, 0),
                 prune="none"):
        super().__init__(name="tfmulti")
        if not base.validation_split and not base.validation_set:
            raise ValueError("a session's trials are scored on a validation part")
        self.plan, self.dataset, self.base, self.threads = plan, dataset, base, threads
        self.objective, self.prune = objective, prune
        self.stopper = stopping.TrialStopper()  # installed by the process that runs trials
        self.epochs = base.epochs
        self.choices = {name: list(values) for name, values in choices.items()}
        self.lr_range = tuple(lr_range)

    def searched(self):
        """The searched names in the order keras-tuner draws them (kept: a session resumed
        draws as it drew before): the batch, base_lr, then the rest as given."""
        names = [n for n in self.choices if n != "per_replica_batch_size" and self.choices[n]]
        first = ["per_replica_batch_size"] if "per_replica_batch_size" in self.choices else []
        return first + (["base_lr"] if self.lr_range else []) + names

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

    def run_trial(self, hp, epochs=None, trial_dir=None, trial_id="0"):
        """Trains one trial in a child process, in a run folder in keras-tuner's trial_dir;
        returns its metrics or raises its error."""
        work = trial.TrialWork(
            self.plan, self.dataset, self.trial_config(hp, epochs), self.threads,
            self.objective, trial.run_folder(trial_dir), trial_id,
            {name: v for name, v in hp.values.items() if not name.startswith("tuner/")},
            self.prune)
        self.stopper.check()
        try:
            status, payload = child.run(trial.train_trial, (work,), what="the trial's process",
                                        started=self.stopper.started)
        except child.Died as e:
            if self.stopper.by:  # SIGTERM reached it before it could save: go on from before
                raise stopping.SessionStopped(self.stopper.by,
                                              f" as trial {trial_id} was starting") from None
            status, payload = "error", str(e)
        if status == "stopped":  # SIGTERM or Ctrl-C: its checkpoint saved
            raise stopping.SessionStopped(payload["by"], f" in trial {trial_id} at its step "
                                                         f"{payload['step']}, checkpoint saved")
        if status != "ok":
            raise RuntimeError(payload)
        return payload


class _Isolated:
    """Mixed into each tuner: every trial runs in its own process (see TrainingHyperModel)."""

    def run_trial(self, trial, *args, **kwargs):
        return self.hypermodel.run_trial(trial.hyperparameters, kwargs.get("epochs"),
                                         self.get_trial_dir(trial.trial_id), trial.trial_id)

    def reload(self):
        """A trial left RUNNING by a kill goes back in the retry queue (keras_tuner_fixes)."""
        super().reload()
        if not self._is_worker():
            keras_tuner_fixes.requeue_running(self.oracle)

    def on_trial_end(self, trial):
        super().on_trial_end(trial)
        # The serial session shows the table; a process of a distributed one (a worker, or
        # task 0 of srun's step, which runs trials too) logs what it ran
        if dist_utils.has_chief_oracle():
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
                                         trial.hyperparameters.values["tuner/epochs"],
                                         self.get_trial_dir(trial.trial_id), trial.trial_id)


def make_tuner(kind, hypermodel, directory, max_trials, max_retries_per_trial=0, seed=0):
    _keep_session(directory)
    common = dict(objective=hypermodel.objective.kt(), directory=directory,
                  project_name="trials", overwrite=False, seed=oracle_seed(seed),
                  max_retries_per_trial=max_retries_per_trial,
                  max_consecutive_failed_trials=max(3, max_retries_per_trial + 2))
    if kind == "random":
        return RandomSearch(hypermodel, max_trials=max_trials, **common)
    if kind == "bayesian":
        return BayesianOptimization(hypermodel, max_trials=max_trials, **common)
    if kind == "hyperband":
        return Hyperband(hypermodel, max_epochs=hypermodel.epochs, factor=3, **common)
    raise ValueError(f"unknown tuner {kind!r}")


def oracle_seed(seed):
    """keras-tuner's seed for --seed: keras-tuner takes 0 for "none" and draws a seed at
    random (`seed or random.randint(1, 10000)`), so the default --seed=0 drew other trials
    on every run; --seed=N is N + 1 for it (a negative seed stays as it is)."""
    return seed + 1 if seed >= 0 else seed


def _keep_session(directory):
    """keras-tuner reloads a session only if this process's tuner file exists (tuner0.json
    serial, chief.json parallel); without it, it would start over and write over trial_0.
    The file holds no state ({}), so a session begun one way resumes the other way too."""
    tuner_id = os.environ.get("KERASTUNER_TUNER_ID", "tuner0")
    project = os.path.join(directory, "trials")
    own = os.path.join(project, f"{tuner_id}.json")
    if (parallel_trials.role().leads and os.path.exists(os.path.join(project, "oracle.json"))
            and not os.path.exists(own)):
        storage.write_bytes(own, b"{}")
