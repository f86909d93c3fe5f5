"""A tuning session as a library: the search space checked as RunConfig checks it, the
session's folder, and this process's part of the search (serial, keras-tuner's chief or
worker with --parallel_trials, or a task of srun's step); tools/tune.py reads the flags into
a TuneOptions and calls run()."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import sys
import typing
from typing import TYPE_CHECKING

import keras_tuner as kt
import tensorflow as tf

from tfmulti.data import sources, validation
from tfmulti.data.dataset import structure_text
from tfmulti.decoded import dataonce
from tfmulti.distribution import devices, slurm, startup, workers
from tfmulti.distribution.startup import Role
from tfmulti.errors import PREEMPTED_EXIT_CODE, UsageError
from tfmulti.models import zoo
from tfmulti.run import config, datasets, flagdefs
from tfmulti.rundir import kinds, lifecycle
from tfmulti.training import compiled
from tfmulti.tune import (
    keras_tuner_fixes,
    parallel_trials,
    search,
    session,
    stopping,
    tasks,
    trial,
)
from tfmulti.tune import objective as objectives

if TYPE_CHECKING:
    from tfmulti.run.config import RunConfig


@dataclasses.dataclass(frozen=True)
class TuneOptions:
    """A session's own settings (its flags), beside the RunConfig its trials share."""
    tuner: str = "random"
    max_trials: int = 10
    max_retries_per_trial: int = 1
    parallel_trials: int = 1
    choices: dict = dataclasses.field(default_factory=dict)  # --tune_X -> its values (text)
    lr_range: tuple = ("0.01", "1.0")  # --tune_lr_range, as given
    # --tune_lr_range or --tune_lr_scalings given: tfmulti's rate is searched even for a
    # model compiled with an optimizer of its own (else that model's rate trains: own_rate)
    rate_searched: bool = True
    objective: str = ""  # --objective: NAME[:min|max]; "" for the default
    prune: str = "none"  # --prune: none or median (trial.py)
    decode_once: bool = True  # --decode_once: a folder's images decoded once for every trial
    argv: tuple = ()  # the session's flags, for the workers of --parallel_trials


def _kind(field):
    """The type of RunConfig's `field` (int for an optional int)."""
    kind = {f.name: f.type for f in dataclasses.fields(config.RunConfig)}[field]
    return typing.get_args(kind)[0] if typing.get_origin(kind) is typing.Union else kind


def _values(flag, raw, kind):
    """The values `raw` of the list flag `flag` as `kind`; one line for one that is not."""
    if not raw:
        raise UsageError(f"--{flag}: give at least one value")
    try:
        return [kind(x) for x in raw]
    except ValueError:
        raise UsageError(f"--{flag}={','.join(raw)}: give {'whole ' if kind is int else ''}"
                         "numbers, comma separated") from None


def _check(base, flag, field, values):
    """Each value as a trial would train with it: RunConfig's rules and its one line."""
    for value in values:
        try:
            search.trial_settings(base, {field: value})
        except UsageError as e:
            raise UsageError(f"--{flag}: {e}") from None


def search_space(base, options):
    """The tune flags, each value checked as the RunConfig field it sets (base: the session's
    settings): keyword arguments of search.TrainingHyperModel."""
    choices = {}
    for flag, (field, _, _) in flagdefs.TUNE_CHOICES.items():
        choices[field] = _values(flag, options.choices[flag], _kind(field))
        _check(base, flag, field, choices[field])
    lr_range = _values("tune_lr_range", options.lr_range, float)
    _check(base, "tune_lr_range", "base_lr", lr_range)
    if len(lr_range) != 2 or not lr_range[0] < lr_range[1]:
        raise UsageError(f"need 0 < --tune_lr_range low < high (got {','.join(options.lr_range)})")
    if options.prune != "none" and options.tuner == "hyperband":
        raise UsageError(f"--prune={options.prune} with --tuner=hyperband: hyperband stops "
                         "trials early itself; use --tuner=random or bayesian to prune")
    if options.max_trials < 1:
        raise UsageError(f"--max_trials={options.max_trials}: must be at least 1")
    return {"choices": choices, "lr_range": tuple(lr_range)}


def own_rate(base, options, dataset, space):
    """The search space for a model compiled with an optimizer of its own: its trials train
    at its own learning rate, as model.fit trains it (base_lr and lr_scaling not searched,
    said in one line), unless the session asks for tfmulti's rate (--tune_lr_range,
    --tune_lr_scalings, --base_lr or --lr_scaling given). Others: space as it is."""
    if options.rate_searched or not (base.own_model and base.keeps_compiled_rate):
        return space
    model = zoo.build(base.model, base.width, dataset.input_shape, dataset.num_classes,
                      dtype=base.dtype, init=base.init, seed=base.seed, hp=kt.HyperParameters())
    optimizer = compiled.own_optimizer(model)
    if optimizer is None:
        return space
    rate = compiled.own_rate(optimizer)
    print(f"--model={base.model} is compiled with {type(optimizer).__name__}: its trials "
          f"train at its own learning rate{f' {rate:g}' if rate is not None else ''}, as "
          "model.fit trains it (--tune_lr_range or --tune_lr_scalings would search tfmulti's "
          "rate in its place)", flush=True)
    return {**space, "lr_range": (), "choices": {**space["choices"], "lr_scaling": []}}


def check_batches(base, choices, dataset, replicas):
    """UsageError, before the first trial, naming a batch choice that cannot train on the
    training examples a trial has (the data set less its validation part) on its replicas."""
    train_examples = validation.split(dataset, base.validation_split, base.seed)[0].train_size
    for value in choices.get("per_replica_batch_size", [base.per_replica_batch_size]):
        try:
            search.trial_settings(base, {"per_replica_batch_size": value}, replicas=replicas,
                                  train_examples=train_examples)
        except UsageError as e:
            held = (f"validation on --validation_set={base.validation_set}"
                    if base.validation_set else
                    f"the {base.validation_split:g} validation part held out")
            raise UsageError(f"--tune_batch_sizes={value}: {e} a trial trains on "
                             f"({replicas} replica{'s' if replicas > 1 else ''}, {held})"
                             ) from None


def session_dir(base):
    """--model_dir, or runs/tune-<model>-<dataset>: a local folder."""
    out = base.model_dir or os.path.join("runs", f"tune-{base.model.replace(':', '.')}-"
                                        f"{datasets.label(base.dataset)}")
    if "://" in out:  # keras-tuner's state, the table and the worker logs use local files
        raise UsageError(f"--model_dir={out}: a tuning session lives on a local or network "
                         "file system (a mounted folder), not at a URL")
    return out


@contextlib.contextmanager
def session_in_use(out, overwrite, identity):
    """The session's folder made ready (by the chief or a serial session) and locked while
    the block runs, emptied of an earlier session's state with --overwrite; a folder of a
    training run or of another session (identity: session_identity) is refused."""
    with lifecycle.in_use(out, overwrite, marks=kinds.SESSION_MARKS, kind="session"):
        if overwrite:
            for state in ("trials", "workers"):
                shutil.rmtree(os.path.join(out, state), ignore_errors=True)
            for name in (kinds.SESSION_FILE, "trials.csv", "best.cfg"):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(out, name))
        kinds.open_session(out, identity)
        yield


SEARCHED = ("base_lr", *(field for field, _, _ in flagdefs.TUNE_CHOICES.values()))


def session_identity(base, options, space, dataset, objective):
    """What makes a session what it is (session.json): the settings its trials share but
    do not search, the search (tuner, space, objective) and the data set; not what may
    change when it goes on (--max_trials, the devices, --parallel_trials)."""
    fields = {f"--{k}": v for k, v in base.must_match().items() if k not in SEARCHED}
    identity = {
        **fields, "--epochs": base.epochs, "--tuner": options.tuner,
        "--objective": f"{objective.name}:{objective.direction}", "--prune": options.prune,
        **{f"--{flag}": space["choices"][field]
           for flag, (field, _, _) in flagdefs.TUNE_CHOICES.items()},
        "--tune_lr_range": list(space["lr_range"]),
        "data set": dataset.display_name, "training examples": dataset.train_size,
        "test examples": dataset.test_size, "classes": list(dataset.class_names),
        "features": (list(dataset.input_shape) if dataset.images
                     else structure_text(dataset.train_features))}
    return json.loads(json.dumps(identity))  # as session.json holds it


def run(base: RunConfig, options: TuneOptions) -> None:
    """The session RunConfig base and TuneOptions ask for: this process's part of it (a
    serial session, keras-tuner's chief or worker, or a task of srun's step)."""
    keras_tuner_fixes.apply()  # before any tuner is made: state files written whole
    # Trials start one after another (and K at once with --parallel_trials): memory as needed.
    plan = startup.from_config(base, one_run=False).plan
    plan = dataclasses.replace(plan, memory_growth=plan.kind == "gpu")
    space = search_space(base, options)
    k, srun_step = options.parallel_trials, slurm_step()
    if k > 1 and srun_step:
        raise UsageError(f"--parallel_trials={k} under srun: each task of the step already "
                         "runs trials (task 0 also serves the search); ask srun for more tasks")
    role = parallel_trials.role()
    if k > 1 and role is not Role.ALONE:
        raise UsageError("--parallel_trials starts its own keras-tuner chief and workers; "
                         "unset KERASTUNER_TUNER_ID, KERASTUNER_ORACLE_IP and _PORT")
    shares = devices.device_shares(plan, k, devices.usable_core_ids(), devices.visible_gpus())
    # This process only searches: trials train in processes of their own. Keep it off the GPUs
    # (building the model to declare the search space would otherwise reserve their memory).
    tf.config.set_visible_devices([], "GPU")
    out = session_dir(base)
    beats = None
    if srun_step:
        if srun_step["task"]["index"] == 0:
            workers.check_own_port(srun_step)  # the oracle's port: gRPC would share a taken one
        beats = tasks.Beats(os.path.join(out, "workers"), os.environ["KERASTUNER_TUNER_ID"],
                            tasks.incarnation(os.environ))
    if not base.validation_split and not base.validation_set:
        raise UsageError("--validation_split=0: a tuning session chooses its trials on a part "
                         "of the training data held out for it (the test set is for the end); "
                         "give a share, like 0.1")
    dataset = sources.load_for(base)  # before anything is made on disk
    decode, prepared = dataonce.decode_once(dataset, options.decode_once, 1 + 2 * k)
    if decode and k == 1:  # with --parallel_trials, each worker decodes for its own trials
        dataset = dataclasses.replace(dataset,
                                      train_features=dataonce.decoded(dataset, prepared))
    elif not decode and prepared:
        # too many for memory: onto disk, one file every trial maps (workers: the same file)
        dataset = (dataonce.onto_disk(dataset, prepared, True, "every trial")
                   if options.decode_once
                   else dataonce.read_from_files(dataset, prepared))
        if dataset.reading:  # the files, then
            print(dataset.reading, flush=True)
            if k > 1:  # the workers read the files too
                options = dataclasses.replace(options, argv=(*options.argv, "--nodecode_once"))
    objective = objectives.session_objective(base, dataset, options.objective)
    space = own_rate(base, options, dataset, space)
    check_batches(base, space["choices"], dataset, trial_plan(plan, k).count)
    space = {**space, "objective": objective}
    # The session's chief holds the folder's lock for the whole session (not its workers)
    identity = session_identity(base, options, space, dataset, objective)
    with (session_in_use(out, base.overwrite, identity) if role.leads
          else contextlib.nullcontext()):
        search_in(out, base, options, plan, space, dataset, shares, srun_step, role, beats)


def search_in(out, base, options, plan, space, dataset, shares, srun_step, role, beats):
    """The session's search in its folder `out`: this process's part of it (serial, chief,
    worker, or a task of srun's step)."""
    k = options.parallel_trials
    hypermodel = search.TrainingHyperModel(
        trial_plan(plan, k), dataset, base, threads=(base.intra_op_threads,
                                                     base.inter_op_threads),
        prune=options.prune, **space)
    # The chief serves only callers with the session's secret (it makes it; workers read it)
    keras_tuner_fixes.require_secret(out, make=role.leads)
    if k > 1:
        parallel_trials.become_chief()
    asking = (tasks.chief_answers(srun_step["cluster"]["worker"][0], base.worker_timeout)
              if srun_step and role is Role.WORKER else contextlib.nullcontext())
    with asking:  # a worker's tuner asks the chief for the search space
        tuner = search.make_tuner(options.tuner, hypermodel, out, options.max_trials,
                                  options.max_retries_per_trial, base.seed)
    if role.leads:  # TensorBoard's HParams dashboard: the space and the objective, once
        trial.write_experiment(out, tuner.oracle.get_space().space, space["objective"])
    if srun_step:
        return across_tasks(srun_step, tuner, out, base, options, dataset, plan, beats)
    if role is Role.WORKER:
        with runs_trials(hypermodel):
            tuner.search(verbose=0)
        return
    at_once = (f", {k} at a time on {plan.count // k} device{'s' if plan.count // k > 1 else ''}"
               " each" if k > 1 else "")
    print(f"Tuning {base.model} on {dataset.display_name} on {plan.devices} with the "
          f"{options.tuner} tuner, {options.max_trials} trials{at_once}, session in {out}")
    if k > 1:
        parallel_trials.run(tuner, shares, list(options.argv), out)
    else:
        with runs_trials(hypermodel):
            tuner.search(verbose=1)
    report(tuner, out, base, dataset, plan, k)


@contextlib.contextmanager
def runs_trials(hypermodel):
    """The block runs trials in this process: SIGTERM or Ctrl-C stops the trial under way
    with its checkpoint, starts no other, and exits 75 in one line (stopping.py)."""
    with hypermodel.stopper.installed():
        try:
            yield
        except stopping.SessionStopped as e:
            print(f"tfmulti: tuning {e}; run the same command again to go on with the session",
                  file=sys.stderr, flush=True)
            sys.exit(PREEMPTED_EXIT_CODE)


def report(tuner, out, base, dataset, plan, k):
    """The session's table, plot and best.cfg, and where they are."""
    note = (f"Trials ran {k} at a time on {plan.count // k} of the {plan.count} devices; here "
            f"the rule scales the rate to all {plan.count}." if k > 1 else "")
    best, _ = session.summarize(tuner, out, f"{base.model} on {dataset.display_name}", note)
    name = tuner.hypermodel.objective.name
    print(f"best: {name} {best[name]:.4f} with global batch "
          f"{best['global_batch_size']:.0f}, learning rate {best['learning_rate']:.4g} (on the "
          f"validation part; best.cfg trains on all the training data and reports the test "
          "set)")
    print(f"session: {out}/ (trials.csv, accuracy.png, best.cfg); run the best with "
          f"python -m tfmulti.main --flagfile={out}/best.cfg")


def trial_plan(plan, k):
    """The devices one trial trains on: all of them, or a 1/k share with --parallel_trials."""
    return type(plan)(plan.kind, plan.count // k)


def slurm_step():
    """This task's cluster when it is one of several tasks of an srun step (and keras-tuner's
    roles are not set by hand): then its KERASTUNER_* variables are set from it."""
    if parallel_trials.role() is not Role.ALONE:
        return None
    cluster = slurm.cluster(os.environ)
    if cluster is not None:
        os.environ.update(tasks.roles(cluster))
    return cluster


def across_tasks(cluster, tuner, out, base, options, dataset, plan, beats):
    """srun's tasks: task 0 serves the search and runs trials, the others run trials
    (tune/tasks.py)."""
    chief = cluster["cluster"]["worker"][0]
    if cluster["task"]["index"] != 0:
        print(f"{os.environ['KERASTUNER_TUNER_ID']}: trials on {plan.devices}, asking the "
              f"chief at {chief}", flush=True)
        with runs_trials(tuner.hypermodel):
            tasks.work(tuner, chief, beats, base.worker_timeout)
        return
    expected = tasks.worker_ids(cluster)
    print(f"Tuning {base.model} on {dataset.display_name} across Slurm's tasks: the search "
          f"served at {chief}, trials on task 0 and {len(expected)} other task(s), "
          f"{plan.devices} each, {options.max_trials} trials, session in {out}", flush=True)
    with runs_trials(tuner.hypermodel):
        tasks.lead(tuner, chief, expected, beats, base.worker_timeout,
                   stop_check=tuner.hypermodel.stopper.check)
    report(tuner, out, base, dataset, plan, 1)
