"""Evaluates a finished run on its own test set or on any other data source:

    python -m tfmulti.evaluate --model_dir=runs/RUN [--dataset=folder:photos --data_dir=...]

Prints the loss and accuracy and writes evaluation-<data set>.json (per-class accuracy, the
confusion matrix) and confusion-<data set>.png to the run's folder. Without --dataset the run's
own data set is used (its run.json says which); another one must have the run's classes.
"""
import dataclasses

from tfmulti.data import sources
from tfmulti.distribution import storage
from tfmulti.errors import UsageError
from tfmulti.run import config, flagdefs, usercode
from tfmulti.rundir import lifecycle
from tfmulti.rundir.names import MODEL_FILE
from tfmulti.training import evaluation

DATA_FLAGS = ("dataset", "data_dir", "image_size", "synthetic_train_size",
              "synthetic_test_size")


def main():
    FLAGS = flagdefs.FLAGS
    model_dir = FLAGS.model_dir
    if not model_dir:
        raise UsageError("give --model_dir=RUN, the folder of a finished run")
    run = lifecycle.read_run(model_dir)
    model_path = storage.join(model_dir, MODEL_FILE)
    if not storage.exists(model_path):
        raise UsageError(f"--model_dir={model_dir} holds no {MODEL_FILE}: the run has not "
                         "finished (run its command again to resume it)")
    given = {name: FLAGS[name].value for name in DATA_FLAGS if FLAGS[name].present}
    if "dataset" in given:
        given.setdefault("data_dir", None)
    cfg = dataclasses.replace(config.RunConfig.from_record(run["config"]), **given)
    if "dataset" not in given and config.dataset_kind(cfg.dataset) == "function" and not (
            usercode.recorded_code_matches(cfg.dataset, run.get("your_code", {}).get("dataset"))):
        # run.json is a file anyone may have written: its MODULE:FUNCTION is imported (run)
        # only when the file found here is the one the run recorded
        raise UsageError(f"--model_dir={model_dir}: its run.json names the data function "
                         f"{cfg.dataset}, and the {cfg.dataset.split(':')[0]} found here is not "
                         "the file the run recorded (another hash, or none); give --dataset="
                         f"{cfg.dataset} yourself to run it")
    height, width, channels = run["image_shape"]
    dataset = sources.load(cfg.dataset, cfg.data_dir, cfg.synthetic_train_size,
                        cfg.synthetic_test_size, cfg.seed,
                        config.image_size(cfg.image_size) or (height, width))
    if list(dataset.class_names) != list(run["class_names"]):
        raise UsageError(f"--dataset={cfg.dataset}: its classes ({_listed(dataset.class_names)})"
                         f" are not the run's ({_listed(run['class_names'])})")
    if dataset.input_shape != (height, width, channels):
        raise UsageError(f"--dataset={cfg.dataset}: images of "
                         f"{'x'.join(map(str, dataset.input_shape))}; the run's model takes "
                         f"{height}x{width}x{channels}")
    import keras

    from tfmulti.models import zoo  # noqa: F401 - registers an older run's batch norm

    model = keras.saving.load_model(model_path)
    result = evaluation.evaluate(model, dataset)
    label = config.dataset_label(cfg.dataset)
    report_file = storage.join(model_dir, f"evaluation-{label}.json")
    picture = storage.join(model_dir, f"confusion-{label}.png")
    storage.write_json(report_file, {"dataset": dataset.display_name,
                                     "dataset_source": dataset.source, **result})
    evaluation.plot_confusion(result, dataset.class_names, picture,
                              f"{run['config']['model']} on {dataset.display_name}: "
                              f"test acc {result['accuracy']:.4f}")
    print(f"{dataset.display_name}: test loss {result['loss']:.4f}, test acc "
          f"{result['accuracy']:.4f} ({result['examples']} images)")
    worst = sorted((acc, name) for name, acc in result["per_class"].items() if acc is not None)
    print("per class: " + ", ".join(f"{name} {acc:.2f}" for acc, name in worst))
    print(f"report: {report_file}, {picture}")


def _listed(names, limit=6):
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names)})" if len(names) > limit else "")
