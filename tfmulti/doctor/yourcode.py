"""The doctor's check of your own model and data (--model=MODULE:FUNCTION, --dataset=...).

In a process of its own, on 2 logical CPU replicas whatever the machine has (so the check is
the same everywhere and never holds a GPU), as the main job would meet your code:
the data's shapes, dtypes and labels; the model's import, signature, output and last layer;
that every variable was made under the strategy (mirrored on each replica); one training step
through the real pipeline; the export round trip (SavedModel predictions = the model's).
Each finding is one line naming your function.
"""
import dataclasses
import math
import os
import tempfile

import numpy as np
import tensorflow as tf

from tfmulti.data import pipeline, sources
from tfmulti.data.dataset import structure_text
from tfmulti.data.pipeline import to_model_input
from tfmulti.distribution import devices, startup
from tfmulti.doctor.probes import sendable
from tfmulti.errors import UserError, first_line
from tfmulti.models import ownstep, task, usermodel, zoo
from tfmulti.processes import child
from tfmulti.run import config
from tfmulti.run.plan import run_plan
from tfmulti.rundir import export
from tfmulti.training import compiled, train, xla

REPLICAS = 2
STEP_BATCH = 4  # per replica, for the one step


def applies(cfg):
    """Whether cfg names code or data of yours."""
    return usermodel.is_spec(cfg.model) or cfg.dataset not in config.DATASETS


def check(report, cfg, timeout):
    """Runs the checks in a child process under `timeout` and reports each finding."""
    try:
        findings = child.run(_child, (cfg,), timeout,
                             what="the check of your model and data")
    except TimeoutError:
        report.problem(f"the check of {_yours(cfg)} (load the data, build the model, one "
                       f"step, export) did not finish in {timeout:g} s; raise --doctor_timeout "
                       "for a large model or data set")
        return
    except child.Died as e:
        findings = [("problem", "", str(e))]
    for kind, label, text in findings:
        if kind == "problem":
            report.problem(text)
        elif kind == "warn":
            report.warn(text)
        else:
            report.info(label, text)


def _yours(cfg):
    return " and ".join(x for x in ((cfg.model if usermodel.is_spec(cfg.model) else ""),
                                    (cfg.dataset if cfg.dataset not in config.DATASETS else ""))
                        if x)


def _child(send, cfg):
    findings = []
    try:
        strategy = startup.Startup(devices.DevicePlan("cpu", REPLICAS)).start()
        findings.extend(findings_of(cfg, strategy))
    except Exception as e:  # noqa: BLE001 - reported as a problem line
        findings.append(("problem", "", str(sendable(e))))
    send.send(findings)


def findings_of(cfg, strategy):
    """("info", label, text) and ("problem", "", text) findings, in the order the main job
    would meet them; the first problem ends the checks (what follows depends on it)."""
    try:
        if usermodel.is_spec(cfg.model):  # imported outside the strategy, as the main job does
            usermodel.load_function(cfg.model)
        dataset = sources.load_for(cfg)
    except UserError as e:
        yield "problem", "", str(e)
        return
    yield "info", "data", _data_line(dataset)
    if dataset.reading:
        yield "info", "", dataset.reading
    for note in dataset.notes:
        yield "warn", "", note
    try:
        zoo.check_input(cfg.model, dataset.input_shape, dataset.num_classes, dataset.images,
                        dataset.test_size > 0)
        small = dataclasses.replace(cfg, per_replica_batch_size=STEP_BATCH,
                                    global_batch_size=None, grad_accum_steps=1, steps_per_call=1)
        resolved = run_plan(small, REPLICAS, dataset.train_size, dataset.test_size)
        eng = train.build_engine(strategy, small, resolved, dataset)
    except UserError as e:
        yield "problem", "", str(e)
        return
    model = eng.model
    params = sum(math.prod(v.shape) for v in model.trainable_weights)
    judged = eng.task
    yield "info", "model", (
        f"{cfg.model}: {params:,} trainable parameters, outputs "
        f"{usermodel.output_shape(model, dataset.input_shape)} "
        f"{'probabilities' if usermodel.ends_in_probabilities(model) else 'logits'}"
        f" for {dataset.num_classes} classes" if judged.classifier and len(judged.metric_names) == 1
        else f"{cfg.model}: {params:,} trainable parameters, outputs "
             f"{', '.join(judged.names)}; reports loss, {', '.join(judged.metric_names)}"
        if judged.metric_names else f"{cfg.model}: {params:,} trainable parameters, outputs "
                                    f"{', '.join(judged.names)}; reports its loss"
        if usermodel.callable_model(model) else f"{cfg.model}: {params:,} trainable "
                                                "parameters, no call() (no outputs); reports "
                                                "its train_step's logs")
    for line in compiled.lines(small, resolved, eng.compiled_optimizer):
        yield "info", "compiled", line
    steps = ownstep.line(model, cfg.model)
    yield "info", "steps", steps or (f"{cfg.model}: tfmulti's fused step (the model overrides "
                                     "none of Keras's train_step, test_step, compute_loss, "
                                     "compute_metrics)")
    # a trainable one made outside the scope is refused when the model is built (usermodel)
    outside = [v.path for v in model.weights
               if not isinstance(v.value, tf.distribute.DistributedValues)]
    said = f"all {len(model.weights)} made under the strategy, mirrored on {REPLICAS} replicas"
    if outside:
        said = (f"{len(model.weights) - len(outside)} of {len(model.weights)} made under the "
                f"strategy, mirrored on {REPLICAS} replicas; {len(outside)} made outside it, not "
                f"trained ({outside[0]}{', ...' if len(outside) > 1 else ''}): every replica "
                "reads their one copy")
    yield "info", "variables", said
    def batches():
        return iter(eng.distribute(pipeline.train_input_fn(
            dataset.train_features, dataset.train_targets, STEP_BATCH, cfg.seed,
            images=dataset.images)))

    try:
        try:
            list(eng.train_steps(batches(), 1))
        except xla.XlaFellBack as fell:  # as the run does: one line, on without XLA
            yield "warn", "xla", f"XLA: off, training without it: {fell.reason}"
            list(eng.train_steps(batches(), 1))
        loss = eng.train_results().get("loss", 0.0)
    except UserError as e:
        yield "problem", "", str(e)
        return
    except Exception as e:  # noqa: BLE001 - your model's own failure, in one line
        yield "problem", "", (f"--model={cfg.model}: one training step on {REPLICAS} replicas "
                              f"failed: {type(e).__name__}: {first_line(e)}")
        return
    if not math.isfinite(loss):
        yield "problem", "", (f"--model={cfg.model}: one training step on {REPLICAS} replicas "
                              f"gave loss {loss}")
        return
    yield "info", "step", (f"one training step on {REPLICAS} logical CPU replicas, "
                           f"{STEP_BATCH} {dataset.example_word} each: loss {loss:.4f}")
    if not usermodel.callable_model(eng.model):  # nothing to serve (export.weights_only)
        yield "info", "export", (f"{cfg.model} has no call(): no SavedModel; a run writes its "
                                 "weights to model.weights.h5")
        return
    yield from _export_round_trip(cfg, eng.model, dataset, judged)


def _data_line(dataset):
    if dataset.images and dataset.num_classes:
        labels = np.concatenate([dataset.train_targets, dataset.test_targets])
        return (f"{dataset.display_name}: {dataset.train_size} + {dataset.test_size} "
                f"images of {'x'.join(map(str, dataset.input_shape))} {dataset.image_dtype}, "
                f"{dataset.num_classes} classes, labels {labels.min()}-{labels.max()}")
    classes = f", {dataset.num_classes} classes" if dataset.num_classes else ""
    targets = (structure_text(dataset.train_targets) if dataset.train_targets is not None
               else "none (the features alone, as fit(x) takes them)")
    return (f"{dataset.display_name}: {dataset.train_size} + {dataset.test_size} examples, "
            f"features {structure_text(dataset.train_features)}, targets {targets}{classes}")


def _export_round_trip(cfg, model, dataset, judged):
    """The SavedModel gives the model's outputs on a few test examples: an image classifier's
    logits (or probabilities) for its images, any other model's outputs by name for its
    features."""
    signature = export.serving_inputs(dataset, judged.classifier)
    classifier = signature is None or isinstance(signature, export.AsGiven)
    features = tf.nest.map_structure(lambda a: a[:8], dataset.test_features)
    if isinstance(features, dict):
        given = features
    elif isinstance(features, tuple):
        given = {f"features_{i}": array for i, array in enumerate(features)}
    elif dataset.images:
        given = {"images": features if features.ndim == 4 or not classifier else
                 features[..., None]}
    else:
        given = {"features": features}
    names = judged.names if len(judged.names) > 1 else ["outputs"]
    with tempfile.TemporaryDirectory() as folder:
        try:
            skipped = export.write(model, folder, dataset.class_names, dataset.input_shape,
                                   dataset.image_dtype, signature, judged.names)
            serve = tf.saved_model.load(os.path.join(folder, export.SAVED_MODEL_DIR)
                                        ).signatures[export.SIGNATURE]
            outputs = serve(**{k: tf.constant(v) for k, v in given.items()})
            served = ([outputs.get("logits", outputs["probabilities"]).numpy()] if classifier
                      else [outputs[n].numpy() for n in names])
        except Exception as e:  # noqa: BLE001 - one line
            yield "problem", "", (f"--model={cfg.model}: the export failed: "
                                  f"{type(e).__name__}: {first_line(e)}")
            return
    fed = to_model_input(tf.constant(features)) if dataset.images else features
    direct = [np.asarray(p, np.float32)
              for p in task.flat(model(fed, training=False), judged.names)]
    worst = max(float(np.abs(a - b).max()) for a, b in zip(served, direct))
    if worst > 1e-3 or (classifier and not np.array_equal(served[0].argmax(1),
                                                          direct[0].argmax(1))):
        yield "problem", "", (f"--model={cfg.model}: the exported SavedModel gives other "
                              f"outputs than the model (at most {worst:.2g} apart)")
        return
    if skipped:
        yield "warn", "", f"--model={cfg.model}: {skipped}"
    what = ("the model's predictions" if classifier else
            "the model's inputs to its outputs by name,")
    yield "info", "export", (f"SavedModel with a serving signature, {what} on "
                             f"{len(tf.nest.flatten(features)[0])} test {dataset.example_word} "
                             f"(outputs within {worst:.1g})")
