"""What a run leaves behind: the book's console line, metrics.json, an accuracy plot (PNG),
TensorBoard scalars and the trained model. Every one names the data set."""
from __future__ import annotations

import io
import platform

from tfmulti.distribution import allocator, storage
from tfmulti.rundir.names import METRICS_FILE, PLOT_FILE, TENSORBOARD_DIR


def versions() -> dict[str, str]:
    import keras
    import numpy
    import tensorflow as tf

    return {"python": platform.python_version(), "tensorflow": tf.__version__,
            "keras": keras.__version__, "numpy": numpy.__version__,
            "malloc": allocator.loaded_malloc()}


def epochs_trained(record):
    """The share of an epoch its record trained: 1, or less for an epoch a resumed run began
    mid-way (metrics.json marks it with resumed_at_step)."""
    if "resumed_at_step" not in record:
        return 1.0
    per_epoch = record["step"] / record["epoch"]
    return (record["step"] - record["resumed_at_step"] + 1) / per_epoch


def book_line(history, devices, dataset_name):
    """`test acc: 0.93, 7.3 sec/epoch on [GPU:0, GPU:1]` as the book prints it, plus images/s
    and the data set. sec/epoch is the training time over the epochs trained, like the book's
    timer (epoch 1 also traces and compiles the step functions), a resumed run's partial
    epoch counted as the part it trained; images/s is over all training time."""
    seconds = sum(r["seconds"] for r in history)
    images = sum(r["images_per_sec"] * r["seconds"] for r in history)
    per_epoch = seconds / sum(epochs_trained(r) for r in history)
    return (f"test acc: {history[-1]['test_acc']:.2f}, {per_epoch:.1f} sec/epoch "
            f"on [{', '.join(devices)}], {images / seconds:.0f} images/s, {dataset_name}")


def read_history(model_dir):
    """The epoch records of an earlier run's metrics.json ([] if there is none)."""
    path = storage.join(model_dir, METRICS_FILE)
    try:
        return storage.read_json(path).get("epochs", []) if storage.exists(path) else []
    except (OSError, ValueError, AttributeError):
        return []


MARKED_EPOCHS = 30  # up to this many epochs each one gets a marker; beyond, a plain line


def plot_accuracy(history, path, title):
    """Test (and train) accuracy by epoch, like the book's animator; PNG bytes written to
    `path` (any file system TensorFlow knows) and returned. Any number of epochs: whole-epoch
    ticks, at most about ten of them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    epochs = [r["epoch"] for r in history]
    style = "o-" if len(epochs) <= MARKED_EPOCHS else "-"
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(epochs, [r["test_acc"] for r in history], style, label="test acc")
    ax.plot(epochs, [r["train_acc"] for r in history], "--", color="gray", label="train acc")
    ax.set(xlabel="epoch", ylabel="accuracy", ylim=(0, 1),
           xlim=(min(epochs) - 0.5, max(epochs) + 0.5))
    ax.xaxis.set_major_locator(MaxNLocator(nbins=10, integer=True, min_n_ticks=1))
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=100)
    plt.close(fig)
    storage.write_bytes(path, png.getvalue())
    return png.getvalue()


class RunReport:
    """Collects epoch records and keeps model_dir's files current after every epoch."""

    def __init__(self, model_dir, run_info, write_files=True, history=()):
        self.model_dir, self.run_info, self.write_files = model_dir, dict(run_info), write_files
        self.history = list(history)  # a resumed run's earlier epochs
        self._writer = None
        if write_files:
            import tensorflow as tf

            storage.makedirs(model_dir)
            self._writer = tf.summary.create_file_writer(storage.join(model_dir, TENSORBOARD_DIR))

    def path(self, name):
        return storage.join(self.model_dir, name)

    def on_epoch_end(self, record):
        self.history.append(record)
        if not self.write_files:
            return
        import tensorflow as tf

        with self._writer.as_default(step=record["epoch"]):
            for key in ("loss", "train_acc", "test_loss", "test_acc", "images_per_sec",
                        "learning_rate"):
                tf.summary.scalar(key, record[key])
        self._writer.flush()
        storage.write_json(self.path(METRICS_FILE), {**self.run_info, "epochs": self.history})
        plot_accuracy(self.history, self.path(PLOT_FILE),
                      f"{self.run_info['model']} on [{', '.join(self.run_info['devices'])}]\n"
                      f"{self.run_info['dataset']}")

    def finish(self, model=None, fingerprints=()):
        """Saves the model (a Keras one) for people without tfmulti (export.py: model.keras,
        saved_model/, class_names.txt); returns the book's line (also in metrics.json).
        fingerprints: each worker's weights fingerprint (train.every_workers_fingerprint),
        metrics.json's weights_fingerprints."""
        line = book_line(self.history, self.run_info["devices"], self.run_info["dataset"])
        if self.write_files:
            if model is not None:
                from tfmulti.training import export

                info = self.run_info
                skipped = export.write(model, self.model_dir, info["class_names"],
                                       info["image_shape"], info["image_dtype"])
                if skipped:
                    print(skipped)
            storage.write_json(self.path(METRICS_FILE),
                               {**self.run_info, "epochs": self.history, "summary": line,
                                "weights_fingerprints": list(fingerprints)})
        return line
