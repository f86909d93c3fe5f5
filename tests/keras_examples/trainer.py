"""keras.io "Trainer pattern" (nkovela): MyTrainer (its own train_step, which calls the
compiled loss and metrics, and call giving the wrapped model's) and the functional model it
wraps, compiled as written. The data: MNIST's shape (28x28x1 floats in 0-1), the embedded
synthetic set here."""
import tensorflow as tf
from tensorflow import keras

from tfmulti.data import synthetic

EPOCHS, BATCH_SIZE, METRIC = 2, 64, "accuracy"


class MyTrainer(keras.Model):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self.model(x, training=True)  # Forward pass
            # Compute loss value
            loss = self.compiled_loss(y, y_pred, regularization_losses=self.losses)

        # Compute gradients
        trainable_vars = self.trainable_variables
        gradients = tape.gradient(loss, trainable_vars)

        # Update weights
        self.optimizer.apply_gradients(zip(gradients, trainable_vars))

        # Update metrics configured in `compile()`
        self.compiled_metrics.update_state(y, y_pred)

        # Return a dict mapping metric names to current value.
        return {m.name: m.result() for m in self.metrics}

    def call(self, x):
        # Equivalent to `call()` of the wrapped keras.Model
        x = self.model(x)
        return x


def trainer_2(input_shape, num_classes):
    # A model defined using Functional API
    func_input = keras.Input(shape=(28, 28, 1))
    x = keras.layers.Flatten(input_shape=(28, 28))(func_input)
    x = keras.layers.Dense(512, activation="relu")(x)
    x = keras.layers.Dropout(0.4)(x)
    func_output = keras.layers.Dense(10, activation="softmax")(x)

    model_b = keras.Model(func_input, func_output)
    trainer_2 = MyTrainer(model_b)
    trainer_2.compile(
        keras.optimizers.Adam(),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    return trainer_2


(x_train, y_train), (x_test, y_test) = synthetic.make_dataset(1024, 256, seed=0)
x_train = x_train.reshape(-1, 28, 28, 1).astype("float32") / 255
x_test = x_test.reshape(-1, 28, 28, 1).astype("float32") / 255


def data():
    return (x_train, y_train), (x_test, y_test)


model = trainer_2
