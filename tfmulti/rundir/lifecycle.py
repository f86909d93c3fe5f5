"""A run's directory (model_dir): its lifecycle, apart from training.

A run lives in its model_dir: run.json says what run it is, checkpoints/ where it got to.
Running the same command again resumes it at the step after the newest readable checkpoint;
a different run there is refused (--overwrite clears it). With several workers the chief
alone decides, and the others follow (start_point).
"""
from __future__ import annotations

import contextlib
import datetime
import errno
import os
import posixpath
import sys
from typing import TYPE_CHECKING, Any

from tfmulti.distribution import devices, storage
from tfmulti.distribution.startup import Role
from tfmulti.errors import UsageError, UserError, first_line
from tfmulti.processes import ctrl_c
from tfmulti.run import config, datasets, usercode
from tfmulti.rundir import kinds, lock, names

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    import keras

    from tfmulti.data.dataset import DataSet
    from tfmulti.run.config import RunConfig

RUN_FILE = "run.json"
CHECKPOINT_DIR = "checkpoints"
SCRATCH_PREFIX = ".scratch-"  # + the worker's role and its own name: see train_and_evaluate


def default_model_dir(model: str, dataset: str, now: datetime.datetime | None = None) -> str:
    stamp = (now or datetime.datetime.now()).strftime("%Y%m%d-%H%M%S")
    return os.path.join("runs", f"{stamp}-{model.replace(':', '.')}-"
                                f"{datasets.label(dataset)}")


@contextlib.contextmanager
def in_use(directory: str, overwrite: bool = False, chief: bool = True,
           marks: tuple[str, ...] = (RUN_FILE,),
           say: Callable[[str], None] = print, kind: str = "run") -> Iterator[str]:
    """`directory` made ready to write (prepare_model_dir), locked by the chief until the
    block ends (lock.py): a second process in the same folder is refused in one line,
    before --overwrite deletes anything of the first one's; so is a folder of the other
    kind (kinds.py: kind "run" or "session")."""

    if not chief:
        prepare_model_dir(directory, overwrite, chief)
        yield directory
        return
    prepare_model_dir(directory)  # made and writable: the lock file can be made there
    with lock.locked(directory, say=say):
        kinds.refuse_other_kind(directory, kind)
        prepare_model_dir(directory, overwrite, chief, marks, say=say)
        yield directory


@contextlib.contextmanager
def removed_if_interrupted(directory: str, existed: bool) -> Iterator[None]:
    """A folder this command made is removed again when Ctrl-C stops the command at once
    while it makes the folder or takes its lock (before removed_if_refused is in force), if
    nothing but tfmulti's own files (its lock) is in it and no other process holds it."""
    try:
        yield
    except BaseException as e:
        if not existed and ctrl_c.interrupted(e):
            with contextlib.suppress(OSError, UserError), \
                    lock.locked(directory, say=lambda line: None):
                if _nothing_of_the_run_in(directory):
                    storage.remove(directory)
        raise


def _nothing_of_the_run_in(directory: str) -> bool:
    """Whether `directory` holds nothing but tfmulti's own files (its lock)."""
    return not [n for n in storage.listdir(directory) if not n.startswith(".tfmulti-")]


@contextlib.contextmanager
def removed_if_refused(model_dir: str, existed: bool) -> Iterator[None]:
    """A model_dir this command made (existed: whether it was there before) is removed again
    when the run is refused before writing anything in it (your model, checked when it is
    built); and when nothing was trained in it (no checkpoint), with what the run wrote
    there, when its step did not fit the device's memory (a retry with a smaller batch is
    then a new run, not "a different run there") or Ctrl-C stopped it at once (during its
    start)."""
    try:
        yield
    except BaseException as e:
        if not existed:
            with contextlib.suppress(OSError):  # another worker may have removed it first
                _remove_unless_kept(model_dir, e)
        raise


def _remove_unless_kept(model_dir: str, error: BaseException) -> None:
    if not storage.isdir(model_dir):
        return
    if ctrl_c.interrupted(error) or _out_of_memory(error):
        if not _checkpointed(model_dir):
            storage.remove(model_dir)
    elif isinstance(error, UserError) and _nothing_of_the_run_in(model_dir):
        storage.remove(model_dir)  # its lock file too: nothing of the run was made


def _out_of_memory(error: BaseException) -> bool:
    return ("tensorflow" in sys.modules
            and isinstance(error, sys.modules["tensorflow"].errors.ResourceExhaustedError))


def _checkpointed(model_dir: str) -> bool:
    """Whether model_dir holds a checkpoint of its run."""
    return bool(saved_checkpoints(storage.join(model_dir, CHECKPOINT_DIR)))


def saved_checkpoints(checkpoints: str) -> list[str]:
    """The checkpoints in the folder `checkpoints`, oldest first: those its state file
    (`checkpoint`) lists and any ckpt-N whose index is there. A checkpoint's index is written
    last, once its data are whole, and the state file after it: a run killed between the two
    left a whole checkpoint the state file does not list (the resume took an older one, or
    none and started over)."""
    import tensorflow as tf

    if not storage.isdir(checkpoints):
        return []
    state = tf.train.get_checkpoint_state(checkpoints)
    listed = list(state.all_model_checkpoint_paths) if state else []
    steps = {int(p.rsplit("-", 1)[1]): storage.join(checkpoints, posixpath.basename(p))
             for p in listed}
    for name in storage.listdir(checkpoints):
        stem = name[:-len(".index")] if name.endswith(".index") else ""
        if stem.startswith("ckpt-") and stem[5:].isdigit():
            steps.setdefault(int(stem[5:]), storage.join(checkpoints, stem))
    return [steps[n] for n in sorted(steps)]


def _run_files(model_dir):
    return [f for f in names.RUN_FILES + (RUN_FILE,)
            if storage.exists(storage.join(model_dir, f))]


def _scratch_folders(model_dir):
    """Other workers' checkpoint folders (see train_and_evaluate), a killed one's included."""
    return [n.rstrip("/") for n in storage.listdir(model_dir) if n.startswith(SCRATCH_PREFIX)]


def prepare_model_dir(model_dir, overwrite=False, chief=True, marks=(RUN_FILE,), say=print):
    """Checks model_dir can be written; with overwrite, the chief clears an earlier run's own
    files (other files stay) and says which, in a folder that holds one: one of `marks`
    (run.json; a tuning session's trials/) is there, or the folder is empty. A folder of
    other files is refused, nothing deleted, and so is one whose run.json is not in
    tfmulti's form (another program's: Sacred, for one, writes run.json and metrics.json
    too); a symbolic link among the run's names is removed, never followed. Whether a run
    there is resumed or refused is open_run's business.

    Any number of processes (workers, tuning workers) may call this on one model_dir at once:
    each probes with a file of its own, and only the chief deletes anything."""
    if storage.exists(model_dir) and not storage.isdir(model_dir):
        raise UsageError(f"--model_dir={model_dir} is a file, not a directory")
    # Only with --overwrite: a resumed run keeps its TensorBoard events, and a different run
    # (refused by open_run) keeps everything.
    if overwrite and chief:
        held = [n for n in storage.listdir(model_dir) if not n.startswith(".tfmulti-")]
        if held and not any(storage.exists(storage.join(model_dir, m)) for m in marks):
            raise UsageError(f"--overwrite: --model_dir={model_dir} holds no tfmulti run (no "
                             f"{' or '.join(marks)}), so nothing in it is deleted; choose "
                             "another --model_dir")
        _refuse_foreign_run_file(model_dir)
        run_names = (_run_files(model_dir) + [names.PLOT_FILE, names.TENSORBOARD_DIR,
                                              names.SAVED_MODEL_DIR, names.CLASS_NAMES_FILE]
                     + _scratch_folders(model_dir))
        there = [name for name in run_names if storage.exists(storage.join(model_dir, name))]
        if there:
            say(f"--overwrite: deleting the earlier run's {', '.join(there)} in {model_dir}")
        for name in run_names:  # a link among them removed too, never followed
            storage.remove(storage.join(model_dir, name))
    try:
        storage.check_writable(model_dir)
    except OSError as e:
        raise UsageError(f"--model_dir={model_dir} is not writable ({e.strerror or e})")


def _refuse_foreign_run_file(model_dir):
    """UsageError, nothing deleted, when model_dir's run.json is not one tfmulti wrote (not in
    its form, or unreadable)."""
    path = storage.join(model_dir, RUN_FILE)
    if not storage.exists(path):
        return
    try:
        written = storage.read_json(path)
    except (OSError, ValueError) as e:
        said = f"{path} is unreadable ({e})"
    else:
        if written_by_tfmulti(written):
            return
        said = f"{path} is not a run.json of tfmulti (another program's?)"
    raise UsageError(f"--overwrite: {said}, so nothing in --model_dir={model_dir} is "
                     "deleted; choose another --model_dir")


# The keys of run.json in the form tfmulti wrote before its first release (flat)
FLAT_RUN_KEYS = ("model", "dataset", "per_replica_batch_size", "replicas")


def written_by_tfmulti(run) -> bool:
    """Whether `run` (a run.json's content) is in a form tfmulti writes: today's (RUN_KEYS)
    or the flat one of before its first release."""
    return isinstance(run, dict) and (all(k in run for k in RUN_KEYS)
                                      or all(k in run for k in FLAT_RUN_KEYS))


def run_file(cfg: RunConfig, dataset: DataSet, global_batch: int, replicas: int, workers: int,
             model: keras.Model | None = None) -> dict[str, Any]:
    """run.json: what run this is (the configuration, the data set, the global batch, the
    model's variables, your code's files) and where it last ran (replicas, workers)."""

    own = {kind: usercode.provenance(spec) for kind, spec, yours in (
        ("model", cfg.model, bool(config.MODEL_SPEC.match(cfg.model))),
        ("dataset", cfg.dataset, datasets.source_of(cfg.dataset).your_code),
        ("parse", cfg.parse, bool(cfg.parse)),
        ("callbacks", cfg.callbacks, bool(cfg.callbacks))) if yours}
    return {"config": cfg.record(), "dataset": dataset.display_name,
            "dataset_source": dataset.source, "class_names": list(dataset.class_names),
            **_data_form(dataset), "train_examples": dataset.train_size,
            "test_examples": dataset.test_size, "global_batch_size": global_batch,
            "replicas": replicas, "workers": workers,
            **({"model_variables": variables_of(model)} if model is not None else {}),
            **({"your_code": own} if own else {})}


def _data_form(dataset):
    """What the model takes: the images' shape and dtype; for other features (image_shape
    and image_dtype null) the features' and targets' structure, shapes and dtypes."""
    from tfmulti.data.checks import is_class_ids
    from tfmulti.data.dataset import structure_text

    form = ({"image_shape": list(dataset.input_shape), "image_dtype": dataset.image_dtype}
            if dataset.images else {"image_shape": None, "image_dtype": None,
                                    "features": structure_text(dataset.train_features)})
    if dataset.train_targets is None:  # features alone: your model's own step trains it
        form["targets"] = None
    elif not is_class_ids(dataset.train_targets):
        form["targets"] = structure_text(dataset.train_targets)
    return form


def variables_of(model):
    """["path shape", ...] of every variable of the model, in order."""
    return [f"{v.path} {'x'.join(map(str, v.shape)) or 'scalar'}" for v in model.weights]


def identity(run):
    """What must be the same for a run to resume: the configuration's fields that may not
    change, the data set and the global batch (the data stream is a function of the seed,
    the step and the global batch only, so replicas and workers may change)."""
    kept = {k: v for k, v in run.items()  # --data_dir may move; your code: see changed_code
            # (and the tf.data service may come, go or move: its run says what it keeps; a
            # resumed run may run other CPU kernels and threads, as on another machine)
            if k not in ("config", "replicas", "workers", "dataset_source", "model_variables",
                         "your_code", "batch_search", "data_service", "cpu_kernels")}
    return {**config.RunConfig.from_record(run["config"]).must_match(), **kept}


RUN_KEYS = ("config", "class_names", "image_shape", "image_dtype", "global_batch_size")


def _checked(run, path):
    """run.json's content when it is in the form this tfmulti writes; UsageError otherwise
    (a file of another program, or of a tfmulti before its first release)."""
    missing = [k for k in RUN_KEYS if k not in run] if isinstance(run, dict) else list(RUN_KEYS)
    if missing:
        raise UsageError(f"{path} is not a run.json of this tfmulti (no {', '.join(missing)})")
    return run


def read_run(model_dir: str) -> dict[str, Any]:
    """The run.json of the run in model_dir (in today's form); UsageError when there is none
    or it cannot be read."""
    path = storage.join(model_dir, RUN_FILE)
    if not storage.exists(path):
        raise UsageError(f"--model_dir={model_dir} holds no {RUN_FILE}: not the folder of a "
                         "tfmulti run")
    try:
        return _checked(storage.read_json(path), path)
    except (OSError, ValueError) as e:
        raise UsageError(f"{path} is unreadable ({e})") from None


def earlier_run(model_dir: str) -> dict[str, Any] | None:
    """The run.json in model_dir when there is one in this tfmulti's form, else None (what
    open_run says of a folder it cannot resume is said when the run opens it)."""
    path = storage.join(model_dir, RUN_FILE)
    try:
        return _checked(storage.read_json(path), path) if storage.exists(path) else None
    except (UsageError, OSError, ValueError):
        return None


def open_run(model_dir, run):
    """The earlier run.json when model_dir holds this run (same identity; run.json is
    updated to where it runs now), None when it holds none (run.json is written); any other
    run there is refused. The chief's business: the other workers follow its decision."""
    path = storage.join(model_dir, RUN_FILE)
    if storage.exists(path):
        written = None
        try:
            written = storage.read_json(path)
            earlier = _checked(written, path)
            was = identity(earlier)
        except UsageError as e:
            raise UsageError(f"{e}; pass --overwrite to start over" if written_by_tfmulti(
                written) else f"{e}: another program's? Choose another --model_dir") from None
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise UsageError(f"{path} is unreadable ({e}); pass --overwrite to start over")
        now = identity(run)
        if was == now:
            check_variables(earlier, run, model_dir)
            storage.write_json(path, run)
            return earlier
        differ = ", ".join(f"{_as_flag(k)} {was.get(k)!r} there, {now.get(k)!r} now"
                           for k in sorted(set(was) | set(now)) if was.get(k) != now.get(k))
        hint = (f"; give --global_batch_size={was['global_batch_size']} to resume it on another "
                "device count" if was.get("global_batch_size") != now.get("global_batch_size")
                else "; your model now takes your function's features as it returns them, as "
                "model.fit does (the tfmulti that started this run scaled its images to [0, 1] "
                "and added a channel axis): finish it with that tfmulti" if was.get("image_shape")
                and not now.get("image_shape") and config.MODEL_SPEC.match(
                    run["config"]["model"]) else "")
        raise UsageError(f"--model_dir={model_dir} holds a different run ({differ}){hint}; pass "
                         "--overwrite to replace it or choose another --model_dir")
    present = _run_files(model_dir)
    if present:
        raise UsageError(f"--model_dir={model_dir} already holds files named as a run's "
                         f"({', '.join(present)}) but no {RUN_FILE}: not a tfmulti run's "
                         "folder; choose another --model_dir")
    storage.write_json(path, run)
    return None


def check_variables(earlier, run, model_dir):
    """UsageError naming the first variable that differs when the model changed since the
    run started (your function edited, another tfmulti's model): its checkpoint would not
    fit. Shapes are compared in order, as the checkpoint holds them; Keras's names (conv2d_3)
    depend on what else the process built, so they only help to find the variable."""
    was, now = earlier.get("model_variables"), run.get("model_variables")
    if was is None or now is None:
        return
    shapes_was, shapes_now = ([v.rsplit(" ", 1)[1] for v in vs] for vs in (was, now))
    if shapes_was == shapes_now:
        return
    first = next((i for i, (a, b) in enumerate(zip(shapes_was, shapes_now)) if a != b),
                 min(len(was), len(now)))
    before = was[first] if first < len(was) else "none"
    after = now[first] if first < len(now) else "none"
    raise UsageError(f"--model_dir={model_dir}: the model's variables changed since the run "
                     f"started: variable {first + 1} was {before}, is {after} now; restore "
                     "the code it started with, or pass --overwrite to start over")


def changed_code(earlier: dict[str, Any], run: dict[str, Any]) -> str:
    """'my_models.py (--model) changed since the run started; resuming with it as it is now'
    when a file of your code changed, else ''."""
    notes = []
    for kind, now in run.get("your_code", {}).items():
        was = earlier.get("your_code", {}).get(kind)
        if was and now.get("sha256") and was.get("sha256") != now["sha256"]:
            notes.append(f"{now['file']} (--{kind}={now['module']}:{now['function']})")
    if not notes:
        return ""
    return (f"{' and '.join(notes)} changed since the run started (another hash); resuming "
            "with the code as it is now")


def _as_flag(key):
    return f"--{key}" if key in config.FIELDS or key == "global_batch_size" else key


def topology_change(earlier: dict[str, Any], run: dict[str, Any]) -> str:
    """'on 1 replica, was 2' (and workers) when a resumed run's devices changed, else ''."""
    def count(n, what):
        return f"{n} {what}{'s' if n != 1 else ''}"

    changed = [f"on {count(run[k], what)}, was {earlier[k]}" for k, what in
               (("replicas", "replica"), ("workers", "worker"))
               if earlier.get(k) is not None and earlier[k] != run[k]]
    return "; ".join(changed)


def replicas_as_micro_batches(earlier: dict[str, Any], run: dict[str, Any],
                              grad_accum_steps: int, model: Any = None) -> int:
    """k > 1 when a run resumed on fewer replicas is to take each replica's batch in k
    micro-batches, the batches the earlier run's k times as many replicas took (its replica
    count a multiple of this one's, no micro-batches of its own): each micro-batch's gradient
    is then one of the earlier replicas', and their sum the earlier all-reduce's (in any
    order for two). Else 1, also for a model with synchronized batch norm (its statistics
    were over the global batch: a micro-batch's would be over a part of it)."""
    was, now = earlier.get("replicas"), run.get("replicas")
    if not was or not now or was <= now or was % now or grad_accum_steps != 1:
        return 1
    if model is not None and any(layer.synchronized for layer in _batch_norms(model)):
        return 1
    return was // now


def _batch_norms(model: Any) -> list[Any]:
    """The model's batch norm layers, nested ones included."""
    import keras

    # every nested layer (Keras 3 has no public walk of them)
    layers = model._flatten_layers(include_self=False) if hasattr(model, "_flatten_layers") else []
    return [layer for layer in layers if isinstance(layer, keras.layers.BatchNormalization)]


def replica_threads_as_recorded(cfg: Any, plan: Any) -> int:
    """The intra-op threads each CPU replica of the run in cfg.model_dir had, when this
    command resumes it on fewer CPU replicas (replicas_as_micro_batches) and does not set
    --intra_op_threads: each micro-batch then runs the kernels a replica ran, thread for
    thread, so the step is the earlier replicas' bit for bit. Else 0 (this run's own)."""
    if (plan.kind != "cpu" or cfg.intra_op_threads or cfg.overwrite or not cfg.model_dir
            or cfg.grad_accum_steps != 1 or cfg.sync_batchnorm):
        return 0
    try:
        earlier = storage.read_json(storage.join(cfg.model_dir, RUN_FILE))
    except (OSError, ValueError):
        return 0  # no run there yet (or not one to resume: opening it says why)
    was = earlier.get("replicas") if isinstance(earlier, dict) else None
    if not isinstance(was, int) or replicas_as_micro_batches(
            {"replicas": was}, {"replicas": plan.count}, 1) == 1:
        return 0
    return max(1, devices.usable_cores() // was)


def elastic_guarantee(model: Any, per_replica: int, micro_batches: int = 1,
                      was: int = 0, now: int = 0) -> str:
    """What a run resumed on another device count keeps of the uninterrupted run (said after
    topology_change): the same batches in the same order; batch norm's statistics over each
    replica's own batch unless synchronized.

    From 2 replicas to 1 (replicas_as_micro_batches) the 2 replicas' batches as micro-batches
    whose 2 gradients are added as the all-reduce added them: bit for bit where each
    micro-batch's kernels are the earlier replica's (a GPU; CPU replicas given the same
    threads each), batch norm's moving statistics aside (ResNet-18: its trainable weights bit
    for bit). Any other count sums the gradients in another order: each step within rounding
    of the uninterrupted run's (about 1e-8 of the largest weight,
    benchmarks/results/elastic_drift.json), and training grows that difference as it grows
    the difference between two counts from the start: over a real-length run the resumed run
    ends about as far from the uninterrupted one as a run on the new count from the start
    (0.34x to 1.1x that distance, benchmarks/results/elastic_bound.json)."""
    bound = ("each step within rounding of the uninterrupted run's, and the run ends about as "
             "far from it as a run on " + (f"{now} replica{'s' * (now != 1)}" if now else
                                           "this device count")
             + " from the start (docs/faults-and-workers.md)")
    if micro_batches > 1:
        exact = micro_batches == 2 and was == 2  # a sum of 2 is the same in either order
        return (f"each step takes its {micro_batches} micro-batches of "
                f"{per_replica // micro_batches} as the {was} replicas took them, their "
                "gradients summed " + (
                    "as they were: the uninterrupted run's arithmetic (bit for bit where each "
                    "micro-batch runs the kernels a replica ran: on CPUs with a replica's "
                    "threads, taken unless --intra_op_threads is given)" if exact
                    else "in another order: " + bound) + (
                    "; batch norm's moving statistics updated after each micro-batch (the "
                    "replicas averaged theirs): evaluation can differ" if _batch_norms(model)
                    else ""))
    said = "the same batches, their gradients summed in another order: " + bound
    if any(not layer.synchronized for layer in _batch_norms(model)):
        said += (f"; batch norm's statistics now over each replica's {per_replica} examples "
                 "(--sync_batchnorm: over the global batch)")
    return said


NO_SPACE = "No space left on device"


@contextlib.contextmanager
def said_when_full(model_dir: str, checkpoints: str) -> Iterator[None]:
    """A full file system while the block writes the run (a checkpoint, the report, the
    export) is one line (UserError) naming the folder and the newest good checkpoint, which
    is kept; the partial checkpoint (a ckpt-N_temp folder) is removed, freeing its space."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - anything else is raised as it is
        if NO_SPACE not in str(e) and getattr(e, "errno", None) != errno.ENOSPC:
            raise
        import tensorflow as tf

        partial = [n.rstrip("/") for n in storage.listdir(checkpoints)
                   if n.rstrip("/").endswith("_temp")] if storage.isdir(checkpoints) else []
        for name in partial:
            storage.remove(storage.join(checkpoints, name))
        newest = tf.train.latest_checkpoint(checkpoints) if storage.isdir(checkpoints) else None
        kept = (f"the newest good checkpoint, {posixpath.basename(newest)}, is kept" if newest
                else "no checkpoint was saved yet")
        raise UserError(f"--model_dir={model_dir} is on a full file system ({NO_SPACE}); "
                        f"{kept}: free space there and run the same command again to resume"
                        ) from None


def _list_in_state_file(checkpoints: str, paths: list[str]) -> None:
    """The state file of the folder `checkpoints` (tf.train.CheckpointManager's text
    CheckpointState) listing `paths`, the last the newest, each with its index's time, as the
    manager writes it: the manager rotates those it finds with a time (TensorFlow's
    update_checkpoint_state writes none, and the manager would then keep them forever)."""
    import tensorflow as tf

    times = [tf.io.gfile.stat(f"{p}.index").mtime_nsec / 1e9 for p in paths]
    lines = [f'model_checkpoint_path: "{posixpath.basename(paths[-1])}"']
    lines += [f'all_model_checkpoint_paths: "{posixpath.basename(p)}"' for p in paths]
    lines += [f"all_model_checkpoint_timestamps: {t!r}" for t in times]
    lines.append(f"last_preserved_timestamp: {min(times) - 1.0!r}")
    storage.write_bytes(storage.join(checkpoints, "checkpoint"),
                        ("\n".join(lines) + "\n").encode())


def restore_latest(eng, checkpoints, say=print):
    """Restores the newest readable checkpoint in the folder `checkpoints`
    (saved_checkpoints: a whole one its state file missed included); returns its step (0
    with none).

    An unreadable one (corrupt or partial files) is reported and the one before it is tried;
    if none can be read, the run is refused rather than silently started over. The state
    file is then made to list the checkpoint restored last, so the run's checkpoint manager
    keeps and rotates it."""
    import tensorflow as tf

    saved = saved_checkpoints(checkpoints)
    tried = list(reversed(saved))
    for path in tried:
        try:
            eng.restore(path)
        except Exception as e:  # corrupt files surface as OpError, IndexError, ValueError...
            reason = first_line(e, 150)
            say(f"checkpoint {posixpath.basename(path)} is unreadable ({reason}); "
                "falling back to the one before it")
            continue
        state = tf.train.get_checkpoint_state(checkpoints)
        if not state or state.model_checkpoint_path != path:
            _list_in_state_file(checkpoints, saved[:saved.index(path) + 1])
        return eng.step
    if tried:
        raise UsageError(f"no readable checkpoint in {posixpath.dirname(tried[0])}; pass "
                         "--overwrite to start the run over")
    return 0


def start_point(eng: Any, model_dir: str, run: dict[str, Any], role: Role,
                say: Callable[[str], None] = print) -> tuple[int, dict[str, Any] | None]:
    """(The step this run starts after, 0 for a new run, the same on every worker; the
    earlier run.json on the chief of a resumed run, else None).

    The chief alone decides: it opens or refuses the run, removes folders that killed
    workers left, and restores the newest readable checkpoint. Then every worker learns the
    chief's step (a collective, so nobody reads model_dir before the chief is done with it)
    and the others restore that very checkpoint."""
    chief, several = role.leads, role is not Role.ALONE
    step, refusal, earlier = 0, None, None
    if chief:
        try:
            earlier = open_run(model_dir, run)
            if several:
                for name in _scratch_folders(model_dir):
                    storage.remove(storage.join(model_dir, name))
            if earlier is not None:
                step = restore_latest(eng, storage.join(model_dir, CHECKPOINT_DIR), say)
        except UsageError as e:
            step, refusal = -1, e
    if several:
        from tfmulti.distribution import workers  # TensorFlow: only with a strategy

        step = workers.broadcast_from_chief(eng.strategy, step)
    if refusal is not None:
        raise refusal
    if step < 0:
        raise UsageError("the chief (worker 0) refused the run; its output says why")
    if not chief and step > 0:
        eng.restore(storage.join(model_dir, CHECKPOINT_DIR, f"ckpt-{step}"))
    return step, earlier
