"""Sample weights ((x, y, weights) from your data function) and --class_weight weigh the
loss and the metrics as model.fit weighs them (#53): a step on 1 or 2 replicas moves the
weights as fit's step on one device does, and the evaluation weighs as Keras's evaluate."""
import json
import re
import textwrap

import keras
import numpy as np
import pytest

from tfmulti.data import sources, validation, weighting
from tfmulti.errors import DataError, UsageError
from tfmulti.evaluate import evaluation
from tfmulti.models.task import record_key
from tfmulti.run.config import RunConfig
from tfmulti.rundir import names
from tfmulti.training import train

# A classifier compiled as keras-io compiles one; the data made locally with a rare class
# and a weight for every example, returned as fit takes them.
WEIGHED = textwrap.dedent('''
    import keras
    import numpy as np
    from keras import layers

    rng = np.random.default_rng(0)
    centers = rng.normal(size=(4, 8)).astype("float32") * 2


    def split(n):
        labels = rng.choice(4, n, p=[0.7, 0.1, 0.1, 0.1]).astype("int64")
        features = centers[labels] + rng.normal(size=(n, 8)).astype("float32")
        return features, labels, rng.uniform(0, 2, n).astype("float32")


    (x, y, w), (tx, ty, tw) = split(64), split(100)


    def data():
        return (x, y, w), (tx, ty, tw)


    def unweighed():
        return (x, y), (tx, ty)


    def classifier(input_shape=(8,), num_classes=4):
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input(shape=input_shape),
                                  layers.Dense(16, activation="relu"),
                                  layers.Dense(num_classes, activation="softmax")])
        model.compile(optimizer=keras.optimizers.SGD(0.5),
                      loss="sparse_categorical_crossentropy", metrics=["accuracy"],
                      weighted_metrics=["accuracy"])
        return model
''')
CLASS_WEIGHT = {0: 0.5, 2: 3.0}


def config(module, data="data", **settings):
    return RunConfig(model=f"{module}:classifier", dataset=f"{module}:{data}",
                     global_batch_size=64, seed=0, deterministic=True, checkpoint_steps=0,
                     epochs=1, **settings)


@pytest.mark.parametrize("replicas, weighed_by", [  # one replica: make soak (make test's time)
    pytest.param("one_replica", "samples", marks=pytest.mark.soak),
                                                ("two_replicas", "samples"),
                                                ("two_replicas", "classes")])
def test_weighted_steps_and_evaluation_are_fits(replicas, weighed_by, request, importable,
                                                tmp_path, capsys):
    """One step on the whole training set (64 examples, one global batch) with your sample
    weights, or with --class_weight: the model tfmulti saves is the model fit trains with
    sample_weight= (or class_weight=) on one device (1e-6), the reported training loss and
    accuracy are fit's, and the test figures are Keras's evaluate(sample_weight=) on it."""
    module = importable("weighed", WEIGHED)
    by_class = weighed_by == "classes"
    cfg = (config(module, data="unweighed",
                  class_weight=json.dumps({str(k): v for k, v in CLASS_WEIGHT.items()}))
           if by_class else config(module))
    dataset = sources.load_for(cfg)
    train.train_and_evaluate(request.getfixturevalue(replicas), dataset, cfg,
                             model_dir=str(tmp_path))
    said = capsys.readouterr().out
    assert ("Training weighs each example's loss and metrics by --class_weight={\"0\": 0.5, "
            "\"2\": 3.0} (0: 0.5, 1: 1, 2: 3, 3: 1), as model.fit does\n" if by_class else
            "Training weighs each example's loss and metrics by your sample weights (mean ") in (
        said), said
    record = json.loads((tmp_path / names.METRICS_FILE).read_text())["epochs"][-1]
    ours = keras.saving.load_model(tmp_path / names.MODEL_FILE)

    users = __import__(module)
    fitted = users.classifier()
    history = fitted.fit(users.x, users.y, batch_size=64, epochs=1, verbose=0,
                         **({"class_weight": CLASS_WEIGHT} if by_class else
                            {"sample_weight": users.w}))
    for mine, theirs in zip(ours.get_weights(), fitted.get_weights()):
        np.testing.assert_allclose(mine, theirs, atol=1e-6)
    assert record["loss"] == pytest.approx(history.history["loss"][0], rel=1e-5)
    for name in ("accuracy", "weighted_accuracy"):  # compile(metrics=, weighted_metrics=)
        assert record[record_key("train", name)] == pytest.approx(history.history[name][0],
                                                                  abs=1e-6)
    figures = fitted.evaluate(users.tx, users.ty, sample_weight=None if by_class else users.tw,
                              verbose=0, return_dict=True)
    assert record["test_loss"] == pytest.approx(figures["loss"], rel=1e-5)
    assert record["test_acc"] == pytest.approx(figures["accuracy"], abs=1e-6)
    assert record["test_weighted_accuracy"] == pytest.approx(figures["weighted_accuracy"],
                                                             abs=1e-6)
    assert (figures["accuracy"] != figures["weighted_accuracy"]) is not by_class
    evaluated = evaluation.evaluate(ours, dataset)  # python -m tfmulti.evaluate's figures
    assert evaluated["loss"] == pytest.approx(record["test_loss"], rel=1e-5)
    assert evaluated["weighted_accuracy"] == pytest.approx(record["test_weighted_accuracy"],
                                                           abs=1e-6)
    plain = users.classifier()  # the weights made a difference to the step
    plain.fit(users.x, users.y, batch_size=64, epochs=1, verbose=0)
    assert np.abs(plain.get_weights()[0] - ours.get_weights()[0]).max() > 1e-3


def test_balanced_class_weights_and_what_is_refused(importable):
    module = importable("weighed", WEIGHED)
    dataset = sources.load_for(config(module, data="unweighed"))
    counts = np.bincount(dataset.train_targets, minlength=4)
    np.testing.assert_allclose(weighting.class_weights("balanced", dataset),
                               64 / (4 * counts), rtol=1e-6)
    assert weighting.train_weights(dataset, config(module, data="unweighed")) is None
    by_name = weighting.class_weights('{"3": 2}', dataset)
    np.testing.assert_array_equal(by_name, [1, 1, 1, 2])
    with pytest.raises(UsageError, match=r"--class_weight=\{\"7\": 2\}: no class '7' among the "
                       "4 classes"):
        weighting.class_weights('{"7": 2}', dataset)
    for text in ("heavy", '{"0": -1}', "[1, 2]"):
        with pytest.raises(UsageError, match="give balanced, or a JSON object of class weights"):
            RunConfig(class_weight=text)
    with pytest.raises(UsageError, match="gives sample weights, and model.fit takes one or "
                       "the other: multiply the class weights into your sample weights"):
        weighting.train_weights(sources.load_for(config(module)),
                                config(module, class_weight="balanced"))
    with pytest.raises(UsageError, match="sample and class weights are not served by the "
                       "tf.data service"):
        weighting.train_weights(dataset, config(module, data="unweighed", class_weight="balanced",
                                                data_service="grpc://localhost:5050"))
    # a validation part keeps each example's own weight
    weighed = sources.load_for(config(module))
    rest, held = validation.split(weighed, 0.25, 0)
    kept, out = validation.held_out_indices(weighed.train_targets, 0.25, 0)
    np.testing.assert_array_equal(rest.train_weights, weighed.train_weights[kept])
    np.testing.assert_array_equal(held[2], weighed.train_weights[out])


@pytest.mark.parametrize("weights, said", [
    ("np.ones(3)", "the train sample weights are 3; give one per example, [64]"),
    ("np.full(64, np.nan)", "train sample weight nan (example 0) is not a finite number of 0 "
                            "or more"),
    ("-np.ones(64)", "train sample weight -1 (example 0) is not a finite number of 0 or more")])
def test_bad_sample_weights_are_one_line(importable, weights, said):
    module = importable("bad", WEIGHED + textwrap.dedent(f'''
        import numpy as np


        def bad():
            return (x, y, {weights}), (tx, ty)
    '''))
    with pytest.raises(DataError, match=re.escape(f"--dataset={module}:bad: {said}")):
        sources.load_for(config(module, data="bad"))
