"""A model's own train_step, test_step and compute_loss run as model.fit runs them: Keras's
guide ("Customizing what happens in fit()") and the trainer pattern example, their model code
copied as written, side by side with fit on the same model and data."""
import json
import pathlib
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmulti.errors import UsageError
from tfmulti.run.config import RunConfig
from tfmulti.rundir import lifecycle, names
from tfmulti.training import engine, train

# Keras's guide, customizing_what_happens_in_fit (TensorFlow), its classes as written
GUIDE = textwrap.dedent('''
    import numpy as np
    import tensorflow as tf
    import keras


    class CustomModel(keras.Model):
        def train_step(self, data):
            # Unpack the data. Its structure depends on your model and
            # on what you pass to `fit()`.
            x, y = data

            with tf.GradientTape() as tape:
                y_pred = self(x, training=True)  # Forward pass
                # Compute the loss value
                # (the loss function is configured in `compile()`)
                loss = self.compute_loss(y=y, y_pred=y_pred)

            # Compute gradients
            trainable_vars = self.trainable_variables
            gradients = tape.gradient(loss, trainable_vars)

            # Update weights
            self.optimizer.apply(gradients, trainable_vars)

            # Update metrics (includes the metric that tracks the loss)
            for metric in self.metrics:
                if metric.name == "loss":
                    metric.update_state(loss)
                else:
                    metric.update_state(y, y_pred)

            # Return a dict mapping metric names to current value
            return {m.name: m.result() for m in self.metrics}


    class EvaluatedModel(keras.Model):
        def test_step(self, data):
            # Unpack the data
            x, y = data
            # Compute predictions
            y_pred = self(x, training=False)
            # Updates the metrics tracking the loss
            loss = self.compute_loss(y=y, y_pred=y_pred)
            # Update the metrics.
            for metric in self.metrics:
                if metric.name == "loss":
                    metric.update_state(loss)
                else:
                    metric.update_state(y, y_pred)
            # Return a dict mapping metric names to current value.
            # Note that it will include the loss (tracked in self.metrics).
            return {m.name: m.result() for m in self.metrics}


    def regression():
        rng = np.random.default_rng(0)
        x = rng.random((1000, 32)).astype("float32")
        y = (x @ rng.random((32, 1)) / 8).astype("float32")
        return (x[:800], y[:800]), (x[800:], y[800:]), None


    def custom(input_shape, num_classes):
        # Construct and compile an instance of CustomModel
        inputs = keras.Input(shape=(32,))
        outputs = keras.layers.Dense(1)(inputs)
        model = CustomModel(inputs, outputs)
        model.compile(optimizer="adam", loss="mse", metrics=["mae"])
        return model


    def evaluated(input_shape, num_classes):
        inputs = keras.Input(shape=(32,))
        outputs = keras.layers.Dense(1)(inputs)
        model = EvaluatedModel(inputs, outputs)
        model.compile(optimizer="adam", loss="mse", metrics=["mae"])
        return model


    class Idle(keras.Model):
        """A step that applies no gradients (fit leaves the weights as they are)."""
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.steps = keras.metrics.Sum(name="steps")

        def train_step(self, data):
            x, y = data
            self.steps.update_state(1.0)
            return {"steps": self.steps.result()}

        @property
        def metrics(self):
            return [self.steps]


    def idle(input_shape, num_classes):
        inputs = keras.Input(shape=input_shape)
        x = keras.layers.Flatten()(inputs)
        model = Idle(inputs, keras.layers.Dense(num_classes)(x))
        model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True), metrics=["accuracy"])
        return model


    def uncompiled(input_shape, num_classes):
        inputs = keras.Input(shape=(32,))
        return CustomModel(inputs, keras.layers.Dense(1)(inputs))
''')

# keras-io examples/keras_recipes/trainer_pattern.py, as written (tests/keras_examples)
EXAMPLES = pathlib.Path(__file__).parent / "keras_examples"
TRAINER = (EXAMPLES / "trainer.py").read_text()


def imported(name):
    """The module `name` as tfmulti imports a user's (from the working directory)."""
    import sys

    return sys.modules.get(name) or _load(name)


def _load(name):
    import importlib
    import os
    import sys

    sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


@pytest.fixture
def guide(importable):
    name = importable("guide", GUIDE)
    return name, imported(name)


def adam(step):
    return keras.optimizers.Adam()  # the guide's "adam": its rate, 0.001


def test_the_guides_train_step_on_two_replicas_takes_fits_steps(one_replica, two_replicas, guide):
    """The same batches in the same order: the weights of fit on one device, the logs of fit
    on the same two replicas (the guide's loss log is compute_loss's, which Keras scales by
    the replica count: fit shows the same)."""
    _, module = guide
    (x, y), _, _ = module.regression()

    def built(strategy):
        with strategy.scope():
            keras.utils.set_random_seed(3)
            return module.custom(None, None)

    keras.utils.set_random_seed(3)
    eng = engine.Engine(two_replicas, lambda: module.custom(None, None), adam, 64)
    assert eng.own_training and not eng.own_evaluation
    start = eng.model.get_weights()
    batches = tf.data.Dataset.from_tensor_slices((x, y)).batch(64, drop_remainder=True)
    eng.reset_train_metrics()
    list(eng.train_steps(iter(two_replicas.experimental_distribute_dataset(batches)), 12))
    on_one, on_two = built(one_replica), built(two_replicas)  # 800 / 64: 12 full batches
    for a, b in zip(start, on_one.get_weights()):
        np.testing.assert_array_equal(a, b)
    on_one.fit(x[:768], y[:768], batch_size=64, epochs=1, shuffle=False, verbose=0)
    logs = on_two.fit(x[:768], y[:768], batch_size=64, epochs=1, shuffle=False,
                      verbose=0).history
    for before, a, b in zip(start, eng.model.get_weights(), on_one.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-6)
        assert not np.allclose(before, a)
    trained = eng.train_results()
    assert sorted(trained) == ["loss", "mae"]
    assert trained["mae"] == pytest.approx(logs["mae"][0], rel=1e-5)
    assert trained["loss"] == pytest.approx(logs["loss"][0], rel=1e-5)


@pytest.mark.soak  # make soak (make test: the guide's steps beside fit's, above)
def test_the_guides_step_resumed_mid_epoch_reports_the_whole_epoch(two_replicas, guide, tmp_path):
    """Saved after 5 steps and resumed in another engine, the epoch's logs are still those of
    all 12 steps (its metrics' state is in the checkpoint: the logs once covered the steps
    after the resume)."""
    _, module = guide
    (x, y), _, _ = module.regression()
    keras.utils.set_random_seed(3)
    eng = engine.Engine(two_replicas, lambda: module.custom(None, None), adam, 64)
    batches = tf.data.Dataset.from_tensor_slices((x, y)).batch(64, drop_remainder=True)
    iterator = iter(two_replicas.experimental_distribute_dataset(batches))
    eng.reset_train_metrics()
    list(eng.train_steps(iterator, 5))
    saved = eng.checkpoint_manager(str(tmp_path)).save()
    list(eng.train_steps(iterator, 7))
    resumed = engine.Engine(two_replicas, lambda: module.custom(None, None), adam, 64)
    resumed.restore(saved)
    list(resumed.train_steps(iter(two_replicas.experimental_distribute_dataset(
        batches.skip(5))), 7))
    assert resumed.train_results() == pytest.approx(eng.train_results(), rel=1e-6)
    for a, b in zip(eng.model.get_weights(), resumed.model.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_a_train_step_that_applies_no_gradients_leaves_the_weights_as_they_were(
        two_replicas, tiny_synthetic, guide, tmp_path):
    """fit leaves such a model as it was; tfmulti once trained it with its own step to 0.88.
    The test figures are the same bit for bit every epoch, and the report has the step's
    own log (its count of steps, 1024 / 64 a epoch on each replica, summed over the 2
    replicas as fit's epoch logs read a Sum's variables: 32)."""
    name, _ = guide
    cfg = RunConfig(model=f"{name}:idle", per_replica_batch_size=32, epochs=2,
                    dataset="synthetic", synthetic_train_size=1024, synthetic_test_size=250)
    _, history = train.train_and_evaluate(two_replicas, tiny_synthetic, cfg, verbose=0)
    assert history[0]["test_loss"] == history[1]["test_loss"]
    assert history[0]["test_acc"] == history[1]["test_acc"]
    assert [r["train_steps"] for r in history] == [32.0, 32.0]  # reset at each epoch's start


def test_a_test_step_of_its_own_evaluates_every_example_once(two_replicas, guide, tmp_path,
                                                             capsys):
    """The guide's test_step on 200 test examples, batches of 64 on two replicas (the last
    one padded): its mae is the one of Keras's evaluate on one device, over the 200."""
    name, module = guide
    from tfmulti.data import sources

    dataset = sources.load(f"{name}:regression")
    cfg = RunConfig(model=f"{name}:evaluated", per_replica_batch_size=32, epochs=1,
                    dataset=f"{name}:regression", base_lr=0.001, lr_scaling="none")
    run_dir = str(tmp_path / "run")
    lifecycle.prepare_model_dir(run_dir)
    _, history = train.train_and_evaluate(two_replicas, dataset, cfg, model_dir=run_dir,
                                          verbose=1)
    said = capsys.readouterr().out
    assert f"--model={name}:evaluated has its own test_step: it evaluates with Keras's" in said
    assert history[-1]["test_examples"] == 200
    saved = keras.saving.load_model(tmp_path / "run" / names.MODEL_FILE, compile=False,
                                    custom_objects={"EvaluatedModel": module.EvaluatedModel})
    _, (x, y), _ = module.regression()
    mae = float(np.mean(np.abs(saved(x, training=False).numpy() - y)))
    assert history[-1]["test_mae"] == pytest.approx(mae, rel=1e-5)
    run = json.loads((tmp_path / "run" / names.METRICS_FILE).read_text())
    assert run["metrics"] == ["mae"] and run["primary_metric"] == "mae"
    # tfmulti.evaluate runs the same test_step, as model.evaluate does (it once used the
    # compiled loss and metrics instead)
    from tfmulti.evaluate import evaluation

    calls = []
    module.EvaluatedModel.test_step = (lambda step: lambda self, data: calls.append(1) or step(
        self, data))(module.EvaluatedModel.test_step)
    found = evaluation.evaluate_run(run_dir, {})
    assert calls, "its test_step never ran"
    saved.compile(loss="mse", metrics=["mae"])
    expected = saved.evaluate(x, y, batch_size=evaluation.BATCH, verbose=0, return_dict=True)
    assert found.result["mae"] == pytest.approx(expected["mae"], rel=1e-6)
    assert found.result["loss"] == pytest.approx(expected["loss"], rel=1e-6)
    assert found.result["examples"] == 200 and found.metrics == ("mae",)


@pytest.mark.soak  # make soak (make test keeps the guide's step within 1e-6 of fit's)
def test_the_trainer_pattern_ends_within_noise_of_fit(two_replicas, tiny_synthetic, importable):
    """keras-io's trainer pattern (a softmax model wrapped in a trainer compiled with Adam),
    3 epochs on 2 replicas against fit on one device with the same data and rate: the test
    accuracy within 0.08 (measured over seeds 0-3: fit 0.79-0.85, tfmulti 0.80-0.83, the
    largest gap at one seed 0.04)."""
    name = importable("trainer", TRAINER)
    module = imported(name)
    cfg = RunConfig(model=f"{name}:trainer_2", per_replica_batch_size=32, epochs=3,
                    base_lr=0.001, lr_scaling="none", dataset="synthetic",
                    synthetic_train_size=1024, synthetic_test_size=250)
    _, history = train.train_and_evaluate(two_replicas, tiny_synthetic, cfg, verbose=0)
    keras.utils.set_random_seed(0)
    model = module.trainer_2(None, 10)
    images = tiny_synthetic.train_features[..., None].astype("float32") / 255
    model.fit(images, tiny_synthetic.train_targets, batch_size=64, epochs=3, verbose=0)
    tests = tiny_synthetic.test_features[..., None].astype("float32") / 255
    accuracy = float(np.mean(np.argmax(model.predict(tests, verbose=0), -1)
                             == tiny_synthetic.test_targets))
    assert history[-1]["test_acc"] == pytest.approx(accuracy, abs=0.08), (history, accuracy)
    assert history[-1]["test_acc"] > 0.5  # chance is 0.1


@pytest.mark.parametrize("function, settings, words", [
    ("uncompiled", {}, "compile it (model.compile(optimizer=...)) before returning it"),
    ("custom", {"grad_accum_steps": 2}, "--grad_accum_steps=2: your model's own train_step"),
    ("custom", {"allreduce_dtype": "bfloat16"}, "--allreduce_dtype=bfloat16: your model's own"),
])
def test_what_its_own_step_cannot_run_with_is_one_line(one_replica, guide, function, settings,
                                                       words):
    name, _ = guide
    with pytest.raises(UsageError, match=rf"{words.replace('(', '.').replace(')', '.')}"):
        engine.Engine(one_replica, lambda: getattr(imported(name), function)(None, None),
                      adam, 64, **settings, spec=f"{name}:{function}")


def test_the_doctor_says_which_step_runs(two_replicas, guide):
    from tfmulti.doctor import yourcode

    name, _ = guide
    said = {}
    for function in ("custom",):
        cfg = RunConfig(model=f"{name}:{function}", dataset=f"{name}:regression",
                        base_lr=0.001, lr_scaling="none")
        said[function] = [text for _, topic, text in yourcode.findings_of(cfg, two_replicas)
                          if topic == "steps"]
    assert said["custom"] == [f"--model={name}:custom has its own train_step: it trains with "
                              "Keras's steps, as model.fit runs them (on every replica; its "
                              "optimizer sums the gradients; the logs its steps return are "
                              "the report's)"], said


@pytest.mark.soak  # make soak, beside its kill -9 form (make test resumes every random
def test_its_own_step_resumes_bit_for_bit(two_replicas, importable, tmp_path):  # layer in-process
    """The trainer pattern (its Dropout's seeds in the checkpoint): 1 epoch, then on to 2 in
    the same folder, ends with the weights of 2 epochs in one go (make soak: after kill -9)."""
    from tfmulti.data import sources

    name = importable("trainer", TRAINER)
    cfg = RunConfig(model=f"{name}:trainer_2", per_replica_batch_size=64, epochs=2,
                    base_lr=0.001, lr_scaling="none", dataset="synthetic",
                    synthetic_train_size=384, synthetic_test_size=64, seed=4)
    small = sources.load("synthetic", synthetic_train_size=384, synthetic_test_size=64, seed=0)

    def fingerprint(run_dir, epochs):
        import dataclasses

        if not (tmp_path / run_dir).exists():
            lifecycle.prepare_model_dir(str(tmp_path / run_dir))
        keras.utils.set_random_seed(cfg.seed)  # as --seed does at the start-up
        train.train_and_evaluate(two_replicas, small, dataclasses.replace(cfg, epochs=epochs),
                                 model_dir=str(tmp_path / run_dir), verbose=0,
                                 write_model=False)
        return json.loads((tmp_path / run_dir / names.METRICS_FILE).read_text())

    whole = fingerprint("whole", 2)
    fingerprint("resumed", 1)
    resumed = fingerprint("resumed", 2)
    assert resumed["weights_fingerprints"] == whole["weights_fingerprints"]
    assert resumed["epochs"][-1]["test_acc"] == whole["epochs"][-1]["test_acc"]


def test_a_finished_run_keras_cannot_save_is_evaluated_from_its_checkpoint(
        two_replicas, importable, tool, tmp_path):
    """The trainer pattern has no get_config: the run ends without model.keras, its report
    line lists what it wrote, and tfmulti.evaluate builds the model again and restores its
    last checkpoint (it once answered "has not finished, run its command again", which said
    "complete"): the run's own test figures."""
    from tfmulti.evaluate import evaluation

    name = importable("trainer", TRAINER)
    run_dir = tmp_path / "run"
    code, out, err = tool("main", f"--model={name}:trainer_2", "--dataset=synthetic",
                          "--synthetic_train_size=512", "--synthetic_test_size=100",
                          "--global_batch_size=64", "--epochs=1", f"--model_dir={run_dir}",
                          strategy=two_replicas)
    assert code == 0, err
    assert f"report: {run_dir}/ (metrics.json, accuracy.png, tensorboard/, saved_model/)" in out
    assert not (run_dir / names.MODEL_FILE).exists()
    found = evaluation.evaluate_run(str(run_dir), {})
    last = json.loads((run_dir / names.METRICS_FILE).read_text())["epochs"][-1]
    assert "checkpoints" in found.result["evaluated"]
    assert found.result["accuracy"] == pytest.approx(last["test_acc"], abs=1e-6)
    assert found.result["loss"] == pytest.approx(last["test_loss"], rel=1e-5)


def _own_step_command(model_dir):
    import sys

    return [sys.executable, "-m", "tfmulti.main", "--model=trainer:trainer_2",
            "--dataset=synthetic", "--synthetic_train_size=1536", "--synthetic_test_size=256",
            "--cpu_replicas=2", "--global_batch_size=64", "--deterministic", "--seed=3",
            "--checkpoint_steps=8", "--epochs=2", "--steps_per_call=1",
            f"--model_dir={model_dir}"]


@pytest.mark.soak  # make soak: real processes, kill -9 at two moments (about 60 s)
@pytest.mark.parametrize("moment", ["mid_epoch", "epoch_end"])
def test_its_own_step_resumes_bit_for_bit_after_kill_9(tmp_path, moment):
    """The trainer pattern (its own train_step, Dropout) killed with kill -9 once a checkpoint
    mid-epoch or at the epoch's end is listed, run again: the weights of the uninterrupted
    run (metrics.json's fingerprint: Keras cannot save this model as model.keras)."""
    import subprocess

    from test_resume import environment, killed_when_saved

    (tmp_path / "trainer.py").write_text(TRAINER)
    env = {**environment(), "PYTHONPATH": str(tmp_path)}

    def finished(model_dir):
        done = subprocess.run(_own_step_command(model_dir), cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout, json.loads((model_dir / names.METRICS_FILE).read_text())

    _, whole = finished(tmp_path / "whole")
    wanted = ((lambda step: step == 24) if moment == "epoch_end" else
              (lambda step: step % 24 != 0 and step > 24))
    step = killed_when_saved(_own_step_command(tmp_path / moment), env, tmp_path / moment,
                             wanted, cwd=tmp_path)
    said, resumed = finished(tmp_path / moment)
    assert f"at step {step + 1}" in said
    assert resumed["weights_fingerprints"] == whole["weights_fingerprints"], step


@pytest.mark.soak  # make soak: two workers and one 2-replica process, real (about 40 s)
def test_its_own_step_on_two_workers_takes_the_two_replica_step(tmp_path):
    """The guide's train_step on two workers (tfmulti.launch) ends where one process on 2
    replicas ends: the same global step, the optimizer's all-reduce across the workers."""
    import subprocess
    import sys

    from test_resume import environment

    (tmp_path / "guide.py").write_text(GUIDE)
    env = {**environment(), "PYTHONPATH": str(tmp_path)}
    flags = ["--model=guide:custom", "--dataset=guide:regression", "--global_batch_size=64",
             "--epochs=2", "--deterministic", "--seed=2"]
    single = subprocess.run([sys.executable, "-m", "tfmulti.main", *flags, "--cpu_replicas=2",
                             f"--model_dir={tmp_path / 'single'}"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert single.returncode == 0, single.stderr[-2000:]
    launched = subprocess.run([sys.executable, "-m", "tfmulti.launch", "--workers=2", "--",
                               *flags, "--cpu_replicas=1", f"--model_dir={tmp_path / 'two'}"],
                              cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=300)
    assert launched.returncode == 0, launched.stdout[-3000:] + launched.stderr[-2000:]
    assert "weights: the same on all 2 workers" in launched.stdout
    sys.path.insert(0, str(tmp_path))
    try:
        import guide
    finally:
        sys.path.pop(0)

    def loaded(folder):
        return keras.saving.load_model(tmp_path / folder / names.MODEL_FILE, compile=False,
                                       custom_objects={"CustomModel": guide.CustomModel})

    for a, b in zip(loaded("single").get_weights(), loaded("two").get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
