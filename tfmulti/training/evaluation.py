"""A finished run's model on a data set: loss, accuracy, per-class accuracy and the confusion
matrix (python -m tfmulti.evaluate)."""
import io

import numpy as np

from tfmulti.distribution import storage

BATCH = 256


def evaluate(model, dataset):
    """{loss, accuracy, per_class, confusion} of a Keras model (logits or probabilities out)
    on the data set's test split, images fed as in training (uint8 scaled to [0, 1], a
    channel added)."""
    import tensorflow as tf

    from tfmulti.data.pipeline import to_model_input

    logits = np.concatenate([
        model(to_model_input(tf.constant(dataset.test_images[i:i + BATCH])),
              training=False).numpy().astype(np.float32)
        for i in range(0, len(dataset.test_images), BATCH)])
    labels = dataset.test_labels
    from tfmulti.training import compiled

    # The loss the run trained with: the model's compiled one, or cross-entropy on logits
    loss = compiled.per_example_loss(model)
    losses = np.concatenate([loss(tf.constant(labels[i:i + BATCH]),
                                  tf.constant(logits[i:i + BATCH])).numpy()
                             for i in range(0, len(labels), BATCH)])
    predicted = logits.argmax(axis=1)
    k = dataset.num_classes
    confusion = np.zeros((k, k), np.int64)
    np.add.at(confusion, (labels, predicted), 1)
    counts = confusion.sum(axis=1)
    return {
        "loss": float(losses.mean()),
        "accuracy": float((predicted == labels).mean()),
        "examples": int(len(labels)),
        "per_class": {name: (float(confusion[i, i] / counts[i]) if counts[i] else None)
                      for i, name in enumerate(dataset.class_names)},
        "confusion": confusion.tolist(),  # rows: true class, columns: predicted
    }


def plot_confusion(result, class_names, path, title):
    """The confusion matrix as a PNG at path (rows true, columns predicted, shares of the
    row), written with storage (any file system TensorFlow knows)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    confusion = np.array(result["confusion"], np.float64)
    shares = confusion / np.maximum(confusion.sum(axis=1, keepdims=True), 1)
    k = len(class_names)
    side = min(12, 3 + 0.45 * k)
    fig, ax = plt.subplots(figsize=(side + 1, side))
    image = ax.imshow(shares, cmap="Blues", vmin=0, vmax=1)
    ax.set_xticks(range(k), class_names, rotation=60, ha="right", fontsize=8)
    ax.set_yticks(range(k), class_names, fontsize=8)
    ax.set(xlabel="predicted", ylabel="true class")
    if k <= 20:
        for i in range(k):
            for j in range(k):
                if confusion[i, j]:
                    ax.text(j, i, int(confusion[i, j]), ha="center", va="center", fontsize=7,
                            color="white" if shares[i, j] > 0.5 else "black")
    ax.set_title(title, fontsize=9)
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04, label="share of the true class")
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=100)
    plt.close(fig)
    storage.write_bytes(path, png.getvalue())
