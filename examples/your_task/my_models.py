"""The models of a project that is not an image classifier.

text_classifier: token ids -> an embedding per word, averaged -> a logit per sentiment
(uncompiled: tfmulti supplies the loss, SGD and accuracy); tunable_text: the same with its
embedding size and hidden layer searched. price_regression: named inputs -> a price,
compiled with its loss and metric, which are the ones tfmulti trains and reports.
"""
import keras
from keras import layers
from my_data import vocabulary_size


def text_classifier(input_shape, num_classes):
    tokens = keras.Input(input_shape, dtype="int32", name="tokens")
    x = layers.Embedding(vocabulary_size(), 16, mask_zero=True)(tokens)
    x = layers.GlobalAveragePooling1D()(x)
    x = layers.Dropout(0.2)(layers.Dense(32, activation="relu")(x))
    return keras.Model(tokens, layers.Dense(num_classes)(x))


def tunable_text(input_shape, num_classes, hp):
    tokens = keras.Input(input_shape, dtype="int32", name="tokens")
    x = layers.Embedding(vocabulary_size(), hp.Choice("embedding", [8, 16, 32]),
                         mask_zero=True)(tokens)
    x = layers.GlobalAveragePooling1D()(x)
    x = layers.Dense(hp.Int("units", 16, 64, step=16, default=32), activation="relu")(x)
    return keras.Model(tokens, layers.Dense(num_classes)(x))


def price_regression(input_shape, num_classes):
    area = keras.Input(input_shape["area"], name="area")
    ratings = keras.Input(input_shape["ratings"], name="ratings")
    x = layers.Concatenate()([layers.Reshape((1,))(area), ratings])
    x = layers.Dense(32, activation="relu")(x)
    model = keras.Model({"area": area, "ratings": ratings}, layers.Dense(1, name="price")(x))
    model.compile(optimizer=keras.optimizers.SGD(momentum=0.9), loss="mse", metrics=["mae"])
    return model
