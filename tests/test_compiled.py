"""Your model as you wrote it: a compiled loss and optimizer are the ones that train, an
uncompiled model that ends in probabilities is refused, a subclassed model passes the doctor,
a hyperparameter value outside its declared range is refused. Nothing replaced silently."""
import dataclasses
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf
from seeds import seed_keras

from tfmulti.data import pipeline
from tfmulti.doctor import yourcode
from tfmulti.errors import UsageError
from tfmulti.evaluate import evaluation
from tfmulti.models import zoo
from tfmulti.run.config import RunConfig
from tfmulti.run.plan import run_plan
from tfmulti.rundir import export
from tfmulti.training import compiled, train

MODULE = textwrap.dedent('''
    import keras
    import tensorflow as tf
    from keras import layers


    @keras.saving.register_keras_serializable("yours")
    class FocalLoss(keras.losses.Loss):
        """A focal loss on logits (Lin et al.), a Loss of the user's own."""
        def __init__(self, gamma=2.0, **kwargs):
            super().__init__(**kwargs)
            self.gamma = gamma

        def call(self, y_true, y_pred):
            ce = keras.losses.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True)
            return (1 - tf.exp(-ce)) ** self.gamma * ce

        def get_config(self):
            return {**super().get_config(), "gamma": self.gamma}


    def _dense(input_shape, num_classes, activation=None):
        inputs = keras.Input(input_shape)
        x = layers.Dense(16, activation="relu")(layers.Flatten()(inputs))
        return keras.Model(inputs, layers.Dense(num_classes, activation=activation)(x))


    def adam_focal(input_shape, num_classes):
        model = _dense(input_shape, num_classes)
        model.compile(optimizer=keras.optimizers.Adam(1e-3, beta_1=0.8, clipnorm=1.0),
                      loss=FocalLoss(),
                      metrics=["accuracy",
                               keras.metrics.SparseTopKCategoricalAccuracy(k=2, name="top2")])
        return model


    def adam_decaying(input_shape, num_classes):
        model = _dense(input_shape, num_classes)
        model.compile(optimizer=keras.optimizers.Adam(
            keras.optimizers.schedules.ExponentialDecay(0.01, 100, 0.5)), loss=FocalLoss())
        return model


    def sgd_focal(input_shape, num_classes):
        model = _dense(input_shape, num_classes)
        model.compile(optimizer=keras.optimizers.SGD(0.5), loss=FocalLoss())
        return model


    def softmax_compiled(input_shape, num_classes):
        model = _dense(input_shape, num_classes, "softmax")
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"])
        return model


    def sigmoid_uncompiled(input_shape, num_classes):
        return _dense(input_shape, num_classes, "sigmoid")


    class Subclassed(keras.Model):
        def __init__(self, num_classes):
            super().__init__()
            self.flat, self.out = layers.Flatten(), layers.Dense(num_classes)

        def call(self, x):
            return self.out(self.flat(x))


    def subclassed(input_shape, num_classes):
        return Subclassed(num_classes)


    def tunable(input_shape, num_classes, hp):
        inputs = keras.Input(input_shape)
        x = layers.Dense(hp.Int("units", 16, 128), activation="relu")(layers.Flatten()(inputs))
        x = layers.Dropout(hp.Choice("rate", [0.0, 0.25]))(x)
        if hp.Boolean("second"):
            x = layers.Dense(8)(x)
        return keras.Model(inputs, layers.Dense(num_classes)(x))
''')


@pytest.fixture
def module(importable):
    return importable("yours", MODULE)


def config(module, function, **settings):
    return RunConfig(**{"model": f"{module}:{function}", "dataset": "synthetic",
                        "synthetic_train_size": 1024, "synthetic_test_size": 250,
                        "global_batch_size": 32, "epochs": 1, **settings})


def engine_for(strategy, cfg, dataset):
    plan = run_plan(cfg, strategy.num_replicas_in_sync, len(dataset.train_features),
                    len(dataset.test_features))
    return train.build_engine(strategy, cfg, plan, dataset), plan


def test_a_compiled_optimizer_trains_with_its_settings_at_tfmultis_rate(
        module, one_replica, tiny_synthetic):
    cfg = config(module, "adam_focal", base_lr=0.004)
    eng, plan = engine_for(one_replica, cfg, tiny_synthetic)
    assert type(eng.optimizer) is keras.optimizers.Adam
    assert (eng.optimizer.beta_1, eng.optimizer.clipnorm) == (0.8, 1.0)
    assert eng.learning_rate() == pytest.approx(0.004 * 32 / 256)
    assert compiled.lines(cfg, plan, eng.compiled_optimizer) == (
        f"--model={module}:adam_focal is compiled with Adam: it trains with Adam at tfmulti's "
        "learning rate 0.0005 (--base_lr=0.004 per 256 examples, --lr_scaling=linear, global "
        "batch 32) in place of its own 0.001; give --base_lr=0.008 for its own rate",)
    assert eng.task.metric_names == ["accuracy", "top2"]  # its metrics are computed
    with pytest.raises(UsageError, match="--momentum=0.9: your model's compiled Adam has no "
                                         "momentum"):
        engine_for(one_replica, dataclasses.replace(cfg, momentum=0.9), tiny_synthetic)


def test_a_compiled_optimizer_keeps_its_own_rate_unless_a_rate_is_given(
        module, one_replica, tiny_synthetic):
    """Adam compiled at 0.001 once ran at 0.0125 (--base_lr's default, SGD's scale, applied
    to it). Its own rate is kept, with the same step as fit's, unless --base_lr or
    --lr_scaling is given on the command line (or searched by a tuning trial)."""
    from tfmulti.run import config as run_config
    from tfmulti.run import flagdefs
    from tfmulti.tune import search

    cfg = config(module, "adam_focal")
    assert cfg.keeps_compiled_rate
    eng, plan = engine_for(one_replica, cfg, tiny_synthetic)
    assert eng.learning_rate() == pytest.approx(0.001)
    assert compiled.as_trained(cfg, plan, eng.compiled_optimizer).learning_rate == (
        pytest.approx(0.001))
    assert compiled.lines(cfg, plan, eng.compiled_optimizer) == (
        f"--model={module}:adam_focal is compiled with Adam: it trains with Adam at its own "
        "learning rate 0.001, as model.fit trains it (--base_lr or --lr_scaling would replace "
        "it by tfmulti's)",)
    # its step is fit's: one batch of 32 on one device
    images, labels = tiny_synthetic.train_features[:32], tiny_synthetic.train_targets[:32]
    fitted = zoo.build(cfg.model)
    fitted.set_weights(eng.model.get_weights())
    fitted.fit(images[..., None].astype("float32") / 255, labels, batch_size=32, verbose=0)
    batches = tf.data.Dataset.from_tensor_slices((images, labels)).batch(32).map(
        lambda x, y: (pipeline.to_model_input(x), y))
    list(eng.train_steps(iter(batches), 1))
    for a, b in zip(eng.model.get_weights(), fitted.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-6)
    # a rate given on the command line, or searched, replaces it; a warm-up peaks at it
    flagdefs.FLAGS.unparse_flags()
    try:
        for argv, kept in ((["--base_lr=0.1"], False), (["--lr_scaling=linear"], False),
                           ([], True)):
            flagdefs.FLAGS(["main", f"--model={module}:adam_focal", "--dataset=synthetic", *argv])
            assert run_config.from_flags(flagdefs.FLAGS).keeps_compiled_rate is kept, argv
            flagdefs.FLAGS.unparse_flags()
    finally:
        flagdefs.FLAGS.unparse_flags()
    assert not search.trial_settings(cfg, {"base_lr": 0.2}).keeps_compiled_rate
    # a schedule of its own is kept as it is, and cannot be warmed up
    decaying = config(module, "adam_decaying")
    eng, plan = engine_for(one_replica, decaying, tiny_synthetic)
    assert isinstance(eng.optimizer._learning_rate, keras.optimizers.schedules.ExponentialDecay)
    assert compiled.lines(decaying, plan, eng.compiled_optimizer)[0].endswith(
        "at its own learning-rate schedule (ExponentialDecay, 0.01 at its start), as model.fit "
        "trains it (--base_lr or --lr_scaling would replace it by tfmulti's)")
    with pytest.raises(UsageError, match="compiled with a learning-rate schedule of its own"):
        engine_for(one_replica, dataclasses.replace(decaying, warmup_epochs=1.0), tiny_synthetic)
    warm = dataclasses.replace(cfg, warmup_epochs=1.0)
    eng, _ = engine_for(one_replica, warm, tiny_synthetic)
    steps = 1024 // 32
    assert eng.learning_rate() == pytest.approx(0.001 / steps)  # step 0 of the warm-up


def test_a_compiled_loss_is_the_loss_that_trains(module, two_replicas, tiny_synthetic):
    """One step on 2 replicas with the user's focal loss and SGD equals the step worked out
    by hand from that loss on the whole global batch."""
    cfg = config(module, "sgd_focal", base_lr=0.8)  # rate 0.1 at a global batch of 32
    eng, _ = engine_for(two_replicas, cfg, tiny_synthetic)
    variables = eng.model.trainable_variables
    before = [v.numpy() for v in variables]
    batches = iter(eng.distribute(pipeline.train_input_fn(
        tiny_synthetic.train_features, tiny_synthetic.train_targets, 16, cfg.seed)))
    list(eng.train_steps(batches, 1))
    after = [v.numpy() for v in variables]
    images, labels = next(iter(pipeline.train_input_fn(  # the same global batch, on 1 replica
        tiny_synthetic.train_features, tiny_synthetic.train_targets, 32, cfg.seed)(
        tf.distribute.InputContext())))
    for variable, value in zip(variables, before):
        variable.assign(value)
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(eng.model.loss.call(labels, eng.model(images, training=True)))
    grads = tape.gradient(loss, variables)
    assert type(eng.model.loss).__name__ == "FocalLoss"
    for w, g, trained in zip(before, grads, after):
        np.testing.assert_allclose(trained, w - 0.1 * g.numpy(), rtol=1e-4, atol=1e-6)


def test_a_softmax_model_compiled_with_its_loss_trains_evaluates_and_exports(
        module, one_replica, tiny_synthetic, tmp_path):
    cfg = config(module, "softmax_compiled", base_lr=2.0, epochs=3)
    seed_keras(0)  # its initial weights (unseeded, over 240 draws: 0.55 to 0.81, one CI 0.48)
    _, history = train.train_and_evaluate(one_replica, tiny_synthetic, cfg, verbose=0,
                                          model_dir=str(tmp_path))
    assert history[-1]["test_acc"] > 0.5, history
    model = keras.saving.load_model(str(tmp_path / "model.keras"))
    result = evaluation.evaluate(model, tiny_synthetic)
    assert result["loss"] == pytest.approx(history[-1]["test_loss"], rel=1e-4)
    assert result["accuracy"] == pytest.approx(history[-1]["test_acc"], abs=1e-6)
    serve = tf.saved_model.load(str(tmp_path / export.SAVED_MODEL_DIR)).signatures[
        export.SIGNATURE]
    served = serve(images=tf.constant(tiny_synthetic.test_features[:8][..., None]))
    assert "logits" not in served  # its outputs are probabilities already: not softmaxed again
    np.testing.assert_allclose(served["probabilities"].numpy().sum(axis=1), 1.0, rtol=1e-5)


@pytest.mark.parametrize("function, words", [
    ("sigmoid_uncompiled", "ends in a sigmoid; tfmulti's loss takes logits (from_logits=True): "
                           "remove the sigmoid from the last layer, or compile the model"),
])
def test_an_uncompiled_model_ending_in_probabilities_is_refused(module, one_replica, function,
                                                                words):
    with pytest.raises(UsageError, match=words.replace("(", "\\(").replace(")", "\\)")), \
            one_replica.scope():
        zoo.build(f"{module}:{function}")


def test_the_doctor_takes_a_subclassed_model(module, two_replicas):
    cfg = dataclasses.replace(config(module, "subclassed"), synthetic_train_size=64,
                              synthetic_test_size=16)
    findings = list(yourcode.findings_of(cfg, two_replicas))
    assert [kind for kind, _, _ in findings if kind == "problem"] == [], findings
    assert any(label == "model" and "(None, 10) logits" in text for _, label, text in findings)


@pytest.mark.parametrize("given, words", [
    ('{"units": 1000}', "units=1000 is outside the range your function declares for it "
                        "(16 to 128)"),
    ('{"units": 20.5}', "units=20.5: your function declares units an integer"),
    ('{"rate": 0.3}', "rate=0.3 is not among the values your function declares for it "
                      "(0.0, 0.25)"),
    ('{"second": 1}', "second=1: your function declares second a Boolean"),
])
def test_a_value_outside_its_declared_range_is_refused(module, one_replica, given, words):
    with pytest.raises(UsageError, match=words.replace("(", "\\(").replace(")", "\\)")), \
            one_replica.scope():
        zoo.build(f"{module}:tunable", hparams=given)
    with one_replica.scope():
        model = zoo.build(f"{module}:tunable", hparams='{"units": 128, "second": true}')
    assert model.layers[2].units == 128


def test_a_run_recorded_with_the_default_rate_resumes_and_a_kept_rate_is_part_of_the_run(
        module, tmp_path):
    """run.json of a run from before --base_lr could be unset holds 0.1 and linear: the same
    command resumes it (for a built-in model, unset means those). For your compiled model,
    keeping its own rate or not is part of the run: a resume that would change it is refused
    in one line naming --base_lr."""
    from tfmulti.distribution import storage
    from tfmulti.rundir import lifecycle

    def run(**settings):
        cfg = RunConfig(dataset="synthetic", **settings)
        return {"config": cfg.record(), "class_names": [], "image_shape": None,
                "image_dtype": None, "global_batch_size": 64}

    def identity(**settings):
        return lifecycle.identity(run(**settings))

    assert identity(model="lenet") == identity(model="lenet", base_lr=0.1, lr_scaling="linear")
    mine = f"{module}:adam_focal"
    assert identity(model=mine) != identity(model=mine, base_lr=0.1, lr_scaling="linear")
    assert identity(model=mine, base_lr=0.1) == identity(model=mine, base_lr=0.1,
                                                         lr_scaling="linear")
    storage.write_json(str(tmp_path / lifecycle.RUN_FILE), run(model=mine, base_lr=0.1,
                                                               lr_scaling="linear"))
    with pytest.raises(UsageError, match=r"holds a different run \(--base_lr 0.1 there, "
                                         r"\"unset: a compiled optimizer's own\" now"):
        lifecycle.open_run(str(tmp_path), run(model=mine))
