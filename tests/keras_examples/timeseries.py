"""keras.io "Timeseries classification with a Transformer model" (Theodoros Ntakouris): the
encoder block, build_model and its compile as written. The data: univariate series of shape
(n, length, 1) with 0/1 labels as the example reshapes FordA's, made here (60 steps, 500
there); build_model's arguments set smaller (head_size 256 and 4 blocks there)."""
import keras
import numpy as np
from keras import layers

EPOCHS, BATCH_SIZE, METRIC = 4, 64, "sparse_categorical_accuracy"


def readucr(n, rng):
    y = rng.integers(0, 2, n)
    t = np.linspace(0, 6 * np.pi, 60)
    x = np.sin(t[None] * (1 + 0.5 * y[:, None]) + rng.uniform(0, np.pi, (n, 1)))
    return (x + 0.3 * rng.normal(size=x.shape)).astype("float32"), y.astype("int64")


_rng = np.random.default_rng(0)
(x_train, y_train), (x_test, y_test) = readucr(768, _rng), readucr(256, _rng)
x_train = x_train.reshape((x_train.shape[0], x_train.shape[1], 1))
x_test = x_test.reshape((x_test.shape[0], x_test.shape[1], 1))

n_classes = len(np.unique(y_train))


def data():
    return (x_train, y_train), (x_test, y_test)


def transformer_encoder(inputs, head_size, num_heads, ff_dim, dropout=0):
    # Attention and Normalization
    x = layers.MultiHeadAttention(
        key_dim=head_size, num_heads=num_heads, dropout=dropout
    )(inputs, inputs)
    x = layers.Dropout(dropout)(x)
    x = layers.LayerNormalization(epsilon=1e-6)(x)
    res = x + inputs

    # Feed Forward Part
    x = layers.Conv1D(filters=ff_dim, kernel_size=1, activation="relu")(res)
    x = layers.Dropout(dropout)(x)
    x = layers.Conv1D(filters=inputs.shape[-1], kernel_size=1)(x)
    x = layers.LayerNormalization(epsilon=1e-6)(x)
    return x + res


def build_model(
    input_shape,
    head_size,
    num_heads,
    ff_dim,
    num_transformer_blocks,
    mlp_units,
    dropout=0,
    mlp_dropout=0,
):
    inputs = keras.Input(shape=input_shape)
    x = inputs
    for _ in range(num_transformer_blocks):
        x = transformer_encoder(x, head_size, num_heads, ff_dim, dropout)

    x = layers.GlobalAveragePooling1D(data_format="channels_last")(x)
    for dim in mlp_units:
        x = layers.Dense(dim, activation="relu")(x)
        x = layers.Dropout(mlp_dropout)(x)
    outputs = layers.Dense(n_classes, activation="softmax")(x)
    return keras.Model(inputs, outputs)


def model(input_shape=None, num_classes=None):
    input_shape = x_train.shape[1:]

    model = build_model(
        input_shape,
        head_size=64,
        num_heads=4,
        ff_dim=4,
        num_transformer_blocks=2,
        mlp_units=[128],
        mlp_dropout=0.4,
        dropout=0.25,
    )

    model.compile(
        loss="sparse_categorical_crossentropy",
        optimizer=keras.optimizers.Adam(learning_rate=1e-4),
        metrics=["sparse_categorical_accuracy"],
    )
    return model
