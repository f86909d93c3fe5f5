"""--model=MODULE:FUNCTION: your own Keras model on the engine (a module written here)."""
import dataclasses
import json
import os
import re
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmulti.data import pipeline
from tfmulti.errors import UsageError
from tfmulti.evaluate import evaluation
from tfmulti.models import task, usermodel, zoo
from tfmulti.run import plan
from tfmulti.run.config import RunConfig
from tfmulti.rundir import lifecycle, names
from tfmulti.training import engine, optim, train
from tfmulti.tune.objective import SessionObjective

OBJECTIVE = SessionObjective("val_accuracy", "max", "val_acc")  # a session's default

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
L2 = 0.05

MODULE = textwrap.dedent(f'''
    import keras
    import numpy as np
    from keras import layers

    # TensorFlow at work as the module is imported, as Keras's examples do (a layer adapted
    # on the data at the top): tfmulti sets its devices up before it imports your module
    NORMALIZER = layers.Normalization()
    NORMALIZER.adapt(np.random.default_rng(0).uniform(0, 255, (64, 28, 28, 1)))
    AT_IMPORT = layers.Dense(10)
    AT_IMPORT.build((None, 784))


    def adapted(input_shape, num_classes):
        """The layer adapted at import (only read: its one copy serves every replica)."""
        inputs = keras.Input(input_shape)
        x = layers.Flatten()(NORMALIZER(inputs))
        return keras.Model(inputs, layers.Dense(num_classes)(x))


    def trained_at_import(input_shape, num_classes):
        """A layer made at import that would be trained: one copy, for several replicas."""
        inputs = keras.Input(input_shape)
        return keras.Model(inputs, AT_IMPORT(layers.Flatten()(inputs)))


    def small(input_shape, num_classes):
        """Conv with an L2 penalty, Keras's own batch norm, dropout, logits."""
        inputs = keras.Input(input_shape)
        x = layers.Conv2D(8, 3, strides=2, kernel_regularizer=keras.regularizers.L2(1e-4),
                          kernel_initializer=keras.initializers.GlorotUniform(seed=1))(inputs)
        x = layers.BatchNormalization(momentum=0.5)(x)
        x = layers.ReLU()(x)
        x = layers.Flatten()(layers.MaxPooling2D(2)(x))
        x = layers.Dropout(0.3, seed=2)(x)
        return keras.Model(inputs, layers.Dense(num_classes, kernel_initializer=
                                                keras.initializers.GlorotUniform(seed=3))(x))


    def plain(input_shape, num_classes):
        """small without its penalty, dropout and batch norm: one conv and the logits."""
        inputs = keras.Input(input_shape)
        x = layers.Conv2D(4, 3, kernel_initializer=keras.initializers.GlorotUniform(seed=1))(inputs)
        x = layers.GlobalAveragePooling2D()(layers.ReLU()(x))
        return keras.Model(inputs, layers.Dense(num_classes, kernel_initializer=
                                                keras.initializers.GlorotUniform(seed=3))(x))


    def penalised(input_shape, num_classes):
        """plain with an L2 penalty on the conv."""
        inputs = keras.Input(input_shape)
        x = layers.Conv2D(4, 3, kernel_regularizer=keras.regularizers.L2({L2}),
                          kernel_initializer=keras.initializers.GlorotUniform(seed=1))(inputs)
        x = layers.GlobalAveragePooling2D()(layers.ReLU()(x))
        return keras.Model(inputs, layers.Dense(num_classes, kernel_initializer=
                                                keras.initializers.GlorotUniform(seed=3))(x))


    def normed(input_shape, num_classes):
        """Keras's batch norm after a conv without bias (its gradient would be 0 plus noise)."""
        inputs = keras.Input(input_shape)
        x = layers.Conv2D(4, 3, use_bias=False,
                          kernel_initializer=keras.initializers.GlorotUniform(seed=1))(inputs)
        x = layers.ReLU()(layers.BatchNormalization()(x))
        x = layers.GlobalAveragePooling2D()(x)
        return keras.Model(inputs, layers.Dense(num_classes, kernel_initializer=
                                                keras.initializers.GlorotUniform(seed=3))(x))


    def softmaxed(input_shape, num_classes):
        inputs = keras.Input(input_shape)
        x = layers.Flatten()(inputs)
        return keras.Model(inputs, layers.Dense(num_classes, activation="softmax")(x))


    def five_outputs(input_shape, num_classes):
        inputs = keras.Input(input_shape)
        return keras.Model(inputs, layers.Dense(5)(layers.Flatten()(inputs)))


    def tunable(input_shape, num_classes, hp):
        """Its own hyperparameters: the dense layer's units and the dropout."""
        inputs = keras.Input(input_shape)
        x = layers.Flatten()(inputs)
        x = layers.Dense(hp.Int("units", 4, 32, step=4, default=8), activation="relu")(x)
        x = layers.Dropout(hp.Choice("dropout", [0.0, 0.25]))(x)
        return keras.Model(inputs, layers.Dense(num_classes)(x))


    def shadows_a_setting(input_shape, num_classes, hp):
        """Names that are also tfmulti's settings (--width, --momentum): still the user's."""
        inputs = keras.Input(input_shape)
        x = layers.Dense(hp.Int("width", 4, 8))(layers.Flatten()(inputs))
        x = layers.Dropout(hp.Float("momentum", 0.0, 0.5))(x)
        if hp.Boolean("deeper"):
            with hp.conditional_scope("deeper", [True]):
                x = layers.Dense(hp.Int("extra", 2, 4))(x)
        assert hp.get("width") == hp.values["width"]
        return keras.Model(inputs, layers.Dense(num_classes)(x))


    def not_a_model(input_shape, num_classes):
        return "a model"


    def one_argument(input_shape):
        return None
''')


@pytest.fixture
def module(importable):
    """The module above, importable from the working directory under a name of its own."""
    return importable("user_models", MODULE)


def engine_of(strategy, spec, global_batch=32, grad_accum_steps=1, sync_batchnorm=False,
              dtype="float32"):
    return engine.Engine(strategy, lambda: zoo.build(spec, sync_batchnorm=sync_batchnorm,
                                                        dtype=dtype),
                         optim.constant(0.1), global_batch, grad_accum_steps=grad_accum_steps,
                         loss_scaling=dtype == "mixed_float16")


def one_step(eng, dataset, per_replica):
    fn = pipeline.train_input_fn(dataset.train_features, dataset.train_targets, per_replica, seed=0)
    list(eng.train_steps(iter(eng.distribute(fn)), 1))
    return eng.model.get_weights()


@pytest.mark.parametrize("function, words", [
    ("softmaxed", "ends in a softmax; tfmulti's loss takes logits"),
    ("five_outputs", "outputs shape (None, 5); tfmulti needs one logit per class, (None, 10)"),
    ("not_a_model", "returned str, not a Keras model"),
    ("one_argument", "tfmulti calls one_argument(input_shape, num_classes); yours takes "
                     "(input_shape)"),
    ("missing", "has no function 'missing'"),
])
def test_a_model_that_would_train_wrongly_is_refused_in_one_line(one_replica, module, function,
                                                                   words):
    with pytest.raises(UsageError) as refused, one_replica.scope():
        zoo.build(f"{module}:{function}")
    assert words in str(refused.value) and "\n" not in str(refused.value)


def test_layers_made_when_your_module_is_imported(one_replica, two_replicas, module,
                                                  tiny_synthetic):
    """A layer adapted at import trains on 2 replicas (every replica reads its one copy, as
    the doctor says); a trainable one made at import is refused in one line on 2 replicas
    (its one copy cannot be trained there: a traceback at the first step before) and trains
    on one."""
    usermodel.load_function(f"{module}:adapted")  # as the tools do: outside any scope
    eng = engine_of(two_replicas, f"{module}:adapted")
    before = eng.model.get_weights()
    after = one_step(eng, tiny_synthetic, 16)
    assert not np.array_equal(before[-2], after[-2])  # the dense kernel trained
    np.testing.assert_array_equal(before[0], after[0])  # the adapted mean is as adapted
    with pytest.raises(UsageError) as refused:
        engine_of(two_replicas, f"{module}:trained_at_import")
    assert re.search(r"trainable variable dense(_\d+)?/kernel \(2 of 2\) was made outside the "
                     r"strategy's scope .* cannot be trained on 2 replicas", str(refused.value))
    one_step(engine_of(one_replica, f"{module}:trained_at_import"), tiny_synthetic, 16)


def test_a_module_that_is_not_there_is_one_line(module, tmp_path):
    with pytest.raises(UsageError, match=f"--model=nowhere:small: no module 'nowhere' in the "
                                         f"working directory \\({tmp_path}\\) or on PYTHONPATH"):
        usermodel.load_function("nowhere:small")
    (tmp_path / "broken_module.py").write_text("import not_installed_anywhere\n")
    with pytest.raises(UsageError, match="importing broken_module failed: No module named "
                                         "'not_installed_anywhere'"):
        usermodel.load_function("broken_module:small")


@pytest.mark.parametrize("settings, words", [
    ({"model": "vgg"}, "--model=vgg: choose one of resnet18, lenet, or MODULE:FUNCTION"),
    ({"model": "mine:build", "width": 8}, "--width=8 sets a built-in model's channels"),
])
def test_model_flags_are_checked(settings, words):
    with pytest.raises(UsageError, match=words):
        RunConfig(**settings)
    assert RunConfig(model="pkg.mine:build").width == 0


def test_regularization_counts_once_per_step_on_any_replica_and_micro_batch_count(
        one_replica, two_replicas, tiny_synthetic, module):
    """An L2 penalty L2 * sum(w^2) adds -lr * 2 * L2 * w to the conv kernel's step, once:
    on 1 replica, on 2 (each adds half), and over 2 micro-batches (each adds half)."""
    plain = one_step(engine_of(one_replica, f"{module}:plain"), tiny_synthetic, 32)
    start = engine_of(one_replica, f"{module}:penalised").model.get_weights()
    steps = [one_step(engine_of(one_replica, f"{module}:penalised"), tiny_synthetic, 32),
             one_step(engine_of(two_replicas, f"{module}:penalised"), tiny_synthetic, 16),
             one_step(engine_of(one_replica, f"{module}:penalised", grad_accum_steps=2),
                      tiny_synthetic, 32)]
    expected = plain[0] - 0.1 * 2 * L2 * start[0]  # the kernel: the plain step plus the penalty's
    for weights in steps:
        np.testing.assert_allclose(weights[0], expected, rtol=1e-4, atol=1e-6)
        for a, b in zip(weights[1:], plain[1:]):  # nothing else is penalised
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_your_batch_norm_synchronized_takes_the_step_of_one_replica(
        one_replica, two_replicas, tiny_synthetic, module):
    """--sync_batchnorm reaches your BatchNormalization layers: 2 replicas of 16 normalise over
    the 32 examples, as 1 replica of 32 does (without it they differ)."""
    spec = f"{module}:normed"
    single = one_step(engine_of(one_replica, spec), tiny_synthetic, 32)
    synced = one_step(engine_of(two_replicas, spec, sync_batchnorm=True), tiny_synthetic, 16)
    apart = one_step(engine_of(two_replicas, spec), tiny_synthetic, 16)
    for a, b in zip(single, synced):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    assert max(np.abs(a - b).max() for a, b in zip(single, apart)) > 1e-4


@pytest.mark.soak  # make soak (29 s on the slow-kind stand-in); make test keeps your models
# trained and saved in test_yourtask.py, test_keras_examples.py and the command test below
def test_your_model_trains_with_dropout_and_batch_norm_and_is_saved(two_replicas, tiny_synthetic,
                                                                    module, tmp_path, capsys):
    cfg = RunConfig(model=f"{module}:small", per_replica_batch_size=32, epochs=4, base_lr=0.4,
                    dataset="synthetic", synthetic_train_size=1024, synthetic_test_size=250)
    lifecycle.prepare_model_dir(str(tmp_path / "run"))
    _, history = train.train_and_evaluate(two_replicas, tiny_synthetic, cfg,
                                          model_dir=str(tmp_path / "run"), verbose=0)
    assert history[-1]["test_acc"] > 0.3, history  # chance is 0.1
    saved = keras.saving.load_model(tmp_path / "run" / names.MODEL_FILE)
    images = tiny_synthetic.test_features[:64, :, :, None].astype("float32") / 255
    # evaluation is training=False: dropout off, batch norm on its moving statistics
    np.testing.assert_array_equal(saved(images, training=False), saved(images, training=False))
    moving = next(w for w in saved.weights if "moving_mean" in w.path)
    assert np.abs(moving.numpy()).max() > 0  # training=True updated the statistics
    # Provenance: run.json names your file; a resume after it changed says so in one line,
    # and one whose variables changed is refused naming the first that differs
    recorded = json.loads((tmp_path / "run" / lifecycle.RUN_FILE).read_text())["your_code"]
    assert recorded["model"]["file"] == f"{module}.py" and len(recorded["model"]["sha256"]) == 16
    source = tmp_path / f"{module}.py"
    source.write_text(source.read_text() + "# edited\n")
    capsys.readouterr()
    train.train_and_evaluate(two_replicas, tiny_synthetic, dataclasses.replace(cfg, epochs=5),
                             model_dir=str(tmp_path / "run"), verbose=1, write_model=False)
    said = capsys.readouterr().out
    assert (f"{module}.py (--model={module}:small) changed since the run started (another "
            "hash); resuming with the code as it is now") in said, said
    source.write_text(source.read_text().replace("Conv2D(8, 3, strides=2",
                                                 "Conv2D(6, 3, strides=2"))
    sys.modules.pop(module)
    with pytest.raises(UsageError, match=r"the model's variables changed since the run started: "
                                         r"variable 1 was \S+ 3x3x1x8, is \S+ 3x3x1x6 now"):
        train.train_and_evaluate(two_replicas, tiny_synthetic, dataclasses.replace(cfg, epochs=6),
                                 model_dir=str(tmp_path / "run"), verbose=0)


def test_your_model_under_mixed_precision_computes_in_float16_with_float32_logits(
        two_replicas, tiny_synthetic, module):
    eng = engine_of(two_replicas, f"{module}:small", dtype="mixed_float16")
    assert eng.model.layers[1].compute_dtype == "float16"  # the policy reached your layers
    assert keras.config.dtype_policy().name == "float32"  # and was put back
    one_step(eng, tiny_synthetic, 16)
    assert np.isfinite(float(eng.figures.loss.result()))


@pytest.mark.soak  # a real process of the main job; make test keeps the smoke run's (make soak)
def test_the_command_imports_your_module_from_its_working_directory(tmp_path):
    """A real `python -m tfmulti.main --model=MODULE:FUNCTION` started in the module's folder,
    on 2 CPU replicas: the module's own TensorFlow work at import (an adapted layer) no longer
    ends in "Virtual devices cannot be modified after being initialized"."""
    (tmp_path / "my_models.py").write_text(MODULE)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = ROOT  # tfmulti itself; the module is found in the working directory
    result = subprocess.run(
        [sys.executable, "-m", "tfmulti.main", "--model=my_models:small", "--dataset=synthetic",
         "--synthetic_train_size=512", "--synthetic_test_size=64", "--epochs=1",
         "--per_replica_batch_size=32", "--cpu_replicas=2", f"--model_dir={tmp_path}/run"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Training my_models:small on synthetic" in result.stdout


CUSTOM = textwrap.dedent('''
    import keras
    from keras import layers


    @keras.saving.register_keras_serializable(package="custom_models")
    class Scale(layers.Layer):
        """A layer of the user's own, saved by its registered name."""

        def __init__(self, factor=0.5, **kwargs):
            super().__init__(**kwargs)
            self.factor = factor

        def call(self, x):
            return x * self.factor

        def get_config(self):
            return {**super().get_config(), "factor": self.factor}


    def scaled(input_shape, num_classes):
        inputs = keras.Input(input_shape)
        return keras.Model(inputs, layers.Dense(num_classes)(Scale()(layers.Flatten()(inputs))))
''')


@pytest.mark.soak  # make soak: a real run and evaluate, 12 s
def test_evaluate_knows_your_registered_layer_from_the_module_the_run_recorded(
        tool, tmp_path, monkeypatch):
    """A model with a custom layer of the user's (registered, with get_config) trains in a
    real process; tfmulti.evaluate then imports the --model module the run recorded, so Keras
    finds the class (its traceback "Could not locate class" before). The module changed since
    is not imported (run.json is anyone's file), and the missing class is one line."""
    (tmp_path / "custom_models.py").write_text(CUSTOM)
    trained = subprocess.run(
        [sys.executable, "-m", "tfmulti.main", "--model=custom_models:scaled",
         "--dataset=synthetic", "--synthetic_train_size=256", "--synthetic_test_size=64",
         "--epochs=1", "--global_batch_size=64", "--num_gpus=0", f"--model_dir={tmp_path}/run"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True,
        timeout=300)
    assert trained.returncode == 0, trained.stderr[-2000:]
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "custom_models.py").write_text(CUSTOM + "# changed since\n")
    code, _, err = tool("evaluate", f"--model_dir={tmp_path}/run")
    assert code == 1 and err.strip().splitlines() == [
        f"tfmulti: error: {tmp_path}/run/model.keras uses 'Scale', a class Keras "
        "does not know; the custom_models found here is not the file the run recorded (another "
        "hash, or none), so it was not imported: run evaluate where the run's custom_models is "
        "found (the working directory or PYTHONPATH)"], err
    assert "custom_models" not in sys.modules
    (tmp_path / "custom_models.py").write_text(CUSTOM)
    code, out, err = tool("evaluate", f"--model_dir={tmp_path}/run")
    assert code == 0 and "test acc" in out.lower(), err


def test_a_model_refused_when_built_leaves_no_new_run_folder(tmp_path, tool, monkeypatch,
                                                            one_replica):
    """The softmax check runs when the model is built, after the run's folder was made: a new
    folder is removed again (the command in this process, as cli.main runs it); one that was
    there stays."""
    (tmp_path / "my_models.py").write_text(MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    code, _, err = tool("main", "--model=my_models:softmaxed", "--dataset=synthetic",
                        "--synthetic_train_size=64", "--synthetic_test_size=64",
                        "--global_batch_size=32", f"--model_dir={tmp_path / 'new'}",
                        strategy=one_replica)
    assert code == 1
    assert "ends in a softmax" in err.strip().splitlines()[-1]
    assert not (tmp_path / "new").exists()
    (tmp_path / "kept").mkdir()
    with pytest.raises(UsageError):
        with lifecycle.removed_if_refused(str(tmp_path / "kept"), existed=True):
            raise UsageError("refused")
    assert (tmp_path / "kept").is_dir()


def test_your_hyperparameters_take_model_hparams_and_unknown_ones_are_refused(module):
    built = zoo.build(f"{module}:tunable", hparams='{"units":12,"dropout":0.25}')
    assert built.layers[2].units == 12 and built.layers[3].rate == 0.25
    assert zoo.build(f"{module}:tunable").layers[2].units == 8  # hp's default
    shadows = zoo.build(f"{module}:shadows_a_setting",
                           hparams='{"width":6,"momentum":0.5,"deeper":true,"extra":3}')
    assert [shadows.layers[i].units for i in (2, 4)] == [6, 3] and shadows.layers[3].rate == 0.5
    with pytest.raises(UsageError, match="tunable asks for no 'width' \\(it asks for: units, "
                                         "dropout\\)"):
        zoo.build(f"{module}:tunable", hparams='{"width":16}')
    with pytest.raises(UsageError, match="--model_hparams: plain\\(input_shape, num_classes\\) "
                                         "takes no hp"):
        zoo.build(f"{module}:plain", hparams='{"units":12}')
    for settings, words in [({"model": "lenet", "model_hparams": '{"a":1}'}, "is for your own"),
                            ({"model": "m:f", "model_hparams": "[1]"}, "give a JSON object")]:
        with pytest.raises(UsageError, match=words):
            RunConfig(**settings)


def test_your_hyperparameters_join_a_tuning_session_and_its_best_cfg(module, tiny_synthetic):
    """In a session the function's hp.Int/hp.Choice join tfmulti's search space; a trial
    trains with the drawn values as --model_hparams, and best.cfg writes them."""
    import keras_tuner as kt

    from tfmulti.distribution.devices import DevicePlan
    from tfmulti.tune import search

    base = RunConfig(model=f"{module}:tunable", epochs=1, validation_split=0.1)
    hypermodel = search.TrainingHyperModel(
        DevicePlan("cpu", 2), tiny_synthetic, base, {"per_replica_batch_size": [16, 32]},
        (0.01, 1.0), OBJECTIVE)
    hp = kt.HyperParameters()
    hypermodel.build(hp)
    assert {h.name for h in hp.space} >= {"per_replica_batch_size", "base_lr", "model/units",
                                          "model/dropout"}
    hp.values.update({"model/units": 20, "model/dropout": 0.25})
    cfg = hypermodel.trial_config(hp)
    assert cfg.model_hparams == '{"dropout":0.25,"units":20}'
    assert "--model_hparams={\"dropout\":0.25,\"units\":20}" in cfg.flag_lines("main")
    assert zoo.build(cfg.model, hparams=cfg.model_hparams).layers[2].units == 20


def test_your_names_and_tfmultis_are_two_hyperparameters_in_a_session(module, tiny_synthetic):
    """A function's `width` and `momentum` are its own: in a session they are searched beside
    tfmulti's --momentum, and best.cfg carries both, each under its own flag."""
    import keras_tuner as kt

    from tfmulti.distribution.devices import DevicePlan
    from tfmulti.tune import search

    base = RunConfig(model=f"{module}:shadows_a_setting", epochs=1, validation_split=0.1)
    hypermodel = search.TrainingHyperModel(DevicePlan("cpu", 2), tiny_synthetic, base,
                                           {"momentum": [0.0, 0.9]}, (0.01, 1.0), OBJECTIVE)
    hp = kt.HyperParameters()
    hypermodel.build(hp)
    names = {h.name for h in hp.space}
    assert {"momentum", "model/momentum", "model/width", "model/deeper"} <= names
    hp.values.update({"momentum": 0.9, "model/momentum": 0.25, "model/width": 5,
                      "model/deeper": False})
    cfg = hypermodel.trial_config(hp)
    assert cfg.momentum == 0.9
    assert json.loads(cfg.model_hparams) == {"deeper": False, "momentum": 0.25, "width": 5}
    lines = cfg.flag_lines("main")
    assert "--momentum=0.9" in lines and any(
        line.startswith("--model_hparams=") and '"momentum":0.25' in line for line in lines)


def test_model_hparams_given_to_a_session_are_fixed_not_searched(module, tiny_synthetic):
    """keras-tuner's oracle keeps a hyperparameter's definition, not a value put in hp: the
    values given with --model_hparams enter the space as Fixed, so every trial gets them."""
    import keras_tuner as kt

    from tfmulti.distribution.devices import DevicePlan
    from tfmulti.tune import search

    base = RunConfig(model=f"{module}:tunable", epochs=1, model_hparams='{"units":12}',
                     validation_split=0.1)
    hypermodel = search.TrainingHyperModel(DevicePlan("cpu", 2), tiny_synthetic, base,
                                           {"per_replica_batch_size": [16]}, (0.01, 1.0),
                                           OBJECTIVE)
    oracle = kt.oracles.RandomSearchOracle(max_trials=3, seed=0)
    hp = kt.HyperParameters()
    hypermodel.build(hp)
    oracle.update_space(hp)
    for _ in range(3):
        drawn = oracle.populate_space("t")["values"]
        assert drawn["model/units"] == 12 and drawn["model/dropout"] in (0.0, 0.25)
    units = next(h for h in oracle.get_space().space if h.name == "model/units")
    assert isinstance(units, kt.engine.hyperparameters.Fixed)


ADDED_LOSSES = textwrap.dedent('''
    import keras
    from keras import layers


    class Penalty(layers.Layer):
        """add_loss in call, as Keras's guide writes an activity penalty."""
        def call(self, inputs):
            self.add_loss(0.01 * keras.ops.mean(keras.ops.square(inputs)))
            return inputs


    def penalised(input_shape, num_classes):
        inputs = keras.Input(input_shape)
        x = layers.Flatten()(inputs)
        x = layers.Dense(16, activation="relu", activity_regularizer=keras.regularizers.L2(1e-3),
                         kernel_regularizer=keras.regularizers.L2(0.05),
                         kernel_initializer=keras.initializers.GlorotUniform(seed=1))(x)
        x = Penalty()(x)
        model = keras.Model(inputs, layers.Dense(num_classes, kernel_initializer=
                                                 keras.initializers.GlorotUniform(seed=3))(x))
        model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True), metrics=["accuracy"])
        return model
''')


def test_the_reported_loss_holds_the_models_own_losses_as_fits_does(one_replica, two_replicas,
                                                                   tiny_synthetic, importable):
    """An activity regularizer, a weight penalty and add_loss: the training loss of one step
    and the test loss are fit's and evaluate's (they once left these out: 2.30 against
    fit's 5.96), on 1 and on 2 replicas."""
    spec = importable("added", ADDED_LOSSES) + ":penalised"
    images = tiny_synthetic.train_features[:32, ..., None].astype("float32") / 255
    labels = tiny_synthetic.train_targets[:32]
    fitted = zoo.build(spec)
    logged = fitted.fit(images, labels, batch_size=32, epochs=1, shuffle=False,
                        verbose=0).history["loss"][0]
    tests = tiny_synthetic.test_features[..., None].astype("float32") / 255
    for strategy in (one_replica, two_replicas):
        eng = engine.Engine(strategy, lambda: zoo.build(spec), optim.constant(0.01), 32,
                            task_fn=lambda model: task.Task(model, tiny_synthetic, spec))
        batches = tf.data.Dataset.from_tensor_slices(((images * 255).astype("uint8")[..., 0],
                                                      labels)).map(
            lambda x, y: (pipeline.to_model_input(x[None])[0], y)).batch(32)
        iterator = iter(strategy.experimental_distribute_dataset(batches))
        eng.reset_train_metrics()
        list(eng.train_steps(iterator, 1))
        assert eng.train_results()["loss"] == pytest.approx(logged, rel=1e-5)
        evaluated = eng.evaluate(eng.distribute(pipeline.eval_input_fn(
            tiny_synthetic.test_features, tiny_synthetic.test_targets, 16 // 1)),
            plan.eval_steps(len(tests), 16 * strategy.num_replicas_in_sync))[0]
        keras_model = zoo.build(spec)
        keras_model.set_weights(eng.model.get_weights())
        expected = keras_model.evaluate(tests, tiny_synthetic.test_targets, batch_size=250,
                                        verbose=0, return_dict=True)
        assert evaluated["loss"] == pytest.approx(expected["loss"], rel=1e-5)
        assert float(eng.tests.added.result()) > 0.01  # the added part weighs in the figure
        # tfmulti.evaluate's figure too
        assert evaluation.evaluate(keras_model, tiny_synthetic)["loss"] == pytest.approx(
            expected["loss"], rel=1e-5)
