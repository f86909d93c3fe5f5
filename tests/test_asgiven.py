"""Your model on your function's data takes the features as the function returns them, as
model.fit gives them: uint8 images unscaled and without a channel axis added, float sequences
of rank 3 not taken for images, a tuple of inputs in the model's order (#53 items 2 and 4).
tfmulti's own models (and its own sets) keep their preprocessing."""
import json
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf
from seeds import seed_keras

from tfmulti.data import pipeline, sources
from tfmulti.errors import UsageError
from tfmulti.evaluate import evaluation
from tfmulti.run.config import RunConfig
from tfmulti.rundir import names
from tfmulti.training import train

# The model part as keras-io's "Image classification with Vision Transformers" writes its
# preprocessing (a Normalization layer adapted on the uint8 training images at the module's
# import), on a small convolutional body; the data as keras.datasets gives it (uint8).
VISION = textwrap.dedent('''
    import keras
    import numpy as np
    from keras import layers

    from tfmulti.data import synthetic

    (x_train, y_train), (x_test, y_test) = synthetic.make_dataset(1024, 256, seed=0)
    x_train, x_test = x_train[..., None], x_test[..., None]  # as keras-io expands MNIST's

    data_augmentation = keras.Sequential(
        [layers.Normalization(), layers.RandomFlip("horizontal", seed=7)],
        name="data_augmentation")
    data_augmentation.layers[0].adapt(x_train)  # the mean and variance of 0-255 pixels


    def data():
        return (x_train, y_train), (x_test, y_test)


    def classifier(input_shape=(28, 28, 1), num_classes=10):
        keras.utils.set_random_seed(3)
        inputs = keras.Input(shape=input_shape)
        x = data_augmentation(inputs)
        x = layers.Conv2D(8, 3, activation="relu")(x)
        x = layers.MaxPooling2D(2)(x)
        x = layers.Flatten()(x)
        outputs = layers.Dense(10)(x)
        model = keras.Model(inputs, outputs)
        model.compile(optimizer=keras.optimizers.Adam(learning_rate=0.003),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
        return model
''')

# A time series of one channel (keras-io's "Timeseries classification from scratch" shape,
# (n, 500, 1) there) with class ids, alone and beside a second input as a tuple.
SEQUENCES = textwrap.dedent('''
    import keras
    import numpy as np
    from keras import layers

    rng = np.random.default_rng(0)


    def split(n):
        labels = rng.integers(0, 2, n).astype("int64")
        t = np.linspace(0, 8 * np.pi, 60, dtype="float32")
        waves = np.sin(t[None] * (1 + labels[:, None])) + 0.3 * rng.normal(size=(n, 60))
        extra = rng.normal(size=(n, 3)).astype("float32")
        return waves[..., None].astype("float32"), extra, labels


    (s, e, y), (ts, te, ty) = split(512), split(128)


    def sequences():
        return (s, y), (ts, ty)


    def pairs():
        return ((s, e), y), ((ts, te), ty)


    def body(series):
        x = layers.Conv1D(8, 5, activation="relu")(series)
        return layers.GlobalAveragePooling1D()(x)


    def compiled(model):
        model.compile(optimizer=keras.optimizers.Adam(0.01),
                      loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        return model


    def on_sequences(input_shape, num_classes):
        series = keras.Input((60, 1))
        return compiled(keras.Model(series, layers.Dense(2, activation="softmax")(body(series))))


    def on_pairs(input_shape, num_classes):
        series, extra = keras.Input((60, 1)), keras.Input((3,))
        x = layers.Concatenate()([body(series), extra])
        return compiled(keras.Model([series, extra], layers.Dense(2, activation="softmax")(x)))
''')


def config(model, dataset, **settings):
    return RunConfig(model=model, dataset=dataset, global_batch_size=32, seed=0,
                     deterministic=True, checkpoint_steps=0, **settings)


def trained(strategy, cfg, model_dir):
    model_dir.mkdir()
    dataset = sources.load_for(cfg)
    train.train_and_evaluate(strategy, dataset, cfg, verbose=1, model_dir=str(model_dir))
    return dataset, json.loads((model_dir / names.METRICS_FILE).read_text())["epochs"]


@pytest.mark.soak  # make soak, beside keras.io's ViT as written (test_keras_examples)
def test_uint8_images_reach_your_model_as_fit_gives_them(two_replicas, importable, tmp_path,
                                                         capsys):
    """The vision transformer's preprocessing (a Normalization adapted on uint8 pixels): fit
    trains it; tfmulti once divided the pixels by 255 first and stayed at chance (0.10 against
    fit's 0.86 in keras-io's example). Now 2 replicas end within noise of fit on one device,
    and the SavedModel serves the model's outputs on the uint8 images as they are."""
    module = importable("vision", VISION)
    cfg = config(f"{module}:classifier", f"{module}:data", epochs=3)
    dataset, epochs = trained(two_replicas, cfg, tmp_path / "run")
    said = capsys.readouterr().out
    assert ("your model takes its features as your function returns them, as model.fit gives "
            "them: uint8 [n, 28, 28, 1] (0-255: scale them in your model") in said, said
    assert not dataset.images and dataset.train_features.dtype == np.uint8
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["image_shape"] is None and run["features"] == "uint8 [n, 28, 28, 1]"
    assert " (1024 images, 10 classes) on [" in said, said

    users = __import__(module)
    fitted = users.classifier()
    fitted.fit(users.x_train, users.y_train, batch_size=32, epochs=3, verbose=0)
    fits = fitted.evaluate(users.x_test, users.y_test, verbose=0, return_dict=True)["accuracy"]
    ours = epochs[-1]["test_acc"]
    # measured: tfmulti 0.82, fit 0.82 (seed 0); chance is 0.10
    assert fits > 0.5 and ours > fits - 0.08, (ours, fits)

    serve = tf.saved_model.load(str(tmp_path / "run" / names.SAVED_MODEL_DIR)).signatures[
        "serving_default"]
    model = keras.saving.load_model(tmp_path / "run" / names.MODEL_FILE)
    served = serve(features=tf.constant(users.x_test[:16]))  # a classifier's outputs
    np.testing.assert_allclose(served["logits"].numpy(), model(users.x_test[:16],
                                                               training=False), atol=1e-5)
    assert set(served) == {"logits", "probabilities", "class_ids", "classes"}
    # tfmulti.evaluate reads the data as the run took it
    assert evaluation.evaluate(model, dataset)["accuracy"] == pytest.approx(ours, abs=1e-6)


@pytest.mark.parametrize("function, model", [("sequences", "on_sequences"),
                                             ("pairs", "on_pairs")])
def test_float_sequences_and_tuples_of_inputs_train_as_given(one_replica, importable, tmp_path,
                                                             function, model, capsys):
    """Features (n, 60, 1) of floats with class ids were taken for images (a channel axis
    added: the model's error blamed the model); a tuple of inputs ended in a traceback. Both
    train as fit trains them, and the SavedModel takes them as the data holds them. Reports
    count them in examples (the series were once counted in images, 60 x 1 pixels)."""
    module = importable("series", SEQUENCES)
    cfg = config(f"{module}:{model}", f"{module}:{function}", epochs=4)
    dataset, epochs = trained(one_replica, cfg, tmp_path / "run")
    assert dataset.example_word == "examples"
    said = capsys.readouterr().out  # said where tfmulti once took them for images
    assert f" ({dataset.train_size} examples, 2 classes) on [" in said, said
    assert ("takes its features as your function returns them, as model.fit gives them: "
            "float32 [n, 60, 1]\n" in said) is (function == "sequences"), said
    assert epochs[-1]["test_acc"] > 0.8, epochs  # measured 1.0: the two classes' frequencies
    users = __import__(module)
    given = users.pairs()[1][0] if function == "pairs" else (users.ts,)
    batches = pipeline.train_input_fn(dataset.train_features, dataset.train_targets, 8, 0,
                                      images=dataset.images)(tf.distribute.InputContext())
    fed = tf.nest.flatten(batches.element_spec[0])  # what the model is given: no channel added
    assert [(s.shape.as_list(), s.dtype) for s in fed] == [
        ([8, *a.shape[1:]], tf.float32) for a in given]
    serve = tf.saved_model.load(str(tmp_path / "run" / names.SAVED_MODEL_DIR)).signatures[
        "serving_default"]
    inputs = ({f"features_{i}": tf.constant(a[:8]) for i, a in enumerate(given)}
              if function == "pairs" else {"features": tf.constant(given[0][:8])})
    saved = keras.saving.load_model(tmp_path / "run" / names.MODEL_FILE)
    direct = saved(tuple(a[:8] for a in given) if function == "pairs" else given[0][:8])
    served = serve(**inputs)
    np.testing.assert_allclose(served["probabilities" if function == "sequences" else "outputs"],
                               direct, atol=1e-6)


def test_tfmultis_models_keep_their_preprocessing_on_your_data(importable):
    """The same function's uint8 images for --model=lenet: scaled to [0, 1], a channel axis
    as tfmulti's models take them; and --image_size is for those only."""
    module = importable("vision", VISION)
    ours = sources.load_for(config("lenet", f"{module}:data"))
    assert ours.images and ours.input_shape == (28, 28, 1)
    assert sources.load_for(config("lenet", f"{module}:data", image_size="32")).input_shape == (
        32, 32, 1)
    with pytest.raises(UsageError, match=f"--image_size=32: --model={module}:classifier takes the "
                       f"features of --dataset={module}:data as your function returns them, as "
                       "model.fit does; resize them there, or in your model"):
        config(f"{module}:classifier", f"{module}:data", image_size="32")
    fed = next(iter(pipeline.train_input_fn(ours.train_features, ours.train_targets, 8, 0,
                                            images=ours.images)(tf.distribute.InputContext())))[0]
    assert fed.dtype == tf.float32 and fed.shape[1:] == (28, 28, 1)
    assert 0.5 < float(tf.reduce_max(fed)) <= 1.0  # uint8 0-255 scaled to [0, 1]


PLAIN = textwrap.dedent('''
    import keras
    from keras import layers

    from tfmulti.data import synthetic


    def synthetic_as_arrays():
        """The synthetic set of the run below (512 + 256, seed 0), as a function gives it."""
        (x, y), (tx, ty) = synthetic.make_dataset(512, 256, seed=0)
        return (x[..., None], y), (tx[..., None], ty), list(synthetic.CLASS_NAMES)


    def dense(input_shape, num_classes):
        inputs = keras.Input(input_shape)
        x = layers.Dense(32, activation="tanh")(layers.Flatten()(inputs))
        return keras.Model(inputs, layers.Dense(num_classes)(x))
''')


def test_evaluate_takes_the_data_as_the_run_took_it(one_replica, importable, tmp_path):
    """A run whose model trained on images scaled to [0, 1] (tfmulti's own set here; a data
    function's under an earlier tfmulti) evaluated on a function's uint8 images of the same
    shape: scaled as the run took them, so the run's own test accuracy (unscaled they would
    be another input, silently)."""
    module = importable("plain", PLAIN)
    cfg = RunConfig(model=f"{module}:dense", dataset="synthetic", synthetic_train_size=512,
                    synthetic_test_size=256, global_batch_size=32, epochs=2, seed=0,
                    checkpoint_steps=0, base_lr=1.0)
    (tmp_path / "run").mkdir()
    seed_keras(0)  # the model's initial weights
    _, records = train.train_and_evaluate(one_replica, sources.load_for(cfg), cfg, verbose=0,
                                          model_dir=str(tmp_path / "run"))
    found = evaluation.evaluate_run(str(tmp_path / "run"),
                                    {"dataset": f"{module}:synthetic_as_arrays"})
    assert found.result["accuracy"] == pytest.approx(records[-1]["test_acc"], abs=1e-6)
    assert found.result["loss"] == pytest.approx(records[-1]["test_loss"], rel=1e-5)
    assert found.result["accuracy"] > 0.5, found.result["accuracy"]


@pytest.mark.soak  # make soak: a trained run's folder (make test keeps evaluate's own rule)
def test_a_run_an_earlier_tfmulti_fed_scaled_images_is_refused_with_the_reason(
        one_replica, importable, tmp_path):
    """The same command on a run folder whose run.json says its model took images (scaled,
    a channel axis added, as tfmulti fed a data function's images before): one line that
    says why it cannot resume here, nothing overwritten."""
    module = importable("vision", VISION)
    cfg = config(f"{module}:classifier", f"{module}:data", epochs=1)
    trained(one_replica, cfg, tmp_path / "run")
    path = tmp_path / "run" / "run.json"
    run = json.loads(path.read_text())
    run.pop("features")
    path.write_text(json.dumps({**run, "image_shape": [28, 28, 1], "image_dtype": "uint8"}))
    before = path.read_text()
    with pytest.raises(UsageError, match="holds a different run .*; your model now takes your "
                       "function's features as it returns them, as model.fit does \\(the "
                       "tfmulti that started this run scaled its images"):
        train.train_and_evaluate(one_replica, sources.load_for(cfg), cfg, verbose=0,
                                 model_dir=str(tmp_path / "run"))
    assert path.read_text() == before


@pytest.mark.parametrize("shape, image", [
    ((5, 28, 28), True), ((5, 28, 28, 3), True), ((5, 2, 2), True), ((5, 8, 1), True),
    ((5, 9, 1), False), ((5, 60, 1), False), ((5, 500, 1), False), ((5, 1, 500, 3), False),
    ((5, 60, 3), False), ((5, 24, 3), True), ((5, 0, 4), False)])
def test_reports_count_images_by_their_shape_and_series_in_examples(shape, image):
    """Features your model takes as given are counted in images when they are shaped like
    one (at most MAX_IMAGE_ASPECT times as long as wide, past it: a series)."""
    from tfmulti.data.dataset import MAX_IMAGE_ASPECT, DataSet, image_shaped

    assert MAX_IMAGE_ASPECT == 8  # the boundary the shapes above sit on each side of
    features = np.zeros(shape, np.float32)
    assert image_shaped(features) is image
    dataset = DataSet("m:data", "m:data() (arrays)", features, np.zeros(5, np.int32),
                      features, np.zeros(5, np.int32), images=False, images_as_given=True)
    assert dataset.example_word == ("images" if image else "examples")
