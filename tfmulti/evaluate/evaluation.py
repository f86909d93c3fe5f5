"""A finished run's model on a data set: loss and every metric; for a classifier also
accuracy, per-class accuracy and the confusion matrix (python -m tfmulti.evaluate:
evaluate_run)."""
from __future__ import annotations

import dataclasses
import io
import re
import sys
from typing import TYPE_CHECKING, Any

import numpy as np

from tfmulti.data.dataset import structure_text
from tfmulti.distribution import storage
from tfmulti.errors import UsageError, first_line
from tfmulti.models import usermodel
from tfmulti.run import config, datasets, usercode
from tfmulti.rundir import lifecycle
from tfmulti.rundir.lifecycle import CHECKPOINT_DIR
from tfmulti.rundir.names import METRICS_FILE, MODEL_FILE, WEIGHTS_FILE

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

BATCH = 256


@dataclasses.dataclass(frozen=True)
class Evaluated:
    """What evaluate_run found and wrote."""
    dataset_name: str
    result: dict  # evaluate()'s
    report_file: str
    picture: str  # the confusion matrix ("" for a model that is not a classifier)
    metrics: tuple = ()  # the model's metric names, as result holds them
    examples: str = "images"  # what the data set counts


def evaluate_run(model_dir: str | None, given: Mapping[str, Any]) -> Evaluated:
    """The finished run in model_dir on its own test set, or on the data set `given` names
    (data flags -> values: dataset, data_dir, image_size, synthetic sizes), which must have
    the run's classes and image shape; writes evaluation-<data set>.json and
    confusion-<data set>.png to the run's folder."""
    from tfmulti.data import sources
    from tfmulti.rundir import report

    if not model_dir:
        raise UsageError("give --model_dir=RUN, the folder of a finished run")
    run = lifecycle.read_run(model_dir)
    model_path = storage.join(model_dir, MODEL_FILE)
    saved = storage.exists(model_path)
    if not saved and storage.exists(storage.join(model_dir, WEIGHTS_FILE)):
        raise UsageError(f"--model_dir={model_dir}: its model has no call() (a VAE, a GAN: it "
                         f"only trains), so there is nothing to evaluate; its weights are in "
                         f"{WEIGHTS_FILE}")
    if not saved and "summary" not in _metrics(model_dir):
        raise UsageError(f"--model_dir={model_dir} holds no {MODEL_FILE}: the run has not "
                         "finished (run its command again to resume it)")
    given = dict(given)
    if "dataset" in given:
        given.setdefault("data_dir", None)
    cfg = dataclasses.replace(config.RunConfig.from_record(run["config"]), **given)
    for kind, spec, yours in (
            ("dataset", cfg.dataset, datasets.source_of(cfg.dataset).your_code),
            ("parse", cfg.parse, bool(cfg.parse))):
        if yours and kind not in given and not usercode.recorded_code_matches(
                spec, run.get("your_code", {}).get(kind)):
            # run.json is a file anyone may have written: its MODULE:FUNCTION is imported
            # (run) only when the file found here is the one the run recorded
            raise UsageError(f"--model_dir={model_dir}: its run.json names the "
                             f"{'data' if kind == 'dataset' else 'parse'} function {spec}, and "
                             f"the {spec.split(':')[0]} found here is not the file the run "
                             f"recorded (another hash, or none); give --{kind}={spec} yourself "
                             "to run it")
    dataset = sources.load(cfg.dataset, cfg.data_dir, cfg.synthetic_train_size,
                           cfg.synthetic_test_size, cfg.seed,
                           config.image_size(cfg.image_size) or (
                               tuple(run["image_shape"][:2]) if run["image_shape"] else None),
                           splits=(cfg.train_split, cfg.eval_split), parse=cfg.parse,
                           # as the run took them (an earlier tfmulti scaled your images)
                           as_given=cfg.features_as_given and not run["image_shape"])
    _check_same_form(cfg.dataset, dataset, run)

    from tfmulti.models import zoo  # noqa: F401 - registers tfmulti's BatchNorm (its models')

    if saved:
        try:
            model = _load_model(model_path, cfg.model, run)
        except TypeError as e:  # Keras cannot build a class of yours from its config (a layer
            # whose __init__ takes no **kwargs): your function builds it again
            if not config.MODEL_SPEC.match(cfg.model):
                raise
            print(f"{model_path} does not load ({first_line(e, 160)}): evaluating its last "
                  f"checkpoint in the model --model={cfg.model} builds")
            model, model_path = _from_checkpoint(model_dir, cfg, run, dataset)
    else:  # finished without model.keras (Keras could not save it): its last checkpoint
        model, model_path = _from_checkpoint(model_dir, cfg, run, dataset)
    result = evaluate(model, dataset)
    steps = [r["step"] for r in report.read_history(model_dir)]
    result = {"evaluated": model_path, "after_step": steps[-1] if steps else None, **result}
    label = datasets.label(cfg.dataset)
    report_file = storage.join(model_dir, f"evaluation-{label}.json")
    picture = storage.join(model_dir, f"confusion-{label}.png") if "confusion" in result else ""
    storage.write_json(report_file, {"dataset": dataset.display_name,
                                     "dataset_source": dataset.source, **result})
    if picture:
        plot_confusion(result, dataset.class_names, picture,
                       f"{run['config']['model']} on {dataset.display_name}: "
                       f"test acc {result['accuracy']:.4f}")
    return Evaluated(dataset.display_name, result, report_file, picture,
                     tuple(result.get("metrics", ())), dataset.example_word)


def _load_model(model_path, spec, run):
    """The run's saved model. Its classes of yours (a layer registered with
    keras.saving.register_keras_serializable, or any Keras class your --model module defines,
    given as load_model's custom_objects, as you would give them) exist once your module is
    imported, as the run had it: imported when the file found here is the one the run
    recorded (run.json is a file anyone may have written), else a missing class is one
    line."""
    import keras

    yours = bool(config.MODEL_SPEC.match(spec))
    recorded = yours and usercode.recorded_code_matches(
        spec, run.get("your_code", {}).get("model"))
    custom = {}
    if recorded:
        usermodel.load_function(spec)
        custom = {name: value for name, value in vars(sys.modules[spec.split(":")[0]]).items()
                  if isinstance(value, type) and issubclass(value, (
                      keras.layers.Layer, keras.losses.Loss, keras.metrics.Metric))}
    try:
        return keras.saving.load_model(model_path, custom_objects=custom)
    except TypeError as e:
        missing = re.search(r"Could not locate (?:class|function) '([^']+)'", str(e))
        if not missing:
            raise
        module, where = spec.split(":")[0], ""
        if recorded:
            where = (f" ({module}, the file the run recorded, was imported: is the class "
                     "registered there?)")
        elif yours:
            where = (f"; the {module} found here is not the file the run recorded (another "
                     f"hash, or none), so it was not imported: run evaluate where the run's "
                     f"{module} is found (the working directory or PYTHONPATH)")
        raise UsageError(f"{model_path} uses {missing.group(1)!r}, a class Keras does not "
                         f"know{where}") from None


def _metrics(model_dir):
    path = storage.join(model_dir, METRICS_FILE)
    return storage.read_json(path) if storage.exists(path) else {}


def _from_checkpoint(model_dir, cfg, run, dataset):
    """(the run's model built again by its --model and restored from its last checkpoint,
    that checkpoint's path): a finished run whose model Keras could not save (a subclassed
    model without get_config). Your --model is imported only when its file is the one the
    run recorded."""
    import tensorflow as tf

    from tfmulti.models import zoo

    if config.MODEL_SPEC.match(cfg.model) and not usercode.recorded_code_matches(
            cfg.model, run.get("your_code", {}).get("model")):
        raise UsageError(f"--model_dir={model_dir} holds no model.keras, and the "
                         f"{cfg.model.split(':')[0]} found here is not the file the run "
                         "recorded, so its model cannot be built again to restore its "
                         "checkpoint: run evaluate where the run's module is found")
    latest = tf.train.latest_checkpoint(storage.join(model_dir, CHECKPOINT_DIR))
    if latest is None:
        raise UsageError(f"--model_dir={model_dir} holds neither model.keras nor a checkpoint")
    model = zoo.build(cfg.model, cfg.width, dataset.input_shape, dataset.num_classes,
                      dtype=cfg.dtype, init=cfg.init, seed=cfg.seed, hparams=cfg.model_hparams)
    if getattr(model, "optimizer", None) is not None:  # the weights alone: the optimizer
        model._delete_tracking("optimizer")  # the checkpoint holds may be another (the engine's)
    restored = tf.train.Checkpoint(model=model).restore(latest).expect_partial()
    restored.assert_existing_objects_matched()
    return model, latest


def _listed(names, limit=6):
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names)})" if len(names) > limit else "")


def _check_same_form(spec, dataset, run):
    """UsageError unless the data set has the run's classes and features."""
    if list(dataset.class_names) != list(run["class_names"]):
        raise UsageError(f"--dataset={spec}: its classes ({_listed(dataset.class_names)})"
                         f" are not the run's ({_listed(run['class_names'])})")
    if run["image_shape"]:
        height, width, channels = run["image_shape"]
        if dataset.input_shape != (height, width, channels):
            raise UsageError(f"--dataset={spec}: images of "
                             f"{'x'.join(map(str, dataset.input_shape))}; the run's model takes "
                             f"{height}x{width}x{channels}")
        return
    if dataset.images or structure_text(dataset.train_features) != run.get("features"):
        raise UsageError(f"--dataset={spec}: features "
                         f"{structure_text(dataset.train_features)}; the run's model takes "
                         f"{run.get('features')}")


def evaluate(model, dataset):
    """{loss, every metric of the model, examples} of a Keras model on the data set's test
    split, fed as in training (images: uint8 scaled to [0, 1], a channel added); for a
    classifier also accuracy, per_class, per_class_scores and the confusion matrix. A model
    that evaluates itself (its own test_step, compute_loss or compute_metrics) is evaluated
    by Keras's evaluate, as model.evaluate gives its figures (by_its_own_test_step)."""
    import tensorflow as tf

    from tfmulti.data.pipeline import to_model_input
    from tfmulti.models import task

    if usermodel.evaluates_own(model):
        return by_its_own_test_step(model, dataset)
    judged = task.Task(model, dataset)  # the run's loss and metrics: compiled, or a classifier's
    n = dataset.test_size
    losses, predicted = [], []
    weights = dataset.test_weights  # your sample weights: as evaluate(sample_weight=) weighs
    for start in range(0, n, BATCH):
        weight = None if weights is None else tf.constant(weights[start:start + BATCH])
        features, targets = (tf.nest.map_structure(lambda a: tf.constant(a[start:start + BATCH]),
                                                   part)
                             for part in (dataset.test_features, dataset.test_targets))
        outputs = model(to_model_input(features) if dataset.images else features,
                        training=False)
        # each example's loss and its batch's share of the model's own (as evaluate adds them)
        each = judged.per_example_loss(targets, outputs)
        losses.append((each * (1.0 if weight is None else weight)
                       + task.added_losses(model.losses)).numpy())
        judged.update(judged.test_metrics, targets, outputs, sample_weight=weight)
        if judged.classifier:
            predicted.append(np.asarray(outputs).argmax(axis=1))
    result = {"loss": float(np.concatenate(losses).mean()),
              **{name: float(np.mean(metric.result())) for name, metric, _ in judged.test_metrics},
              "examples": int(n), "metrics": judged.metric_names}
    if not judged.classifier:
        return result
    labels, predicted = dataset.test_targets, np.concatenate(predicted)
    k = dataset.num_classes
    confusion = np.zeros((k, k), np.int64)
    np.add.at(confusion, (labels, predicted), 1)
    counts = confusion.sum(axis=1)
    return {
        "per_class_scores": per_class_scores(confusion, dataset.class_names),
        **result,
        "accuracy": float((predicted == labels).mean()),
        "per_class": {name: (float(confusion[i, i] / counts[i]) if counts[i] else None)
                      for i, name in enumerate(dataset.class_names)},
        "confusion": confusion.tolist(),  # rows: true class, columns: predicted
    }


def by_its_own_test_step(model, dataset):
    """{every log of the model's own test_step (its loss among them), examples, metrics}:
    Keras's evaluate on the test split (fed as in training), batches of BATCH."""
    import tensorflow as tf

    from tfmulti.data.pipeline import to_model_input

    features = tf.nest.map_structure(np.asarray, dataset.test_features)
    if dataset.images:
        features = to_model_input(tf.constant(features)).numpy()
    targets = (None if dataset.test_targets is None  # features alone: evaluate(x)
               else tf.nest.map_structure(np.asarray, dataset.test_targets))
    logs = model.evaluate(features, targets, sample_weight=dataset.test_weights,
                          batch_size=BATCH, verbose=0, return_dict=True)
    result = {name: float(np.mean(value)) for name, value in logs.items()}
    return {"loss": result.get("loss", float("nan")), **result,
            "examples": int(dataset.test_size), "metrics": [n for n in result if n != "loss"]}


def per_class_scores(confusion: np.ndarray, class_names: Sequence[str]) -> dict[str, dict]:
    """{class: precision, recall, f1, support} from a confusion matrix (rows: true class,
    columns: predicted); a score whose denominator is 0 is None."""
    confusion = np.asarray(confusion)
    hits, support, predicted = np.diag(confusion), confusion.sum(axis=1), confusion.sum(axis=0)

    def share(a, b):
        return float(a / b) if b else None

    scores = {}
    for i, name in enumerate(class_names):
        precision, recall = share(hits[i], predicted[i]), share(hits[i], support[i])
        f1 = (2 * precision * recall / (precision + recall)
              if precision is not None and recall is not None and precision + recall else
              None if precision is None or recall is None else 0.0)
        scores[name] = {"precision": precision, "recall": recall, "f1": f1,
                        "support": int(support[i])}
    return scores


def plot_confusion(result, class_names, path, title):
    """The confusion matrix as a PNG at path (rows true, columns predicted, shares of the
    row), written with storage (any file system TensorFlow knows)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    confusion = np.array(result["confusion"], np.float64)
    shares = confusion / np.maximum(confusion.sum(axis=1, keepdims=True), 1)
    k = len(class_names)
    side = min(12, 3 + 0.45 * k)
    fig, ax = plt.subplots(figsize=(side + 1, side))
    image = ax.imshow(shares, cmap="Blues", vmin=0, vmax=1)
    ax.set_xticks(range(k), class_names, rotation=60, ha="right", fontsize=8)
    ax.set_yticks(range(k), class_names, fontsize=8)
    ax.set(xlabel="predicted", ylabel="true class")
    if k <= 20:
        for i in range(k):
            for j in range(k):
                if confusion[i, j]:
                    ax.text(j, i, int(confusion[i, j]), ha="center", va="center", fontsize=7,
                            color="white" if shares[i, j] > 0.5 else "black")
    ax.set_title(title, fontsize=9)
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04, label="share of the true class")
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=100)
    plt.close(fig)
    storage.write_bytes(path, png.getvalue())
