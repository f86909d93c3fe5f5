"""An endpoint-layer model (keras-io's "Endpoint layer pattern" as written for Keras 3: the
targets one of the model's inputs, its loss added by add_loss, compiled with an optimizer
alone) on features without targets, as model.fit(data) takes it (#53 item 6)."""
import json
import pathlib
import textwrap

import numpy as np
import pytest
import tensorflow as tf

from tfmulti.data import sources
from tfmulti.errors import UsageError
from tfmulti.run.config import RunConfig
from tfmulti.rundir import names
from tfmulti.training import train

EXAMPLES = pathlib.Path(__file__).parent / "keras_examples"
ENDPOINT = (EXAMPLES / "endpoint.py").read_text() + textwrap.dedent('''


    def with_a_loss(input_shape=None, num_classes=0):
        model = endpoint_model()
        model.compile(keras.optimizers.Adam(1e-2), loss="mse")
        return model
''')


def config(module, model="endpoint_model", **settings):
    return RunConfig(model=f"{module}:{model}", dataset=f"{module}:data", global_batch_size=256,
                     seed=0, deterministic=True, checkpoint_steps=0, epochs=3, **settings)


@pytest.mark.soak  # make soak (make test: the example as written against fit's figure,
@pytest.mark.filterwarnings("ignore:You are using a softmax")  # test_keras_examples.py)
def test_an_endpoint_model_trains_on_two_replicas_as_fit_does(two_replicas, importable,
                                                              tmp_path):
    """It was refused ("not compiled"). Three steps of the whole training set on 2 replicas:
    the weights are fit's on one device, and the logs (its add_loss loss, its layer's
    accuracy) and test figures those fit and evaluate give on the same 2 replicas (1e-5);
    the SavedModel serves what the model gives."""
    module = importable("endpoint", ENDPOINT)
    cfg = config(module)
    dataset = sources.load_for(cfg)
    assert dataset.train_targets is None and dataset.test_targets is None
    train.train_and_evaluate(two_replicas, dataset, cfg, model_dir=str(tmp_path))
    epochs = json.loads((tmp_path / names.METRICS_FILE).read_text())["epochs"]
    users = __import__(module)
    ours = users.endpoint_model()  # the example's layer has no get_config: weights alone
    ours.load_weights(tmp_path / names.MODEL_FILE)
    alone = users.endpoint_model()
    alone.fit(users.train, batch_size=256, epochs=3, verbose=0, shuffle=False)
    for mine, theirs in zip(ours.get_weights(), alone.get_weights()):
        np.testing.assert_allclose(mine, theirs, atol=1e-5)
    with two_replicas.scope():  # fit on the same replicas: Keras scales this loss twice
        fitted = users.endpoint_model()  # there (its Loss object and add_loss each divide
    history = fitted.fit(users.train, batch_size=256, epochs=3, verbose=0,  # by 2), and
                         shuffle=False)  # Adam trains the same; docs/your-model.md
    assert [r["loss"] for r in epochs] == pytest.approx(history.history["loss"], rel=1e-5)
    assert [r["train_acc"] for r in epochs] == pytest.approx(history.history["accuracy"],
                                                              abs=1e-6)
    evaluated = fitted.evaluate(users.test, batch_size=64, verbose=0, return_dict=True)
    assert epochs[-1]["test_loss"] == pytest.approx(evaluated["loss"], rel=1e-5)
    assert epochs[-1]["test_acc"] == pytest.approx(evaluated["accuracy"], abs=1e-6)
    assert epochs[0]["loss"] != pytest.approx(epochs[-1]["loss"], rel=1e-3)  # it trained
    serve = tf.saved_model.load(str(tmp_path / names.SAVED_MODEL_DIR)).signatures[
        "serving_default"]
    given = {name: tf.constant(values[:8]) for name, values in users.test.items()}
    np.testing.assert_allclose(serve(**given)["outputs"], alone(given), atol=1e-5)


def test_features_without_targets_need_a_model_that_trains_itself(one_replica, importable):
    module = importable("endpoint", ENDPOINT)
    cfg = config(module, model="with_a_loss")  # its compiled loss would need targets
    with pytest.raises(UsageError, match=f"--model={module}:with_a_loss: --dataset={module}:data "
                       "gives features without targets, which a model takes when it trains "
                       "itself"):
        train.train_and_evaluate(one_replica, sources.load_for(cfg), cfg)
    with pytest.raises(UsageError, match="--model=lenet classifies images; the data set's "
                       "features are not images: give a model of your own"):
        cfg = RunConfig(model="lenet", dataset=f"{module}:data", global_batch_size=256)
        train.train_and_evaluate(one_replica, sources.load_for(cfg), cfg)
