"""keras.io "Endpoint layer pattern" (fchollet; Keras 3): the LogisticEndpoint layer (its loss
by add_loss, its accuracy metric) and the model whose targets and sample weights are inputs,
compiled with an optimizer alone, as written. The data: the features alone, as fit(data)
takes them (a dict of inputs, targets and weights), made here. Its accuracy is the layer's,
of the logits against the targets; what it returns (and serves) is a softmax over its one
logit, 1.0 for every example: the served outputs carry no figure to compare."""
import keras
import numpy as np
from keras import ops

EPOCHS, BATCH_SIZE, METRIC = 3, 256, "accuracy"
SERVES_ITS_FIGURE = False


class LogisticEndpoint(keras.layers.Layer):
    def __init__(self, name=None):
        super().__init__(name=name)
        self.loss_fn = keras.losses.BinaryCrossentropy(from_logits=True)
        self.accuracy_metric = keras.metrics.BinaryAccuracy(name="accuracy")

    def call(self, logits, targets=None, sample_weight=None):
        if targets is not None:
            # Compute the training-time loss value and add it
            # to the layer using `self.add_loss()`.
            loss = self.loss_fn(targets, logits, sample_weight)
            self.add_loss(loss)

            # Log the accuracy as a metric (we could log arbitrary metrics,
            # including different metrics for training and inference.)
            self.accuracy_metric.update_state(targets, logits, sample_weight)

        # Return the inference-time prediction tensor (for `.predict()`).
        return ops.softmax(logits)


rng = np.random.default_rng(0)


def part(n):
    inputs = rng.random((n, 32)).astype("float32")
    return {"inputs": inputs,
            "targets": (inputs[:, :1] > 0.5).astype("float32"),
            "sample_weight": rng.random((n, 1)).astype("float32")}


train, test = part(256), part(64)


def data():  # fit(data): the features alone
    return (train, None), (test, None)


def endpoint_model(input_shape=None, num_classes=0):
    keras.utils.set_random_seed(2)
    inputs = keras.Input((32,), name="inputs")
    logits = keras.layers.Dense(1)(inputs)
    targets = keras.Input((1,), name="targets")
    sample_weight = keras.Input((1,), name="sample_weight")
    preds = LogisticEndpoint()(logits, targets, sample_weight)
    model = keras.Model([inputs, targets, sample_weight], preds)
    model.compile(keras.optimizers.Adam(1e-2))
    return model


model = endpoint_model
