"""keras.io "Image classification from scratch" (fchollet): the augmentation layers inside
the model (the example's option 1, which it recommends on a GPU), make_model and its compile
as written: a binary classifier giving one logit. The data: uint8 RGB images with labels 0
and 1, as image_dataset_from_directory reads Cats vs Dogs, made here at 32x32 (180x180 there).
The figure compared is the test loss: the example's BinaryAccuracy thresholds the logit at
0.5 (as written), and after this few steps the batch norms' moving statistics keep every
inference logit below it (the order of the logits is right), so its accuracy is the share of
one class under fit and tfmulti alike."""
import keras
import numpy as np
from keras import layers

EPOCHS, BATCH_SIZE, METRIC = 4, 16, "loss"

image_size = (32, 32)

data_augmentation_layers = [
    layers.RandomFlip("horizontal"),
    layers.RandomRotation(0.1),
]


def data_augmentation(images):
    for layer in data_augmentation_layers:
        images = layer(images)
    return images


def pictures(n, rng):
    labels = rng.integers(0, 2, n)
    y, x = np.mgrid[0:32, 0:32]
    ring = ((y - 16) ** 2 + (x - 16) ** 2 < 100).astype("float32")
    shape = np.where(labels[:, None, None] == 1, ring, 1 - ring)
    pixels = 140 * shape[..., None] + rng.uniform(0, 115, (n, 32, 32, 3))
    return pixels.astype("uint8"), labels.astype("int64")


_rng = np.random.default_rng(0)
(x_train, y_train), (x_test, y_test) = pictures(384, _rng), pictures(256, _rng)


def data():
    return (x_train, y_train), (x_test, y_test)


def make_model(input_shape, num_classes):
    inputs = keras.Input(shape=input_shape)
    x = data_augmentation(inputs)

    # Entry block
    x = layers.Rescaling(1.0 / 255)(x)
    x = layers.Conv2D(128, 3, strides=2, padding="same")(x)
    x = layers.BatchNormalization()(x)
    x = layers.Activation("relu")(x)

    previous_block_activation = x  # Set aside residual

    for size in [256, 512, 728]:
        x = layers.Activation("relu")(x)
        x = layers.SeparableConv2D(size, 3, padding="same")(x)
        x = layers.BatchNormalization()(x)

        x = layers.Activation("relu")(x)
        x = layers.SeparableConv2D(size, 3, padding="same")(x)
        x = layers.BatchNormalization()(x)

        x = layers.MaxPooling2D(3, strides=2, padding="same")(x)

        # Project residual
        residual = layers.Conv2D(size, 1, strides=2, padding="same")(
            previous_block_activation
        )
        x = layers.add([x, residual])  # Add back residual
        previous_block_activation = x  # Set aside next residual

    x = layers.SeparableConv2D(1024, 3, padding="same")(x)
    x = layers.BatchNormalization()(x)
    x = layers.Activation("relu")(x)

    x = layers.GlobalAveragePooling2D()(x)
    if num_classes == 2:
        units = 1
    else:
        units = num_classes

    x = layers.Dropout(0.25)(x)
    # We specify activation=None so as to return logits
    outputs = layers.Dense(units, activation=None)(x)
    return keras.Model(inputs, outputs)


def model(input_shape=None, num_classes=None):
    model = make_model(input_shape=image_size + (3,), num_classes=2)
    model.compile(
        optimizer=keras.optimizers.Adam(3e-4),
        loss=keras.losses.BinaryCrossentropy(from_logits=True),
        metrics=[keras.metrics.BinaryAccuracy(name="acc")],
    )
    return model
