"""The main job as a library function: data + model + engine + report, for any strategy.

Where the run lives and whether it resumes is rundir/lifecycle.py's business; this module trains.
"""
from __future__ import annotations

import contextlib
import signal
import threading
from typing import TYPE_CHECKING, Any

import keras
import tensorflow as tf

from tfmulti import kernels, tfprivate
from tfmulti.accounting import flops
from tfmulti.data import pipeline, validation, weighting
from tfmulti.data import service as data_service
from tfmulti.data.dataset import example_count
from tfmulti.distribution import allocator, devices, storage, workers
from tfmulti.distribution.startup import Role
from tfmulti.errors import UsageError
from tfmulti.models import ownstep, task, usermodel, zoo
from tfmulti.processes import ctrl_c
from tfmulti.processes import watchdog as watchdogs
from tfmulti.run import callbacks, config, usercode
from tfmulti.run.plan import eval_steps, run_plan
from tfmulti.rundir import export, lifecycle, report
from tfmulti.training import actions, compiled, engine, loop, optim, xla

if TYPE_CHECKING:
    from collections.abc import Callable

    import tensorflow as tf

    from tfmulti.data.dataset import DataSet
    from tfmulti.run.config import RunConfig
    from tfmulti.run.plan import RunPlan


@contextlib.contextmanager
def stop_on_request(say=print):
    """Yields a callable that gives what asked the run to stop ('SIGTERM', how clusters
    preempt, or 'Ctrl-C', SIGINT) once it has arrived, else ''. The run then stops at a step
    every worker agrees on and saves. A second Ctrl-C stops at once (KeyboardInterrupt)."""
    requested = []
    if threading.current_thread() is not threading.main_thread():
        yield lambda: ""
        return

    ctrl_c.stop_if_arrived()  # a Ctrl-C during the start that TensorFlow swallowed

    def on_sigint(signum, frame):
        if "Ctrl-C" in requested:
            ctrl_c.record()
            raise KeyboardInterrupt
        requested.append("Ctrl-C")
        say("\nCtrl-C: stopping after the steps under way, with a checkpoint (Ctrl-C again "
            "stops at once, without one)")

    previous = {signal.SIGTERM: signal.signal(signal.SIGTERM,
                                              lambda signum, frame: requested.append("SIGTERM"))}
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:  # ignored: kept so (a job in
        previous[signal.SIGINT] = signal.signal(signal.SIGINT, on_sigint)  # the background)
    try:
        yield lambda: requested[0] if requested else ""
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def build_engine(strategy: tf.distribute.Strategy, cfg: RunConfig, resolved: RunPlan,
                 dataset: DataSet) -> engine.Engine:
    """The engine of cfg: its model (for the data set's images and classes) and its optimizer
    (the plan's learning rate; the kind and settings of the model's own when it is
    compiled), built in the strategy's scope."""
    built = []

    def model_fn():
        built.append(zoo.build(cfg.model, cfg.width, dataset.input_shape,
                                  dataset.num_classes, dtype=cfg.dtype, init=cfg.init,
                                  sync_batchnorm=cfg.sync_batchnorm, seed=cfg.seed,
                                  hparams=cfg.model_hparams))
        return built[-1]

    return engine.Engine(
        strategy, model_fn,
        optim.optimizer_fn(cfg, resolved, own=lambda: compiled.own_optimizer(built[-1])),
        resolved.global_batch_size,
        loss_scaling=cfg.dtype == "mixed_float16", steps_per_call=cfg.steps_per_call,
        grad_accum_steps=cfg.grad_accum_steps, allreduce_dtype=cfg.allreduce_dtype,
        task_fn=lambda model: task.Task(model, dataset, cfg.model,
                                        own_step=usermodel.trains_own(model)),
        jit_compile=cfg.jit_compile == "on", spec=cfg.model)


def user_callbacks(cfg: RunConfig, eng: engine.Engine, steps: int, verbose: int
                   ) -> actions.YourCallbacks | None:
    """Your callbacks (--callbacks=MODULE:FUNCTION: FUNCTION() returns them, called in the
    strategy's scope), ready for the loop; None without the flag."""
    if not cfg.callbacks:
        return None
    function = usercode.load_function(cfg.callbacks, "--callbacks")
    with eng.strategy.scope():
        made = usercode.call(cfg.callbacks, "--callbacks", function)
    inner = getattr(eng.optimizer, "inner_optimizer", eng.optimizer)
    settable = isinstance(getattr(inner, "_learning_rate", None), keras.Variable)
    return actions.YourCallbacks(callbacks.checked(made, cfg.callbacks, settable), eng,
                                 cfg.epochs, steps, verbose)


def xla_line(eng: engine.Engine, cfg: RunConfig, dataset: DataSet, per_replica: int) -> str:
    """What the run says of XLA before its first step, XLA turned off where it is not to be
    used: --jit_compile=on, the replica's step compiled, or (XLA cannot compile it) why not;
    auto, the doctor's verdict for this model and batch on these devices (xla.auto)."""
    said = ""
    if eng.own_training:  # fit does not compile a step with XLA under tf.distribute either
        eng.use_xla(False)
        return ("XLA: off, training without it: your model's own step runs as model.fit runs "
                "it under tf.distribute" if cfg.jit_compile == "on" else "")
    if cfg.jit_compile == "auto":
        on, said = xla.auto(xla.verdict_key(cfg, per_replica,
                                            eng.strategy.extended.worker_devices[0]))
        eng.use_xla(on)
    if not eng.jit_compile:
        return said
    refused = xla.refusal_on_first_batch(eng.xla_refusal, dataset, per_replica, cfg.seed)
    if refused:
        eng.use_xla(False)
        return f"XLA: off, training without it: {refused} (--jit_compile={cfg.jit_compile})"
    return said or "XLA: each replica's forward and backward pass compiled (--jit_compile=on)"


def saving(watchdog: watchdogs.Watchdog | None):
    """A context in which `watchdog` (if any) does not stop the process: a checkpoint is
    being written."""
    return watchdog.paused() if watchdog is not None else contextlib.nullcontext()


@contextlib.contextmanager
def watched(watchdog: watchdogs.Watchdog | None):
    """The block with `watchdog` watching (None: nothing), stopped after it."""
    try:
        yield
    finally:
        if watchdog is not None:
            watchdog.stop()


def train_and_evaluate(strategy: tf.distribute.Strategy, dataset: DataSet, cfg: RunConfig, *,
                       model_dir: str | None = None, verbose: int = 1,
                       command: str | None = None,
                       role: Role = Role.ALONE, test: bool = True, write_model: bool = True,
                       after_epoch: Callable[[dict[str, Any]], None] | None = None,
                       batch_search: dict[str, Any] | None = None
                       ) -> tuple[str, list[dict[str, Any]]]:
    """Trains as the RunConfig cfg says on `dataset` under `strategy`; returns (the book's
    line, history).

    model_dir None writes nothing (tests); otherwise the report files and checkpoints (every
    cfg.checkpoint_steps steps and at each epoch's end) go there, and the same run there is
    resumed, on any number of replicas and workers at the same global batch. SIGTERM saves a
    checkpoint and raises loop.Preempted.

    role: this process's startup.Role. With several workers the chief writes the report and
    the checkpoints; the others restore the checkpoint the chief chose and save theirs (saving
    is collective) to a scratch folder of their own that they remove at the end. model_dir
    may be on any file system TensorFlow knows (see storage.py).

    cfg.validation_split holds that part of the training data out (validation.py) and
    evaluates on it at each epoch's end (val_ figures) before the test set; test False
    leaves the test set untouched (a tuning trial, which chooses on the validation part).
    write_model False writes no model files and no plot (a trial); after_epoch(row) runs
    after each epoch's report and checkpoint, and may stop the run by raising (a trial
    pruned). batch_search: how --per_replica_batch_size=auto found the batch (run.json and
    metrics.json keep it).
    """
    chief = role.leads
    dataset, held_out = validation.split(dataset, cfg.validation_split, cfg.seed)
    resolved = run_plan(cfg, strategy.num_replicas_in_sync, dataset.train_size,
                        dataset.test_size)
    eng = build_engine(strategy, cfg, resolved, dataset)
    test = test and dataset.test_size > 0  # no test part: nothing to test
    ownstep.check_evaluated(eng.model, cfg.model, [
        part for part, given in (("test", test), ("validation", held_out is not None))
        if given])
    resolved = compiled.as_trained(cfg, resolved, eng.compiled_optimizer)  # a rate kept
    xla_said = xla_line(eng, cfg, dataset, resolved.per_replica_batch_size)
    peak = flops.Peak(strategy, cfg.dtype)  # the MFU's denominator
    if cfg.show_replicas:
        show_replicas(eng)
    run_json, info = run_files_info(eng, cfg, dataset, held_out, resolved, peak, command,
                                    batch_search)
    say = print if verbose and chief else (lambda *a: None)
    saver, history = (checkpoints_of(eng, cfg, model_dir, run_json, role, resolved, say)
                      if model_dir is not None else (None, []))
    stopped = loop.stopped_by_callbacks(history)
    run = report.RunReport(model_dir, {**info, "outputs": eng.task.names}, history=history,
                           write_files=model_dir is not None and chief,
                           serving_features=export.serving_inputs(dataset, eng.task.classifier),
                           draw=write_model)
    watchdog = (watchdogs.Watchdog(cfg.worker_timeout, cfg.data_service)
                if cfg.data_service else None)
    verbose = verbose if chief else 0
    todo = not stopped and eng.step < cfg.epochs * resolved.steps_per_epoch
    if verbose and todo:
        announce(eng, cfg, dataset, held_out, resolved, info, xla_said)
    full = (lifecycle.said_when_full(model_dir, saver.directory) if saver is not None
            else contextlib.nullcontext())
    with stop_on_request() as stop, full, watched(watchdog):
        loop.fit(eng, train_input(eng, cfg, dataset, resolved.per_replica_batch_size,
                                  model_dir),
                 evaluations(dataset, held_out, resolved.per_replica_batch_size,
                             resolved.global_batch_size, test),
                 cfg.epochs if not stopped else 0, resolved.steps_per_epoch,
                 actions_of(eng, cfg, run, saver, watchdog, stop, after_epoch,
                            resolved.steps_per_epoch, verbose, dataset.example_word, todo),
                 checkpoint_every=cfg.checkpoint_steps if saver else 0,
                 stop=stop if saver else None, peak_flops=peak)
    return finished(strategy, eng, cfg, run, saver, role, model_dir, write_model)


def show_replicas(eng: engine.Engine) -> None:
    """--show_replicas: the first values of the model's first variable on each replica."""
    first = eng.model.trainable_variables[0]
    print(f"{first.path}, first values on each replica:")
    for device, values in workers.replica_values(eng.strategy, first):
        print(f"  {device}: {values}")


def run_files_info(eng: engine.Engine, cfg: RunConfig, dataset: DataSet, held_out: Any,
                   resolved: RunPlan, peak: flops.Peak, command: str | None,
                   batch_search: dict[str, Any] | None) -> tuple[dict, dict]:
    """(run.json's content, what the report says of the run besides it)."""
    strategy = eng.strategy
    run_json = lifecycle.run_file(cfg, dataset, resolved.global_batch_size,
                                  strategy.num_replicas_in_sync,
                                  devices.worker_count(strategy), eng.model)
    run_json["cpu_kernels"] = kernels.described(
        tfprivate.onednn_on(), kernels.chosen_by(),
        tf.config.threading.get_intra_op_parallelism_threads(),
        tf.config.threading.get_inter_op_parallelism_threads(), kernels.cpu_has_avx512())
    if batch_search is not None:
        run_json["batch_search"] = batch_search
    if cfg.data_service:  # what the data keeps of its order and resume (data/service.py)
        run_json["data_service"] = {
            "dispatcher": cfg.data_service,
            "guarantee": data_service.guarantee(dataset.train_features)}
    info = {**{k: v for k, v in run_json.items() if k != "model_variables"},
            "model": cfg.model, "devices": devices.replica_names(strategy),
            "per_replica_batch_size": resolved.per_replica_batch_size,
            "learning_rate": (eng.learning_rate() if eng.own_optimizers
                              else resolved.learning_rate),  # a GAN's: its own optimizers'
            "steps_per_epoch": resolved.steps_per_epoch,
            "metrics": eng.metric_names, "primary_metric": eng.task.primary,
            "examples_word": dataset.example_word, "xla": eng.jit_compile,
            "peak_gflops": peak.flops / 1e9, "peak_source": peak.source,
            "validation_examples": example_count(held_out[0]) if held_out is not None else 0,
            "versions": report.versions(), "command": command}
    return run_json, info


def checkpoints_of(eng: engine.Engine, cfg: RunConfig, model_dir: str, run_json: dict,
                   role: Role, resolved: RunPlan, say: Callable[[str], None]
                   ) -> tuple[Any, list[dict[str, Any]]]:
    """(the run's checkpoint manager, the epochs already recorded): the run in model_dir
    restored where it stopped (lifecycle.start_point), on fewer replicas with the earlier
    replicas' batches as micro-batches, and what it is resumed as said."""
    step, earlier = lifecycle.start_point(eng, model_dir, run_json, role, say)
    saver = eng.checkpoint_manager(
        storage.join(model_dir, lifecycle.CHECKPOINT_DIR) if role.leads else
        storage.join(model_dir, storage.own_name(f"{lifecycle.SCRATCH_PREFIX}{role.value}")))
    changed = lifecycle.changed_code(earlier, run_json) if earlier is not None else ""
    if changed:
        say(changed)
    if not step:
        return saver, []
    history = [r for r in report.read_history(model_dir) if r["step"] <= step]
    stopped = loop.stopped_by_callbacks(history)
    earlier = earlier or {}
    change = lifecycle.topology_change(earlier, run_json)
    # on fewer replicas: the earlier replicas' batches as micro-batches
    micro = lifecycle.replicas_as_micro_batches(earlier, run_json, cfg.grad_accum_steps,
                                                eng.model)
    if micro > 1:
        eng.take_micro_batches(micro)
    per_replica = resolved.per_replica_batch_size
    guarantee = lifecycle.elastic_guarantee(eng.model, per_replica, micro,
                                            earlier.get("replicas", 0),
                                            run_json.get("replicas", 0))
    say((f"Resuming the run in {model_dir} at step {step + 1}"
         if step < cfg.epochs * resolved.steps_per_epoch and not stopped
         else f"The run in {model_dir} is complete ({step} steps"
         + (", stopped by your callbacks)" if stopped else ")"))
        + (f" {change} (global batch {resolved.global_batch_size}, {per_replica} per "
           f"replica): {guarantee}" if change else ""))
    return saver, history


def announce(eng: engine.Engine, cfg: RunConfig, dataset: DataSet, held_out: Any,
             resolved: RunPlan, info: dict[str, Any], xla_said: str) -> None:
    """The lines before the first step: where the data comes from and what it holds, what
    the model's own compile keeps, XLA, and what trains on what."""
    served = ((f"Training batches from the tf.data service at "
               f"{config.host_port(cfg.data_service)}: "
               f"{data_service.guarantee(dataset.train_features)}",)
              if cfg.data_service else ())
    notes = (*served, dataset.reading, *dataset.notes, weighting.line(dataset, cfg),
             *(compiled.lines(cfg, resolved, eng.compiled_optimizer)  # a GAN's own
               if not eng.own_optimizers else ()),  # are said below
             xla_said,
             ownstep.line(eng.model, cfg.model))
    for note in filter(None, notes):
        print(note)
    per_replica = resolved.per_replica_batch_size
    accum = (f", {eng.grad_accum_steps} micro-batches of "
             f"{per_replica // eng.grad_accum_steps}" if eng.grad_accum_steps > 1 else "")
    kind = (f"{dataset.num_classes} classes" if eng.task.classifier else
            "reporting " + ", ".join(["loss", *eng.task.metric_names])
            if usermodel.callable_model(eng.model) else "reporting its train_step's logs")
    held = ("" if held_out is None else
            f", validating on its split {cfg.validation_set} "
            f"({info['validation_examples']})" if cfg.validation_set else
            f", {info['validation_examples']} held out for validation")
    print(f"Training {cfg.model} on {dataset.display_name} ({dataset.train_size} "
          f"{dataset.example_word}{held}, {kind}) on [{', '.join(info['devices'])}]: global "
          f"batch {resolved.global_batch_size} ({per_replica} per replica{accum}), learning "
          f"rate {info['learning_rate']:g}")
    if any("CPU" in device for device in info["devices"]):  # replicas on the CPU
        print(kernels.line(info["cpu_kernels"]))
        said = allocator.run_line()  # glibc's, and whether its buffers are kept
        if said:
            print(said)


def train_input(eng: engine.Engine, cfg: RunConfig, dataset: DataSet, per_replica: int,
                model_dir: str | None) -> Callable:
    """The training batches' input function, from the step the engine is at."""
    return pipeline.train_input_fn(
        dataset.train_features, dataset.train_targets, per_replica, cfg.seed,
        start_step=eng.step, images=dataset.images, service=cfg.data_service,
        job_name=data_service.shared_job(cluster_of(eng.strategy), model_dir, eng.step),
        weights=weighting.train_weights(dataset, cfg))


def actions_of(eng: engine.Engine, cfg: RunConfig, run: report.RunReport, saver: Any,
               watchdog: watchdogs.Watchdog | None, stop: Callable[[], str],
               after_epoch: Callable[[dict[str, Any]], None] | None, steps: int, verbose: int,
               examples: str, todo: bool) -> list[loop.Action]:
    """What the run does around its steps, in the order they act (actions.py)."""
    checkpoints = (actions.Checkpoints(saver, cfg.checkpoint_steps, lambda: saving(watchdog))
                   if saver is not None else None)
    return [
        *([actions.Progress(cfg.epochs, steps, examples)] if verbose else []),
        *([actions.Watched(watchdog)] if watchdog is not None else []),
        *filter(None, [user_callbacks(cfg, eng, steps, verbose) if todo else None]),
        actions.Reported(run, eng),
        *([checkpoints] if checkpoints is not None else []),
        *([actions.AfterEpoch(after_epoch)] if after_epoch is not None else []),
        *([actions.Preemption(stop, checkpoints)] if checkpoints is not None else []),
    ]


def finished(strategy: tf.distribute.Strategy, eng: engine.Engine, cfg: RunConfig,
             run: report.RunReport, saver: Any, role: Role, model_dir: str | None,
             write_model: bool) -> tuple[str, list[dict[str, Any]]]:
    """The run's end on every worker: the scratch checkpoints of a worker that is not the
    chief removed, the workers' weights compared, the report finished (the model written
    unless write_model is False); (the book's line, the history)."""
    if not role.leads and saver is not None:
        storage.remove(saver.directory)
    prints = workers.every_workers_fingerprint(strategy, eng.model)  # a collective: on every
    if role is Role.CHIEF:  # worker; every worker must hold the same weights: show it
        print(workers.fingerprint_line(prints), flush=True)
    if not run.history:
        raise UsageError(f"--epochs={cfg.epochs} ends before the run's {eng.step} steps")
    with (lifecycle.said_when_full(model_dir, saver.directory) if saver is not None
          else contextlib.nullcontext()):
        finished = run.finish(eng.model if write_model else None, fingerprints=prints), run.history
    if role is not Role.ALONE:
        workers.leave_together(strategy)
    return finished


def cluster_of(strategy) -> dict | None:
    """The cluster a multi-worker strategy trains on (task type -> addresses), else None."""
    resolver = getattr(strategy, "cluster_resolver", None)
    spec = resolver.cluster_spec().as_dict() if resolver is not None else {}
    return spec or None


def evaluations(dataset, held_out, per_replica, global_batch, test=True):
    """loop.fit's evaluations: the validation part (held_out: (features, targets[, sample
    weights]), or None) and the test set (unless test is False), each with its steps at this
    batch; each weighed by your sample weights where the data set has them."""
    parts = {"val": held_out} if held_out is not None else {}
    if test:
        parts["test"] = (dataset.test_features, dataset.test_targets,
                         *(() if dataset.test_weights is None else (dataset.test_weights,)))
    return {part: (pipeline.eval_input_fn(*arrays[:2], per_replica, images=dataset.images,
                                          weights=arrays[2] if len(arrays) > 2 else None),
                   eval_steps(example_count(arrays[0]), global_batch))
            for part, arrays in parts.items()}
