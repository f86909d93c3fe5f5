"""Tasks that are not image classification, built as users build them: a regression on named
inputs (also given as tf.data sets of a dict), a text classifier on token ids, a model with
two outputs and two weighted losses, images with one-hot targets, multi-label rows, per-pixel
masks, and a model compiled with a loss alone. Each trains with its own loss and metrics,
reports them by their Keras names, takes the same step on 1 and 2 replicas; the regression,
the text classifier and the two-output model resume bit for bit after a kill -9 (make soak)
and are served by their SavedModels in a process without tfmulti; what cannot train is one
line before the first step, with no run folder left behind."""
import csv
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import keras
import numpy as np
import pytest
import tensorflow as tf
from test_resume import checkpoint_steps, environment

from tfmulti.data import pipeline, sources
from tfmulti.errors import UsageError
from tfmulti.run.config import RunConfig
from tfmulti.run.plan import run_plan
from tfmulti.rundir import lifecycle
from tfmulti.training import train

USER_CODE = textwrap.dedent('''
    import keras
    import numpy as np
    from keras import layers


    def houses():
        """A price from an area and three ratings: named inputs, a float target."""
        rng = np.random.default_rng(1)
        def draw(n):
            area = rng.uniform(20, 200, n).astype("float32")
            ratings = rng.uniform(0, 1, (n, 3)).astype("float32")
            price = 0.01 * area + ratings @ np.array([1.0, -0.5, 2.0], "float32")
            return {"area": area / 100, "ratings": ratings}, price.astype("float32")
        return draw(256), draw(70)


    def regression(input_shape, num_classes):
        area = keras.Input(input_shape["area"], name="area")
        ratings = keras.Input(input_shape["ratings"], name="ratings")
        x = layers.Concatenate()([layers.Reshape((1,))(area), ratings])
        x = layers.Dense(16, activation="relu")(x)
        model = keras.Model({"area": area, "ratings": ratings}, layers.Dense(1)(x))
        model.compile(optimizer=keras.optimizers.SGD(momentum=0.9), loss="mse",
                      metrics=["mae"])
        return model


    def reviews():
        """Token ids (0 pads), the class given away by the first three words."""
        rng = np.random.default_rng(2)
        def draw(n):
            labels = rng.integers(0, 3, n)
            tokens = rng.integers(1, 60, (n, 12))
            tokens[:, :3] = 60 + labels[:, None] * 3 + rng.integers(0, 3, (n, 3))
            return tokens.astype("int32"), labels
        return draw(256), draw(70)


    def text(input_shape, num_classes):
        inputs = keras.Input(input_shape, dtype="int32")
        x = layers.GlobalAveragePooling1D()(layers.Embedding(70, 8)(inputs))
        return keras.Model(inputs, layers.Dense(num_classes)(x))


    def shapes():
        """Two targets from one row: a kind (class id) and a size (float)."""
        rng = np.random.default_rng(3)
        def draw(n):
            x = rng.normal(0, 1, (n, 6)).astype("float32")
            return x, {"kind": (x[:, 0] > 0).astype("int32") + (x[:, 1] > 0.5),
                       "size": (x[:, 2] * 2 + x[:, 3]).astype("float32")}
        return draw(256), draw(70)


    def two_outputs(input_shape, num_classes):
        inputs = keras.Input(input_shape)
        x = layers.Dense(16, activation="relu")(inputs)
        model = keras.Model(inputs, {"kind": layers.Dense(3, name="kind")(x),
                                     "size": layers.Dense(1, name="size")(x)})
        model.compile(loss={"kind": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                            "size": "mse"}, loss_weights={"kind": 1.0, "size": 0.5},
                      metrics={"kind": ["accuracy"], "size": ["mae"]})
        return model


    def one_hot_images():
        """uint8 images with one-hot targets (the model scales them, as under fit)."""
        rng = np.random.default_rng(4)
        def draw(n):
            labels = rng.integers(0, 4, n)
            images = rng.integers(0, 80, (n, 8, 8)).astype("uint8")
            images[np.arange(n), labels * 2, :] += 170
            return images[..., None], np.eye(4, dtype="float32")[labels]
        return draw(256), draw(70)


    def one_hot(input_shape, num_classes):
        inputs = keras.Input(input_shape)
        x = layers.Flatten()(layers.Rescaling(1 / 255)(inputs))
        x = layers.Dense(16, activation="relu")(x)
        model = keras.Model(inputs, layers.Dense(4)(x))
        model.compile(loss=keras.losses.CategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
        return model


    def tags():
        """Multi-label: several tags per row (multi-hot float targets)."""
        rng = np.random.default_rng(5)
        def draw(n):
            x = rng.normal(0, 1, (n, 8)).astype("float32")
            return x, (x[:, :4] > 0.3).astype("float32")
        return draw(256), draw(70)


    def multi_label(input_shape, num_classes):
        """A sigmoid per tag, and a metric Keras makes at its first update (AUC, multi_label)."""
        model = keras.Sequential([keras.Input(input_shape), layers.Dense(16, activation="relu"),
                                  layers.Dense(4, activation="sigmoid")])
        model.compile(loss="binary_crossentropy",
                      metrics=[keras.metrics.AUC(name="auc", multi_label=True)])
        return model


    def masks():
        """uint8 images with a class id per pixel (1 where the image is bright)."""
        rng = np.random.default_rng(6)
        def draw(n):
            images = rng.integers(0, 256, (n, 8, 8)).astype("uint8")
            return images[..., None], (images > 127).astype("int32")
        return draw(256), draw(70)


    def segmentation(input_shape, num_classes):
        """A logit per pixel and class, scored against the masks pixel by pixel."""
        inputs = keras.Input(input_shape)
        x = layers.Conv2D(4, 3, padding="same", activation="relu")(
            layers.Rescaling(1 / 255)(inputs))
        model = keras.Model(inputs, layers.Conv2D(2, 1)(x))
        model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
        return model


    def houses_tf_data():
        """houses() as unbatched tf.data sets of (a dict of named inputs, a price)."""
        import tensorflow as tf

        (x, y), (tx, ty) = houses()
        return (tf.data.Dataset.from_tensor_slices((x, y)),
                tf.data.Dataset.from_tensor_slices((tx, ty)), None)


    def loss_only(input_shape, num_classes):
        """A regression compiled with its loss and no metric (compiled once: Keras keeps
        the metrics of an earlier compile when a later one gives none)."""
        model = uncompiled_regression(input_shape, num_classes)
        model.compile(optimizer=keras.optimizers.SGD(momentum=0.9), loss="mse")
        return model


    # What cannot train: each refused in one line
    def uncompiled_regression(input_shape, num_classes):
        area = keras.Input(input_shape["area"], name="area")
        ratings = keras.Input(input_shape["ratings"], name="ratings")
        x = layers.Concatenate()([layers.Reshape((1,))(area), ratings])
        return keras.Model({"area": area, "ratings": ratings}, layers.Dense(1)(x))


    def wrong_width(input_shape, num_classes):
        model = regression(input_shape, num_classes)
        out = layers.Dense(3)(model.layers[-2].output)
        wide = keras.Model(model.inputs, out)
        wide.compile(loss="mse")
        return wide


    def unknown_metric(input_shape, num_classes):
        model = regression(input_shape, num_classes)
        model.compile(loss="mse", metrics=["no_such_metric"])
        return model


    def other_inputs(input_shape, num_classes):
        area = keras.Input((), name="area")
        rooms = keras.Input((3,), name="rooms")
        x = layers.Concatenate()([layers.Reshape((1,))(area), rooms])
        model = keras.Model({"area": area, "rooms": rooms}, layers.Dense(1)(x))
        model.compile(loss="mse")
        return model


    def auc_on_class_ids(input_shape, num_classes):
        model = text(input_shape, num_classes)
        model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=[keras.metrics.AUC(name="auc")])
        return model


    def crop_then_flatten(input_shape, num_classes):
        """RandomCrop crops in training only: its Flatten meets other sizes in inference."""
        inputs = keras.Input(input_shape)
        x = layers.Flatten()(layers.RandomCrop(6, 6)(inputs))
        model = keras.Model(inputs, layers.Dense(4)(x))
        model.compile(loss=keras.losses.CategoricalCrossentropy(from_logits=True))
        return model


    def size_only():
        (x, y), (tx, ty) = shapes()
        return (x, {"size": y["size"]}), (tx, {"size": ty["size"]})


    def with_color():
        (x, y), (tx, ty) = shapes()
        return ((x, {**y, "color": y["size"]}), (tx, {**ty, "color": ty["size"]}))
''')

KINDS = {  # model function, data function, the metric the book's line shows
    "regression": ("regression", "houses", "mae"),
    "text": ("text", "reviews", "accuracy"),
    "two_outputs": ("two_outputs", "shapes", "kind_accuracy"),
    "one_hot": ("one_hot", "one_hot_images", "accuracy"),
    "multi_label": ("multi_label", "tags", "auc"),
    "masks": ("segmentation", "masks", "accuracy"),
    "tf_data_dict": ("regression", "houses_tf_data", "mae"),
}


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    folder = tmp_path_factory.mktemp("project")
    (folder / "yours.py").write_text(USER_CODE)
    return folder


@pytest.fixture
def module(importable):
    return importable("yourtask", USER_CODE)


def config(module, kind, **settings):
    model, data, _ = KINDS[kind]
    return RunConfig(**{"model": f"{module}:{model}", "dataset": f"{module}:{data}",
                        "global_batch_size": 32, "epochs": 2, "base_lr": 0.4, "seed": 5,
                        **settings})


def engine_for(strategy, cfg):
    dataset = sources.load_for(cfg)
    resolved = run_plan(cfg, strategy.num_replicas_in_sync, dataset.train_size,
                        dataset.test_size)
    return train.build_engine(strategy, cfg, resolved, dataset), dataset


def one_step(strategy, cfg, start=None):
    """The weights after one step from `start` (or the model's own initial weights)."""
    eng, dataset = engine_for(strategy, cfg)
    if start is not None:
        eng.model.set_weights(start)
    first = eng.model.get_weights()
    per_replica = 32 // strategy.num_replicas_in_sync
    batches = iter(eng.distribute(pipeline.train_input_fn(
        dataset.train_features, dataset.train_targets, per_replica, cfg.seed,
        images=dataset.images)))
    list(eng.train_steps(batches, 1))
    return first, eng.model.get_weights(), eng.train_results()


@pytest.mark.parametrize("kind", list(KINDS))
def test_one_step_on_two_replicas_equals_one_step_on_one(module, kind, one_replica,
                                                         two_replicas):
    """The loss (one per output, weighted), averaged over the global batch, and the metrics
    (by their Keras names) are the same on 1 and 2 replicas."""
    cfg = config(module, kind)
    start, one, trained_one = one_step(one_replica, cfg)
    _, two, trained_two = one_step(two_replicas, cfg, start)
    for a, b in zip(one, two):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert list(trained_one) == ["loss", *{
        "regression": ["mae"], "text": ["accuracy"], "two_outputs": ["kind_accuracy", "size_mae"],
        "one_hot": ["accuracy"], "multi_label": ["auc"], "masks": ["accuracy"],
        "tf_data_dict": ["mae"]}[kind]]
    for name, value in trained_one.items():
        assert value == pytest.approx(trained_two[name], rel=1e-5), name
    assert any(not np.array_equal(a, b) for a, b in zip(start, one))  # it did train


CONSUMER = '''
import json, sys
import numpy as np
import tensorflow as tf
served = []
for model_dir, features in zip(sys.argv[1::2], sys.argv[2::2]):
    arrays = np.load(features)
    serve = tf.saved_model.load(model_dir + "/saved_model").signatures["serving_default"]
    inputs = sorted(serve.structured_input_signature[1])
    outputs = serve(**{name: tf.constant(arrays[name]) for name in inputs})
    served.append({"inputs": inputs,
                   "outputs": {name: value.numpy().tolist() for name, value in outputs.items()}})
print(json.dumps({"served": served, "tfmulti_imported": "tfmulti" in sys.modules}))
'''


def serve_without_tfmulti(scratch, *runs):
    """The served outputs of each run's saved_model/ on its features (a dict by the
    signature's input names), from one process of its own outside the repository, without
    tfmulti on its path: for each run, its signature's inputs and its outputs by name."""
    args = []
    for i, (model_dir, features) in enumerate(runs):
        np.savez(scratch / f"features{i}.npz", **features)
        args += [str(model_dir), str(scratch / f"features{i}.npz")]
    (scratch / "consumer.py").write_text(CONSUMER)
    result = subprocess.run([sys.executable, "consumer.py", *args], cwd=scratch,
                            capture_output=True, text=True, timeout=300,
                            env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert result.returncode == 0, result.stderr[-3000:]
    said = json.loads(result.stdout.strip().splitlines()[-1])
    assert said["tfmulti_imported"] is False
    return [{"inputs": run["inputs"],
             "outputs": {name: np.array(v) for name, v in run["outputs"].items()}}
            for run in said["served"]]


@pytest.fixture
def in_project(project, monkeypatch):
    """The user's project (yours.py) as the working directory and on the path, as the tools
    find a user's module; `yours` forgotten at the end of the test."""
    monkeypatch.chdir(project)
    monkeypatch.syspath_prepend(str(project))
    sys.modules.pop("yours", None)
    yield project
    sys.modules.pop("yours", None)


SERVED = {"regression": 2, "text": 1, "two_outputs": 1}  # the kinds served, their epochs


@pytest.fixture(scope="module")
def served_runs(project, two_replicas, tmp_path_factory):
    """The regression (2 epochs), the text classifier and the two-output model (1 epoch each)
    trained in this process on 2 replicas, then their SavedModels served on their test
    features by one process that never imports tfmulti (serve_without_tfmulti): kind ->
    (model_dir, data set, the book's line, history, what was served)."""
    scratch = tmp_path_factory.mktemp("served")
    runs = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(project)
        patch.syspath_prepend(str(project))
        try:
            for kind, epochs in SERVED.items():
                cfg = config("yours", kind, epochs=epochs)
                dataset = sources.load_for(cfg)
                (scratch / kind).mkdir()
                line, history = train.train_and_evaluate(two_replicas, dataset, cfg, verbose=0,
                                                         model_dir=str(scratch / kind))
                runs[kind] = (scratch / kind, dataset, line, history)
        finally:
            sys.modules.pop("yours", None)
    features = {kind: dataset.test_features if kind == "regression"
                else {"features": dataset.test_features}
                for kind, (_, dataset, _, _) in runs.items()}
    outputs = serve_without_tfmulti(scratch, *((runs[kind][0], features[kind]) for kind in runs))
    return {kind: (*runs[kind], said) for kind, said in zip(runs, outputs)}


def test_a_regression_reports_in_its_own_terms_and_serves_without_tfmulti(served_runs,
                                                                          in_project, tool):
    """metrics.json, the book's line, TensorBoard and the evaluation use the model's metric
    (mae); Keras's own evaluate of model.keras gives the reported figures; the SavedModel
    takes the named inputs and, in a process that never imports tfmulti, gives the reported
    mae."""
    model_dir, dataset, line, history, served = served_runs["regression"]
    last = history[-1]
    assert {"loss", "train_mae", "test_loss", "test_mae"} <= set(last)
    assert "test_acc" not in last and "train_acc" not in last
    assert line.startswith(f"test mae: {last['test_mae']:.4g}, ") and "examples/s" in line
    metrics = json.loads((model_dir / "metrics.json").read_text())
    assert metrics["metrics"] == ["mae"] and metrics["summary"] == line
    run = json.loads((model_dir / "run.json").read_text())
    assert run["image_shape"] is None and run["features"] == (
        "{area: float32 [n], ratings: float32 [n, 3]}") and run["targets"] == "float32 [n]"
    tags = set()
    for event in tf.compat.v1.train.summary_iterator(
            str(next((model_dir / "tensorboard" / "test").glob("events.*")))):
        tags |= {v.tag for v in event.summary.value}
    assert {"epoch_loss", "epoch_mae"} <= tags
    assert (model_dir / "accuracy.png").stat().st_size > 10_000
    assert not (model_dir / "class_names.txt").exists()

    model = keras.saving.load_model(str(model_dir / "model.keras"))
    loss, mae = model.evaluate(dataset.test_features, dataset.test_targets, verbose=0,
                               batch_size=64)
    assert (loss, mae) == (pytest.approx(last["test_loss"], rel=1e-4),
                           pytest.approx(last["test_mae"], rel=1e-4))
    assert served["inputs"] == ["area", "ratings"] and list(served["outputs"]) == ["outputs"]
    assert np.mean(np.abs(served["outputs"]["outputs"][:, 0] - dataset.test_targets)) == (
        pytest.approx(last["test_mae"], rel=1e-4))

    code, out, err = tool("evaluate", f"--model_dir={model_dir}")
    assert code == 0, err
    assert f"test loss {last['test_loss']:.4f}, test mae {last['test_mae']:.4f} (70 examples)" \
        in out


def test_a_loss_only_model_reports_its_loss_and_nothing_invented(module, one_replica,
                                                                 tmp_path, tool):
    """A model compiled with a loss and no metric: metrics.json, the book's line, TensorBoard
    and evaluate say its loss, and no accuracy or other figure."""
    cfg = dataclasses.replace(config(module, "regression", epochs=1),
                              model=f"{module}:loss_only")
    dataset = sources.load_for(cfg)
    model_dir = tmp_path / "run"
    model_dir.mkdir()
    line, history = train.train_and_evaluate(one_replica, dataset, cfg, verbose=0,
                                             model_dir=str(model_dir))
    last = history[-1]
    figures = {k for k in last if (k.startswith(("train_", "test_", "val_")) or k in (
        "loss", "acc", "accuracy")) and not k.endswith("_examples")}  # counts, not figures
    assert figures == {"loss", "test_loss"}, sorted(last)
    assert line.startswith(f"test loss: {last['test_loss']:.4g}, "), line
    metrics = json.loads((model_dir / "metrics.json").read_text())
    assert metrics["metrics"] == [] and metrics["summary"] == line
    assert [sorted(r) for r in metrics["epochs"]] == [sorted(last)]
    tags = set()
    for event in tf.compat.v1.train.summary_iterator(
            str(next((model_dir / "tensorboard" / "test").glob("events.*")))):
        tags |= {v.tag for v in event.summary.value}
    assert tags == {"epoch_loss"}, tags
    code, out, err = tool("evaluate", f"--model_dir={model_dir}")
    assert code == 0, err
    said = [s for s in out.splitlines() if "test loss" in s]
    assert said == [f"{module}:houses: test loss {last['test_loss']:.4f} (70 examples)"], out
    assert "acc" not in out and "mae" not in out


def test_a_text_classifier_and_a_two_output_model_serve_their_reported_metrics(served_runs):
    """The SavedModels of a text classifier (token ids: `features` to logits, `outputs`) and
    of the two-output model (`kind` logits and `size`), served in one process that never
    imports tfmulti, give the test figures their runs reported: accuracy, kind_accuracy and
    size_mae (one epoch each, in this process)."""
    runs = {kind: served_runs[kind][3][-1] for kind in ("text", "two_outputs")}
    tests = {kind: (served_runs[kind][1].test_features, served_runs[kind][1].test_targets)
             for kind in ("text", "two_outputs")}
    text, two = served_runs["text"][4], served_runs["two_outputs"][4]
    assert text["inputs"] == ["features"] and list(text["outputs"]) == ["outputs"]
    assert np.mean(text["outputs"]["outputs"].argmax(-1) == tests["text"][1]) == (
        pytest.approx(runs["text"]["test_acc"], abs=1e-6))
    assert two["inputs"] == ["features"] and sorted(two["outputs"]) == ["kind", "size"]
    targets = tests["two_outputs"][1]
    assert np.mean(two["outputs"]["kind"].argmax(-1) == targets["kind"]) == (
        pytest.approx(runs["two_outputs"]["test_kind_accuracy"], abs=1e-6))
    assert np.mean(np.abs(two["outputs"]["size"][:, 0] - targets["size"])) == (
        pytest.approx(runs["two_outputs"]["test_size_mae"], rel=1e-4))


@pytest.mark.parametrize("model, data, words", [
    ("uncompiled_regression", "houses", "is not compiled, so tfmulti would train it as a "
     "classifier .* but the data's targets are float32 \\[n\\] for outputs \\(1,\\): compile it "
     "with the loss that fits them"),
    ("wrong_width", "houses", "its loss mean_squared_error does not fit the targets: targets "
     "of shape \\(\\) per example, outputs of shape \\(3,\\)"),
    ("unknown_metric", "houses", "its metrics cannot be made: .*no_such_metric"),
    ("auc_on_class_ids", "reviews", "its metric auc cannot take the targets \\(int32 \\[n\\]\\) "
     "and outputs \\(float32 \\[n, 3\\]\\): ValueError: "),
    ("other_inputs", "houses", "takes the inputs area, rooms; the data's features are named "
     "area, ratings \\(no rooms\\) \\(ratings not an input\\)"),
    ("crop_then_flatten", "one_hot_images", "cannot take the data's features \\(.*\\): "
     "ValueError: Input 0 .*of layer 'dense.*' is incompatible with the layer: expected axis "
     "-1 of input shape to have value 36, but received input with shape \\(.*, 64\\)$"),
    ("two_outputs", "size_only", "has the outputs kind, size; the data's targets are named "
     "size: output kind has no target"),
    ("two_outputs", "with_color", "target color has no output"),
])
def test_what_cannot_train_is_one_line_before_the_first_step(module, one_replica, two_replicas,
                                                             tmp_path, model, data, words):
    """Refused as the main job refuses it once its devices are up (tools/main.py): the run's
    folder made and locked, the run refused in one line, and no folder left behind
    (wrong_width on 2 replicas: the real command's case, make soak)."""
    cfg = RunConfig(model=f"{module}:{model}", dataset=f"{module}:{data}",
                    global_batch_size=32)
    dataset = sources.load_for(cfg)
    strategy = two_replicas if model == "wrong_width" else one_replica
    with pytest.raises(UsageError, match=words) as error, \
            lifecycle.in_use(str(tmp_path / "run")) as model_dir, \
            lifecycle.removed_if_refused(model_dir, existed=False):
        train.train_and_evaluate(strategy, dataset, cfg, verbose=0, model_dir=model_dir)
    assert "\n" not in str(error.value)
    assert str(error.value).startswith(f"--model={module}:{model}")  # the line the tool says
    assert not (tmp_path / "run").exists()


def refused(project, tool, *flags):
    """`python -m tfmulti.<tool> FLAGS` in the user's project, which must fail: its stderr's
    lines."""
    result = subprocess.run([sys.executable, "-m", f"tfmulti.{tool}", *flags], cwd=project,
                            env={**environment(), "PYTHONPATH": str(project)},
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, (result.returncode, result.stderr[-3000:])
    return result.stderr.strip().splitlines()


def test_a_built_in_model_refuses_data_that_are_not_images_with_classes(project, tool,
                                                                        monkeypatch, one_replica):
    """The command (in this process, as cli.main runs it): one line, exit 1, no run folder
    left behind."""
    monkeypatch.chdir(project)
    monkeypatch.syspath_prepend(str(project))
    code, _, err = tool("main", "--model=lenet", "--dataset=yours:houses", "--model_dir=refused",
                        strategy=one_replica)
    assert code == 1 and err.strip().splitlines() == [
        "tfmulti: error: --model=lenet classifies images; the data set's features are not images: "
        "give a model of your own (--model=MODULE:FUNCTION)"]
    assert not (project / "refused").exists()


@pytest.mark.soak  # make test keeps test_what_cannot_train_is_one_line_before_the_first_step's
# wrong_width case (the same line, on 2 replicas, in the folder made and removed again) and
# the real command's refusal above
def test_a_loss_that_does_not_fit_the_targets_is_refused_by_the_real_command(project):
    """The main job as a user starts it, on 2 replicas: exit 1, one line on stderr, no run
    folder (made and locked before the model is built, removed again)."""
    said = refused(project, "main", "--model=yours:wrong_width", "--dataset=yours:houses",
                   "--cpu_replicas=2", "--global_batch_size=32", "--model_dir=wrong_width")
    assert len(said) == 1 and re.fullmatch(
        "tfmulti: error: --model=yours:wrong_width: its loss mean_squared_error does not fit "
        "the targets: targets of shape \\(\\) per example, outputs of shape \\(3,\\).*",
        said[0]), said
    assert not (project / "wrong_width").exists()


def test_an_objective_the_model_does_not_report_is_refused_by_the_tune_command(in_project,
                                                                              tool, monkeypatch):
    """The tune command (in this process: test_tune.py keeps its real processes) on a
    regression asked for val_accuracy: exit 1, one line naming what the model reports, no
    session folder."""
    code, _, err = tool("tune", "--model=yours:regression", "--dataset=yours:houses",
                        "--cpu_replicas=2", "--max_trials=2", "--epochs=1",
                        "--objective=val_accuracy", "--model_dir=no_session")
    said = err.strip().splitlines()
    assert code == 1, err
    assert said == ["tfmulti: error: --objective=val_accuracy: --model=yours:regression reports "
                    "val_loss, val_mae on the validation part (it is not a classifier: no "
                    "accuracy)"], said
    assert not (in_project / "no_session").exists()


# ------------------------------------------------------------------ kill -9 and run again

STEPS_PER_EPOCH = 8  # 256 examples at a global batch of 32


def command(kind, model_dir, replicas=2):
    model, data, _ = KINDS[kind]
    return [sys.executable, "-m", "tfmulti.main", f"--model=yours:{model}",
            f"--dataset=yours:{data}", f"--cpu_replicas={replicas}", "--global_batch_size=32",
            "--base_lr=0.4", "--deterministic", "--seed=3", "--checkpoint_steps=3",
            "--epochs=2", "--steps_per_call=1", f"--model_dir={model_dir}"]


def run_to_end(kind, project, model_dir, replicas=2):
    result = subprocess.run(command(kind, model_dir, replicas), cwd=project,
                            env={**environment(), "PYTHONPATH": str(project)},
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def killed_mid_epoch(kind, project, model_dir):
    """Starts the run and kill -9s it once a checkpoint inside epoch 2 is listed."""
    process = subprocess.Popen(command(kind, model_dir), cwd=project,
                               env={**environment(), "PYTHONPATH": str(project)},
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while time.time() < deadline and process.poll() is None:
        saved = checkpoint_steps(model_dir)
        if saved and saved[-1] > STEPS_PER_EPOCH and saved[-1] % STEPS_PER_EPOCH:
            process.send_signal(signal.SIGKILL)
            break
        time.sleep(0.01)
    assert process.wait(60) == -signal.SIGKILL, "the run ended before it could be killed"
    return checkpoint_steps(model_dir)[-1]


def final_weights(model_dir):
    return keras.saving.load_model(str(model_dir / "model.keras")).get_weights()


@pytest.mark.soak  # make soak: three runs, 13 s (make test: exact resume of the built-in models)
def test_a_run_stopped_at_an_epochs_end_and_run_again_ends_as_the_uninterrupted_one(
        module, two_replicas, tmp_path):
    """The two-output model (two losses, a dict of targets), in this process: a run of one
    epoch continued to two ends at the weights and records of a run of two. (make soak kills
    each kind with kill -9 mid-epoch, below.)"""
    cfg = config(module, "two_outputs")
    dataset = sources.load_for(cfg)
    runs = {}
    for name, epochs in (("uninterrupted", [2]), ("stopped", [1, 2])):
        (tmp_path / name).mkdir()
        keras.utils.set_random_seed(cfg.seed)  # as the main job seeds its process: one start
        for count in epochs:  # the stopped run's first part writes no model (never read)
            _, history = train.train_and_evaluate(
                two_replicas, dataset, dataclasses.replace(cfg, epochs=count), verbose=0,
                model_dir=str(tmp_path / name), write_model=count == epochs[-1])
        runs[name] = history
    for a, b in zip(final_weights(tmp_path / "uninterrupted"), final_weights(tmp_path / "stopped")):
        np.testing.assert_array_equal(a, b)
    assert [r["test_kind_accuracy"] for r in runs["stopped"]] == [
        r["test_kind_accuracy"] for r in runs["uninterrupted"]]
    assert runs["stopped"][-1]["test_size_mae"] == runs["uninterrupted"][-1]["test_size_mae"]


# make soak kills each kind with kill -9 mid-epoch and runs it again, on the same replicas and
# on 1 replica (the suite's kill -9 of a user's model is in test_resume_yours.py).
@pytest.mark.parametrize("kind, on_one_replica", [
    pytest.param("two_outputs", False, marks=pytest.mark.soak),
    pytest.param("two_outputs", True, marks=pytest.mark.soak),
    pytest.param("regression", True, marks=pytest.mark.soak),
    pytest.param("text", True, marks=pytest.mark.soak)])
def test_killed_mid_epoch_and_run_again_ends_at_the_uninterrupted_weights(
        kind, on_one_replica, project):
    """Bit for bit on the same 2 replicas; within float tolerance when the killed run is
    resumed on 1 replica instead (in this process)."""
    uninterrupted = project / f"{kind}_uninterrupted"
    if not uninterrupted.exists():  # the soak's second case of a kind reuses it
        run_to_end(kind, project, uninterrupted)
    killed = project / f"{kind}_killed_{on_one_replica}"
    step = killed_mid_epoch(kind, project, killed)
    other = project / f"{kind}_on_one_replica"
    subprocess.run(["cp", "-r", str(killed), str(other)], check=True)
    out = run_to_end(kind, project, killed)
    assert f"at step {step + 1}" in out
    for a, b in zip(final_weights(uninterrupted), final_weights(killed)):
        np.testing.assert_array_equal(a, b, err_msg=f"killed after step {step}")
    if not on_one_replica:
        return
    sys.path.insert(0, str(project))
    try:
        model, data, _ = KINDS[kind]
        cfg = RunConfig(model=f"yours:{model}", dataset=f"yours:{data}", global_batch_size=32,
                        base_lr=0.4, seed=3, checkpoint_steps=3, epochs=2, steps_per_call=1)
        dataset = sources.load_for(cfg)
        one = tf.distribute.OneDeviceStrategy("/cpu:0")
        train.train_and_evaluate(one, dataset, dataclasses.replace(cfg), verbose=0,
                                 model_dir=str(other))
    finally:
        sys.path.remove(str(project))
        sys.modules.pop("yours", None)
    for a, b in zip(final_weights(uninterrupted), final_weights(other)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind, given, name, direction", [
    ("regression", "", "val_loss", "min"), ("regression", "val_mae", "val_mae", "min"),
    ("text", "", "val_accuracy", "max"), ("text", "val_acc", "val_accuracy", "max"),
    ("two_outputs", "val_kind_accuracy", "val_kind_accuracy", "max"),
    ("two_outputs", "val_size_mae", "val_size_mae", "min"),
    ("multi_label", "val_auc", "val_auc", "max"), ("multi_label", "val_loss:max", "val_loss",
                                                   "max")])
def test_a_session_objective_is_a_validation_figure_of_the_model(module, kind, given, name,
                                                                   direction):
    """--objective names a figure the model reports on the validation part, its direction
    told by its last words (kind_accuracy: accuracy) or given; the default is val_accuracy
    for a classifier and val_loss for the rest."""
    from tfmulti.tune import objective as objectives

    cfg = config(module, kind)
    objective = objectives.session_objective(cfg, sources.load_for(cfg), given)
    assert (objective.name, objective.direction) == (name, direction)


@pytest.mark.soak  # 33 s of make test; test_tune.py keeps parallel trials there
def test_a_regression_tuned_two_trials_at_a_time_chooses_on_its_validation_mae(project):
    """--parallel_trials=2 on a model compiled with its own loss and metric (keras-tuner's
    chief and two workers, a device each): both trials complete, scored on val_mae, and
    best.cfg names the trial with the lowest."""
    session = project / "tune-parallel"
    result = subprocess.run(
        [sys.executable, "-m", "tfmulti.tune", "--model=yours:regression",
         "--dataset=yours:houses", "--cpu_replicas=2", "--parallel_trials=2", "--epochs=1",
         "--max_trials=2", "--tune_batch_sizes=16,32", "--objective=val_mae",
         f"--model_dir={session}"], cwd=project,
        env={**environment(), "PYTHONPATH": str(project)}, capture_output=True, text=True,
        timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    with open(session / "trials.csv") as f:
        table = list(csv.DictReader(f))
    assert [r["status"] for r in table] == ["COMPLETED", "COMPLETED"], table
    best = min(table, key=lambda r: float(r["val_mae"]))
    assert f"best: val_mae {float(best['val_mae']):.4f}" in result.stdout
    assert "--objective" not in (session / "best.cfg").read_text()  # a session's flag
    assert {p.name for p in (session / "workers").glob("tuner*.log")} == {"tuner0.log",
                                                                          "tuner1.log"}


@pytest.mark.parametrize("kind, given, words", [
    ("regression", "val_accuracy", "reports val_loss, val_mae on the validation part (it is "
                                   "not a classifier: no accuracy)"),
    ("regression", "test_mae", "never on the test set"),
    ("regression", "mae", "never on the test set or the training figures"),
    ("text", "val_accuracy:up", "the direction after ':' is min or max"),
])
def test_an_objective_the_model_does_not_report_is_refused_before_the_first_trial(
        module, kind, given, words):
    from tfmulti.tune import objective as objectives

    cfg = config(module, kind)
    with pytest.raises(UsageError, match=re.escape(words)):
        objectives.session_objective(cfg, sources.load_for(cfg), given)


def test_the_doctor_checks_a_regression_on_named_inputs(module, two_replicas):
    """The doctor's check of your code (the same in its own process): the data's structure,
    the model's outputs and metrics, a step on 2 replicas, the SavedModel's round trip."""
    from tfmulti.doctor import yourcode

    found = list(yourcode.findings_of(config(module, "regression"), two_replicas))
    assert [f for f in found if f[0] != "info"] == [], found
    said = {label: text for _, label, text in found}
    assert said["data"] == (f"{module}:houses: 256 + 70 examples, features {{area: float32 [n], "
                            "ratings: float32 [n, 3]}, targets float32 [n]")
    assert said["model"].endswith("; reports loss, mae"), said["model"]
    assert said["export"].startswith("SavedModel with a serving signature, the model's inputs "
                                     "to its outputs by name, on 8 test examples")


BINARY = textwrap.dedent('''
    import numpy as np
    import keras
    from keras import layers


    def heart():
        """Two named numbers and a 0/1 label, as Keras's structured-data example has them."""
        rng = np.random.default_rng(0)

        def draw(n):
            age = rng.uniform(30, 80, (n, 1)).astype("float32")
            chol = rng.uniform(150, 350, (n, 1)).astype("float32")
            y = ((age[:, 0] - 55) / 25 + (chol[:, 0] - 250) / 100
                 + rng.normal(0, 0.3, n) > 0).astype("int32")
            return {"age": age, "chol": chol}, y
        return draw(1024), draw(256)


    def sigmoid_head(input_shape, num_classes):
        age = keras.Input(shape=(1,), name="age")
        chol = keras.Input(shape=(1,), name="chol")
        x = layers.concatenate([layers.Normalization(mean=55, variance=200)(age),
                                layers.Normalization(mean=250, variance=3000)(chol)])
        x = layers.Dropout(0.5)(layers.Dense(32, activation="relu")(x))
        output = layers.Dense(1, activation="sigmoid")(x)
        model = keras.Model({"age": age, "chol": chol}, output)
        model.compile("adam", "binary_crossentropy", metrics=["accuracy"])
        return model
''')


def sigmoid_head_run(two_replicas, importable, tmp_path, epochs):
    """(the history, the module, the run folder) of the sigmoid head trained on 2 replicas."""
    name = importable("binary", BINARY)
    dataset = sources.load(f"{name}:heart")
    cfg = RunConfig(model=f"{name}:sigmoid_head", dataset=f"{name}:heart", epochs=epochs,
                    global_batch_size=32, base_lr=0.001, lr_scaling="none", seed=1)
    lifecycle.prepare_model_dir(str(tmp_path / "run"))
    keras.utils.set_random_seed(1)
    _, history = train.train_and_evaluate(two_replicas, dataset, cfg,
                                          model_dir=str(tmp_path / "run"), verbose=0)
    return history, sys.modules[name], tmp_path / "run"


def test_a_sigmoid_binary_head_trains_and_reports_keras_binary_figures(
        two_replicas, importable, tmp_path):
    """One sigmoid score with binary_crossentropy and 0/1 labels (once refused: "one score
    per class, (None, 2)") trains, and the reported figures are Keras's binary accuracy and
    cross-entropy of the saved model."""
    history, module, run = sigmoid_head_run(two_replicas, importable, tmp_path, epochs=1)
    _, (test_x, test_y) = module.heart()
    saved = keras.saving.load_model(run / "model.keras")
    scores = saved(test_x, training=False).numpy()[:, 0]
    assert history[-1]["test_acc"] == pytest.approx(np.mean((scores > 0.5) == test_y), abs=1e-6)
    loss = float(keras.losses.binary_crossentropy(test_y[:, None].astype("float32"),
                                                  scores[:, None]).numpy().mean())
    assert history[-1]["test_loss"] == pytest.approx(loss, rel=1e-5)


@pytest.mark.soak  # make soak: 4 epochs beside fit's (make test keeps the figures' check)
def test_a_sigmoid_binary_head_ends_within_noise_of_fit(two_replicas, importable, tmp_path):
    """4 epochs on 2 replicas end within 0.04 of fit on one device in test accuracy and
    loss (measured, seeds 0-2: within 0.008 of each other)."""
    history, module, _ = sigmoid_head_run(two_replicas, importable, tmp_path, epochs=4)
    (x, y), (test_x, test_y) = module.heart()
    keras.utils.set_random_seed(1)
    fitted = module.sigmoid_head(None, 2)
    fitted.fit(x, y, batch_size=32, epochs=4, verbose=0)
    by_fit = fitted.evaluate(test_x, test_y, verbose=0, return_dict=True)
    assert history[-1]["test_acc"] == pytest.approx(by_fit["accuracy"], abs=0.04)
    assert history[-1]["test_loss"] == pytest.approx(by_fit["loss"], abs=0.04)
