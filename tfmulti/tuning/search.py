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
DIRECTIONS = ("min", "max")
# Suffixes of metric names whose direction is known beyond keras-tuner's list (which knows
# "accuracy" and "mae", not "kind_accuracy" or "val_auc_1")
RISING = ("accuracy", "acc", "auc", "precision", "recall", "iou", "f1_score", "fbeta_score")


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
    the value of `base`. base_lr is searched on a log scale over lr_range.

    A process per trial is the isolation: TensorFlow keeps each trial's traced functions and
    input pipelines, and a tuner running trials in one process grew by about 35 MB a trial
    (measured, with or without keras.backend.clear_session()); a child process gives all of
    it back, and starts a runtime with its own logical devices.
    """

    def __init__(self, plan, dataset, base, choices, lr_range, objective, threads=(0, 0)):
        super().__init__(name="tfmulti")
        if not base.validation_split:
            raise ValueError("a session's trials are scored on a validation part")
        self.plan, self.dataset, self.base, self.threads = plan, dataset, base, threads
        self.objective = objective
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
                                                       self.threads, self.objective),
                                        what="the trial's process")
        except child.Died as e:
            status, payload = "error", str(e)
        if status != "ok":
            raise RuntimeError(payload)
        return payload


@dataclasses.dataclass(frozen=True)
class SessionObjective:
    """What a session maximizes or minimizes: a figure of the validation part at the last
    epoch of each trial, named as Keras names it (val_loss, val_accuracy, val_mae)."""
    name: str
    direction: str  # "min" or "max"
    key: str  # its key in an epoch record (val_acc for val_accuracy)

    def kt(self):
        return kt.Objective(self.name, self.direction)

    def better(self, a, b):
        return a > b if self.direction == "max" else a < b

    @property
    def worst(self):
        """What a diverged trial scores: the worst there is (0 for a rising figure, which
        are all 0 or more)."""
        return 0.0 if self.direction == "max" else float("inf")


def session_objective(cfg, dataset, text=""):
    """The SessionObjective of --objective=NAME[:min|max] (default: val_accuracy for a
    classifier, else val_loss): a validation figure the model reports. UsageError, before
    the first trial, for a name it does not report, a test figure, or a direction that
    cannot be told. Your model is built once here, on the CPU, to see what it reports."""
    from tfmulti.models.task import ACCURACY, Task, record_key

    if usermodel.is_spec(cfg.model):
        model = zoo.build(cfg.model, cfg.width, dataset.input_shape, dataset.num_classes,
                          hp=kt.HyperParameters(), hparams=cfg.model_hparams)
        task = Task(model, dataset, cfg.model)
        names, classifier = task.metric_names, task.classifier
    else:
        names, classifier = [ACCURACY], True  # tfmulti's models are classifiers
    name, _, direction = (text or ("val_accuracy" if ACCURACY in names else "val_loss")
                          ).partition(":")
    offered = ["val_loss", *(f"val_{n}" for n in names)]
    metric = "accuracy" if name == "val_acc" and ACCURACY in names else name[len("val_"):]
    if name.startswith("test_") or name in ("loss", "accuracy", *names):
        raise UsageError(f"--objective={text}: a session chooses its trials on the validation "
                         f"part (--validation_split), never on the test set or the training "
                         f"figures; choose one of {', '.join(offered)}")
    if f"val_{metric}" not in offered:
        raise UsageError(f"--objective={text}: --model={cfg.model} reports "
                         f"{', '.join(offered)} on the validation part"
                         + ("" if classifier else " (it is not a classifier: no accuracy)"))
    if direction and direction not in DIRECTIONS:
        raise UsageError(f"--objective={text}: the direction after ':' is min or max")
    direction = direction or _direction(f"val_{metric}")
    if direction is None:
        raise UsageError(f"--objective={text}: say whether higher or lower is better: "
                         f"--objective={name}:max or {name}:min")
    return SessionObjective(f"val_{metric}", direction,
                            "val_loss" if metric == "loss" else record_key("val", metric))


def _direction(name):
    """"min" or "max" for a metric name keras-tuner knows or whose last words are one of
    RISING (max) or a loss or error (min); None otherwise."""
    from keras_tuner.src.engine import metrics_tracking

    words = name.split("_")
    for i in range(len(words)):
        tail = "_".join(words[i:])
        known = metrics_tracking.infer_metric_direction(tail)
        if known is not None:
            return known
        if tail in RISING:
            return "max"
        if tail in ("loss", "error") or tail.endswith(("_loss", "_error")):
            return "min"
    return None


def trial_metrics(cfg, replicas, objective, value, seconds):
    """What a trial reports: its objective and time, and the global batch and learning rate
    it trained with (the plan's, as the engine got them)."""
    resolved = run_plan(cfg, replicas)
    return {objective.name: value, "learning_rate": resolved.learning_rate,
            "global_batch_size": resolved.global_batch_size, "seconds": seconds}


def _train_trial(send, plan, dataset, cfg, threads, objective):
    """The child process of one trial: the main job on its devices, evaluated on the
    validation part only (the test set stays untouched); sends the metrics."""
    try:
        from tfmulti.distribution import startup
        from tfmulti.training import train

        strategy = startup.Startup(plan, threads=threads,
                                   seed=cfg.seed if cfg.deterministic else None).start()
        start = time.perf_counter()
        try:
            _, history = train.train_and_evaluate(strategy, dataset, cfg, verbose=0, test=False)
            value = history[-1][objective.key]
        except FloatingPointError:
            value = objective.worst  # a diverged rate is a poor result, not a broken trial
        send.send(("ok", trial_metrics(cfg, strategy.num_replicas_in_sync, objective, value,
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
        with open(own, "w") as f:
            f.write("{}")
