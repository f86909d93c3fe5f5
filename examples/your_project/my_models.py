"""Your models: each function takes (input_shape, num_classes) and returns a Keras model that
outputs one logit per class (no softmax). tfmulti builds it inside the strategy's scope on
every device; uncompiled, tfmulti supplies the loss, the optimizer and the metrics, compiled,
they are yours."""
import keras
import tensorflow as tf
from keras import layers


def small_cnn(input_shape, num_classes):
    """Two conv blocks with batch norm, dropout and an L2 penalty (counted once per step)."""
    return keras.Model(*_small_cnn_layers(input_shape, num_classes), name="small_cnn")


class OwnStep(keras.Model):
    """A model with its own train_step, as Keras's guide "Customizing what happens in fit()"
    writes it: tfmulti runs this step on every replica, as model.fit does."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(gradients, self.trainable_variables)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


def own_step_cnn(input_shape, num_classes):
    """small_cnn with the train_step above, compiled (its step needs the loss)."""
    model = OwnStep(*_small_cnn_layers(input_shape, num_classes), name="own_step_cnn")
    model.compile(optimizer=keras.optimizers.SGD(0.025),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def _small_cnn_layers(input_shape, num_classes):
    """small_cnn's (inputs, logits)."""
    inputs = keras.Input(input_shape)
    x = inputs
    for filters in (16, 32):
        x = layers.Conv2D(filters, 3, padding="same", use_bias=False,
                          kernel_regularizer=keras.regularizers.L2(1e-4))(x)
        x = layers.ReLU()(layers.BatchNormalization()(x))
        x = layers.MaxPooling2D(2)(x)
    x = layers.Dropout(0.2)(layers.GlobalAveragePooling2D()(x))
    return inputs, layers.Dense(num_classes)(x)


def tunable_cnn(input_shape, num_classes, hp):
    """small_cnn whose width and dropout a tuning session searches (hp: keras-tuner's)."""
    inputs = keras.Input(input_shape)
    x = inputs
    width = hp.Choice("filters", [8, 16, 32], default=16)
    for scale in (1, 2):
        x = layers.Conv2D(width * scale, 3, padding="same", use_bias=False)(x)
        x = layers.ReLU()(layers.BatchNormalization()(x))
        x = layers.MaxPooling2D(2)(x)
    x = layers.Dropout(hp.Float("dropout", 0.0, 0.4, step=0.2))(layers.GlobalAveragePooling2D()(x))
    return keras.Model(inputs, layers.Dense(num_classes)(x), name="tunable_cnn")
