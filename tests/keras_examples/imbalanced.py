"""keras.io "Imbalanced classification: credit card fraud detection" (fchollet): the
normalization, the model, its metrics, its callback and its class weights as written. The
data: 29 features per transaction with about 2% frauds, made here (the Kaggle CSV there).
The example's fit: batch 2048, 30 epochs, callbacks=[ModelCheckpoint(...)],
class_weight={0: 1/count_0, 1: 1/count_1}; tfmulti takes the last two as --callbacks and
--class_weight."""
import json

import keras
import numpy as np

EPOCHS, BATCH_SIZE, METRIC = 6, 256, "recall"


def transactions(n, rng):
    targets = (rng.random(n) < 0.02).astype("uint8")
    features = rng.normal(size=(n, 29)).astype("float32")
    features[:, :4] += 2.0 * targets[:, None]
    return features, targets


_rng = np.random.default_rng(0)
(train_features, train_targets), (val_features, val_targets) = (transactions(6144, _rng),
                                                                transactions(2048, _rng))
counts = np.bincount(train_targets[:])
weight_for_0 = 1.0 / counts[0]
weight_for_1 = 1.0 / counts[1]

mean = np.mean(train_features, axis=0)
train_features -= mean
val_features -= mean
std = np.std(train_features, axis=0)
train_features /= std
val_features /= std


def data():
    return (train_features, train_targets), (val_features, val_targets)


def model(input_shape=None, num_classes=None):
    model = keras.Sequential(
        [
            keras.Input(shape=train_features.shape[1:]),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dropout(0.3),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dropout(0.3),
            keras.layers.Dense(1, activation="sigmoid"),
        ]
    )
    metrics = [
        keras.metrics.FalseNegatives(name="fn"),
        keras.metrics.FalsePositives(name="fp"),
        keras.metrics.TrueNegatives(name="tn"),
        keras.metrics.TruePositives(name="tp"),
        keras.metrics.Precision(name="precision"),
        keras.metrics.Recall(name="recall"),
    ]

    model.compile(
        optimizer=keras.optimizers.Adam(1e-2), loss="binary_crossentropy", metrics=metrics
    )
    return model


def callbacks():
    return [keras.callbacks.ModelCheckpoint("fraud_model_at_epoch_{epoch}.keras")]


class_weight = {0: weight_for_0, 1: weight_for_1}


def FIT():  # noqa: N802 (the example's fit arguments)
    return {"callbacks": callbacks(), "class_weight": class_weight}


FLAGS = ["--callbacks=imbalanced:callbacks",
         "--class_weight=" + json.dumps({str(k): float(v) for k, v in class_weight.items()})]
