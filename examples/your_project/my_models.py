"""Your models: each function takes (input_shape, num_classes) and returns an uncompiled Keras
model that outputs one logit per class (no softmax). tfmulti builds it inside the strategy's
scope on every device, and supplies the loss, the optimizer and the metrics."""
import keras
from keras import layers


def small_cnn(input_shape, num_classes):
    """Two conv blocks with batch norm, dropout and an L2 penalty (counted once per step)."""
    inputs = keras.Input(input_shape)
    x = inputs
    for filters in (16, 32):
        x = layers.Conv2D(filters, 3, padding="same", use_bias=False,
                          kernel_regularizer=keras.regularizers.L2(1e-4))(x)
        x = layers.ReLU()(layers.BatchNormalization()(x))
        x = layers.MaxPooling2D(2)(x)
    x = layers.Dropout(0.2)(layers.GlobalAveragePooling2D()(x))
    return keras.Model(inputs, layers.Dense(num_classes)(x), name="small_cnn")


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
