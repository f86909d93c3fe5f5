"""Tuning sessions: keras-tuner finds the batch size and learning rate for your devices.

    python -m tfmulti.tune --flagfile=flags/tune.cfg
    python -m tfmulti.tune --flagfile=flags/tune_smoke.cfg        # CPU, minutes

Large batches need larger learning rates (Goyal et al. 2017: the linear scaling rule with
gradual warm-up, which breaks down at very large batches). Each trial trains the main job's
model with the main job's engine on every device, at learning rate
base_lr x rule(global_batch / 256); the search picks the per-replica batch, base_lr, the rule
and the warm-up. The session lives in --model_dir: rerun the same command after an
interruption and finished trials are kept, the unfinished one runs again. It ends with a table
(printed and trials.csv), a plot (accuracy.png: accuracy against learning rate, coloured by
batch) and best.cfg, a flagfile `python -m tfmulti.main --flagfile=...` runs as is.

--parallel_trials=K runs K trials at once, each on an equal share of the devices, through
keras-tuner's distributed mode (tfmulti/parallel_trials.py). The same program is also a plain
keras-tuner chief or worker when KERASTUNER_TUNER_ID/_ORACLE_IP/_ORACLE_PORT are set.
"""
import csv
import dataclasses
import json
import os
import tempfile
import sys
import time

from tfmulti import cli  # first: as `python -m tfmulti.tune` it imports TensorFlow quietly
import keras_tuner as kt  # noqa: E402
from keras_tuner.src import utils as kt_utils  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfmulti.distribution import child  # noqa: E402
from tfmulti.run import hparams
from tfmulti.training import models, rundir
from tfmulti.tuning import parallel_trials

def _atomic_save_json(path, obj, _in_place=kt_utils.save_json):
    """keras-tuner writes its state (oracle.json, trial.json) in place: a kill during the write
    left an empty oracle.json and a session that cannot be resumed (seen in CI). Local files
    are written whole to a temporary file first and renamed over the old one."""
    if "://" in str(path):
        return _in_place(path, obj)
    text = json.dumps(obj)
    directory = os.path.dirname(os.path.abspath(path))
    with tempfile.NamedTemporaryFile("w", dir=directory, suffix=".tmp", delete=False) as f:
        f.write(text)
    os.replace(f.name, path)
    return text


kt_utils.save_json = _atomic_save_json  # every keras-tuner state file goes through it

TUNERS = ("random", "bayesian", "hyperband")
OBJECTIVE = "test_acc"


class TrainingHyperModel(kt.HyperModel):
    """build(hp): the search space and the main job's model; each trial trains in a process
    of its own (run_trial), on every device of `plan`, with the main job's engine. A trial's
    settings are the session's RunConfig `base` with the searched values put in
    (trial_config), so a trial trains exactly as `tfmulti.main` with those flags would.

    A process per trial is the isolation: TensorFlow keeps each trial's traced functions and
    input pipelines, and a tuner running trials in one process grew by about 35 MB a trial
    (measured, with or without keras.backend.clear_session()); a child process gives all of
    it back, and starts a runtime with its own logical devices.
    """

    def __init__(self, plan, dataset, base, *, batch_choices=(64, 128, 256),
                 lr_range=(0.01, 1.0), rules=("linear", "sqrt"), warmup_choices=(0.0, 1.0),
                 schedules=("constant",), momentums=(0.0,), weight_decays=(0.0,),
                 threads=(0, 0)):
        super().__init__(name="tfmulti")
        self.plan, self.dataset, self.base, self.threads = plan, dataset, base, threads
        self.epochs = base.epochs
        self.choices = {"per_replica_batch_size": list(batch_choices), "lr_scaling": list(rules),
                        "warmup_epochs": list(warmup_choices), "lr_schedule": list(schedules),
                        "momentum": list(momentums), "weight_decay": list(weight_decays)}
        self.lr_range = lr_range

    def build(self, hp):
        for name, values in self.choices.items():
            if name == "lr_scaling":  # the order the search draws them in
                hp.Float("base_lr", *self.lr_range, sampling="log")
            if len(values) == 1:
                hp.Fixed(name, values[0])
            else:
                hp.Choice(name, values)
        cfg = self.base
        return models.build(cfg.model, cfg.width, dtype=cfg.dtype, init=cfg.init, seed=cfg.seed)

    def trial_config(self, hp, epochs=None):
        """The RunConfig a trial trains with (and best.cfg holds). A trial of a session begun
        before a hyperparameter was searched has the value it trained with: the default."""
        values = {name: hp.values.get(name, getattr(self.base, name))
                  for name in ["base_lr", *self.choices]}
        return dataclasses.replace(self.base, global_batch_size=None,
                                   epochs=epochs or self.base.epochs, **values)

    def learning_rate(self, hp):
        """The rate a trial trains with: base_lr x rule(global_batch / 256)."""
        global_batch = hp.get("per_replica_batch_size") * self.plan.count
        return hparams.scaled_learning_rate(hp.get("base_lr"), global_batch, hp.get("lr_scaling"))

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


def _train_trial(send, plan, dataset, cfg, threads):
    """The child process of one trial: the main job on its devices; sends the metrics."""
    try:
        from tfmulti.distribution import devices
        from tfmulti.training import train

        devices.configure(plan, *threads)
        strategy = devices.make_strategy(plan)
        _, global_batch = cfg.batch_sizes(strategy.num_replicas_in_sync)
        start = time.perf_counter()
        try:
            _, history = train.train_and_evaluate(strategy, dataset, cfg, verbose=0)
            accuracy = history[-1]["test_acc"]
        except FloatingPointError:
            accuracy = 0.0  # a diverged rate is a poor result, not a broken trial
        send.send(("ok", {OBJECTIVE: accuracy, "learning_rate": hparams.scaled_learning_rate(
                              cfg.base_lr, global_batch, cfg.lr_scaling),
                          "global_batch_size": global_batch,
                          "seconds": time.perf_counter() - start}))
    except Exception as e:  # the parent marks the trial failed (after its retries)
        send.send(("error", f"{type(e).__name__}: {e}"))


class _Isolated:
    """Mixed into each tuner: every trial runs in its own process (see TrainingHyperModel)."""

    def run_trial(self, trial, *args, **kwargs):
        return self.hypermodel.run_trial(trial.hyperparameters, kwargs.get("epochs"))

    def reload(self):
        """keras-tuner writes a new trial's trial.json before the oracle.json that lists it; a
        kill in between left that trial RUNNING for ever (never rerun, never counted as done).
        Such trials go back in the retry queue, as the ongoing ones do on reload."""
        super().reload()
        if self._is_worker():
            return
        oracle = self.oracle
        for trial in oracle.trials.values():
            if (trial.status == kt.engine.trial.TrialStatus.RUNNING
                    and trial.trial_id not in oracle._retry_queue):
                oracle._retry_queue.append(trial.trial_id)

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
    if (parallel_trials.role() != "worker" and os.path.exists(os.path.join(project, "oracle.json"))
            and not os.path.exists(own)):
        with open(own, "w") as f:
            f.write("{}")


def trial_rows(tuner):
    rows = []
    for trial in sorted(tuner.oracle.trials.values(), key=lambda t: t.trial_id):
        values = trial.hyperparameters.values
        metric = lambda name: (trial.metrics.get_last_value(name)  # noqa: E731
                               if trial.metrics.exists(name) else None)
        rows.append({"trial": trial.trial_id, "status": str(trial.status),
                     "per_replica_batch_size": values.get("per_replica_batch_size"),
                     "global_batch_size": metric("global_batch_size"),
                     "base_lr": values.get("base_lr"), "lr_scaling": values.get("lr_scaling"),
                     "warmup_epochs": values.get("warmup_epochs"),
                     "lr_schedule": values.get("lr_schedule"), "momentum": values.get("momentum"),
                     "weight_decay": values.get("weight_decay"),
                     "learning_rate": metric("learning_rate"), "test_acc": metric(OBJECTIVE),
                     "seconds": metric("seconds")})
    return rows


def write_table(rows, path):
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def format_table(rows):
    def show(value, fmt):
        return "-" if value is None else format(value, fmt)

    lines = [f"{'trial':>5} {'status':>9} {'batch':>6} {'base_lr':>8} {'rule':>6} "
             f"{'warm-up':>7} {'lr':>8} {'test acc':>8} {'time s':>7}"]
    for r in rows:
        lines.append(f"{r['trial']:>5} {r['status']:>9} {show(r['global_batch_size'], '.0f'):>6} "
                     f"{show(r['base_lr'], '.4f'):>8} {str(r['lr_scaling']):>6} "
                     f"{show(r['warmup_epochs'], '.1f'):>7} {show(r['learning_rate'], '.4f'):>8} "
                     f"{show(r['test_acc'], '.4f'):>8} {show(r['seconds'], '.1f'):>7}")
    return "\n".join(lines)


def plot_trials(rows, path, title):
    """Test accuracy against the learning rate used, one colour per global batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in rows if r["test_acc"] is not None and r["learning_rate"]]
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for batch in sorted({r["global_batch_size"] for r in done}):
        points = [r for r in done if r["global_batch_size"] == batch]
        ax.scatter([r["learning_rate"] for r in points], [r["test_acc"] for r in points],
                   label=f"batch {batch:.0f}", s=40)
    ax.set(xscale="log", xlabel="learning rate used (base_lr x rule(batch/256))",
           ylabel="test accuracy", ylim=(0, 1))
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    if done:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def best_flagfile(cfg, path, accuracy, note=""):
    """The best trial's RunConfig as a flagfile that tfmulti.main runs as is."""
    lines = [f"# python -m tfmulti.main --flagfile={path}",
             f"# The best trial of the tuning session in {os.path.dirname(path)}: test acc "
             f"{accuracy:.4f} in the session's epochs."] + ([f"# {note}"] if note else [])
    with open(path, "w") as f:
        f.write("\n".join(lines + cfg.flag_lines("main")) + "\n")


def summarize(tuner, out, title, note=""):
    rows = trial_rows(tuner)
    if not rows:
        raise cli.UserError("the session has no trials")
    print(format_table(rows))
    write_table(rows, os.path.join(out, "trials.csv"))
    plot_trials(rows, os.path.join(out, "accuracy.png"), title)
    finished = [r for r in rows if r["test_acc"] is not None]
    if not finished:
        raise cli.UserError("every trial failed; see the table above")
    best = max(finished, key=lambda r: r["test_acc"])
    hp = tuner.oracle.trials[best["trial"]].hyperparameters
    best_flagfile(tuner.hypermodel.trial_config(hp, hp.values.get("tuner/epochs")),
                  os.path.join(out, "best.cfg"),
                  best["test_acc"], note)
    return best, rows


# ----------------------------------------------------------------------------- entry point

def _numbers(name, kind=float):
    try:
        return [kind(x) for x in cli.FLAGS[name].value]
    except ValueError:
        raise cli.UserError(f"--{name}={','.join(cli.FLAGS[name].value)}: give "
                            f"{'whole ' if kind is int else ''}numbers, comma separated") from None


def search_space():
    """The tune_* flags, checked: keyword arguments of TrainingHyperModel."""
    FLAGS = cli.FLAGS
    space = {"batch_choices": _numbers("tune_batch_sizes", int),
             "lr_range": tuple(_numbers("tune_lr_range")),
             "warmup_choices": _numbers("tune_warmup_epochs"),
             "momentums": _numbers("tune_momentum"), "weight_decays": _numbers("tune_weight_decay"),
             "rules": list(FLAGS.tune_lr_scalings), "schedules": list(FLAGS.tune_lr_schedules)}
    for flag, allowed in (("tune_lr_scalings", ("linear", "sqrt", "none")),
                          ("tune_lr_schedules", cli.config.LR_SCHEDULES)):
        if set(FLAGS[flag].value) - set(allowed):
            raise cli.UserError(f"--{flag}={','.join(FLAGS[flag].value)}: choose from "
                                f"{', '.join(allowed)}")
    low, high = space["lr_range"] if len(space["lr_range"]) == 2 else (0, 0)
    if not 0 < low < high or any(b < 1 for b in space["batch_choices"]) or FLAGS.max_trials < 1:
        raise cli.UserError("need 0 < --tune_lr_range low < high, batch sizes >= 1 and "
                            "--max_trials >= 1")
    if any(not 0 <= m < 1 for m in space["momentums"]) or min(space["weight_decays"]) < 0:
        raise cli.UserError("--tune_momentum takes values in [0, 1), --tune_weight_decay "
                            "values of 0 or more")
    return space


def main():
    FLAGS = cli.FLAGS
    base = cli.run_config()
    # Trials start one after another (and K at once with --parallel_trials): memory as needed.
    plan = cli.device_plan(base)
    plan = dataclasses.replace(plan, memory_growth=plan.kind == "gpu")
    space = search_space()
    role, k = parallel_trials.role(), FLAGS.parallel_trials
    if k > 1 and role != "serial":
        raise cli.UserError("--parallel_trials starts its own keras-tuner chief and workers; "
                            "unset KERASTUNER_TUNER_ID, KERASTUNER_ORACLE_IP and _PORT")
    shares = parallel_trials.device_shares(plan, k, cli.devices.usable_core_ids(),
                                           parallel_trials.visible_gpus())
    # This process only searches: trials train in processes of their own. Keep it off the GPUs
    # (building the model to declare the search space would otherwise reserve their memory).
    tf.config.set_visible_devices([], "GPU")
    out = base.model_dir or os.path.join("runs", f"tune-{base.model}-{base.dataset}")
    if "://" in out:  # keras-tuner's state, the table and the worker logs use local files
        raise cli.UserError(f"--model_dir={out}: a tuning session lives on a local or network "
                            "file system (a mounted folder), not at a URL")
    dataset = cli.load_data(base)  # before anything is made on disk
    if role != "worker":
        rundir.prepare_model_dir(out, base.overwrite)
        if base.overwrite:
            import shutil

            shutil.rmtree(os.path.join(out, "trials"), ignore_errors=True)
            shutil.rmtree(os.path.join(out, "workers"), ignore_errors=True)
    hypermodel = TrainingHyperModel(trial_plan(plan, k), dataset, base,
                                    threads=(base.intra_op_threads, base.inter_op_threads),
                                    **space)
    if k > 1:
        from tfmulti import launch

        parallel_trials.become_chief(launch.free_ports(1)[0])
    tuner = make_tuner(FLAGS.tuner, hypermodel, out, FLAGS.max_trials,
                       FLAGS.max_retries_per_trial, base.seed)
    if role == "worker":
        tuner.search(verbose=0)
        return
    at_once = (f", {k} at a time on {plan.count // k} device{'s' if plan.count // k > 1 else ''}"
               " each" if k > 1 else "")
    print(f"Tuning {base.model} on {dataset.display_name} on {plan.devices} with the "
          f"{FLAGS.tuner} tuner, {FLAGS.max_trials} trials{at_once}, session in {out}")
    if k > 1:
        parallel_trials.run(tuner, shares, sys.argv[1:], out)
    else:
        tuner.search(verbose=1)
    note = (f"Trials ran {k} at a time on {plan.count // k} of the {plan.count} devices; here "
            f"the rule scales the rate to all {plan.count}." if k > 1 else "")
    best, _ = summarize(tuner, out, f"{base.model} on {dataset.display_name}", note)
    print(f"best: test acc {best['test_acc']:.4f} with global batch "
          f"{best['global_batch_size']:.0f}, learning rate {best['learning_rate']:.4g}")
    print(f"session: {out}/ (trials.csv, accuracy.png, best.cfg); run the best with "
          f"python -m tfmulti.main --flagfile={out}/best.cfg")


def trial_plan(plan, k):
    """The devices one trial trains on: all of them, or a 1/k share with --parallel_trials."""
    return type(plan)(plan.kind, plan.count // k)


if __name__ == "__main__":
    cli.run(main, "tune")
