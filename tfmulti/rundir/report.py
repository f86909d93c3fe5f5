"""What a run leaves behind: the book's console line, metrics.json, an accuracy plot (PNG),
TensorBoard scalars and the trained model. Every one names the data set."""
from __future__ import annotations

import io
import math
import platform
import time
from typing import Any

import keras
import numpy
import numpy as np
import tensorflow as tf

from tfmulti.distribution import allocator, storage
from tfmulti.models.task import ACCURACY, record_key
from tfmulti.rundir import export
from tfmulti.rundir.names import METRICS_FILE, PLOT_FILE, TENSORBOARD_DIR


def versions() -> dict[str, str]:
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


def book_line(history, devices, dataset_name, metric="accuracy", examples="images"):
    """`test acc: 0.93, 7.3 sec/epoch on [GPU:0, GPU:1]` as the book prints it, plus images/s
    and the data set. sec/epoch is the training time over the epochs trained, like the book's
    timer (epoch 1 also traces and compiles the step functions), a resumed run's partial
    epoch counted as the part it trained; images/s is over all training time. metric: the
    one the line shows (the run's primary metric: accuracy, your first, or loss); examples:
    what it counts. A tuning trial, evaluated on its validation part alone, shows that."""
    seconds = sum(r["seconds"] for r in history)
    images = sum(r["images_per_sec"] * r["seconds"] for r in history)
    per_epoch = seconds / sum(epochs_trained(r) for r in history)
    part = evaluated_part(history[-1])
    value = history[-1]["loss" if (part, metric) == ("train", "loss") else
                        record_key(part, metric)]
    figure = (f"{part} acc: {value:.2f}" if metric == ACCURACY else
              f"{part} {metric}: {value:.4g}")
    # model FLOPs utilization over all training time: each epoch's weighed by its seconds
    mfu = (f"MFU {sum(r['mfu'] * r['seconds'] for r in history) / seconds:.1%}, "
           if all("mfu" in r for r in history) else "")
    return (f"{figure}, {per_epoch:.1f} sec/epoch "
            f"on [{', '.join(devices)}], {images / seconds:.0f} {examples}/s, {mfu}"
            f"{dataset_name}")


def evaluated_part(record):
    """The part an epoch record's figures are of: "test", "val" (a tuning trial's), or
    "train" when nothing was evaluated (data without a test part)."""
    parts = {key.split("_", 1)[0] for key in record if "_" in key}
    if "test" in parts:
        return "test"
    return "val" if "val" in parts else "train"


def primary_metric(record: dict[str, Any], preferred: str) -> str:
    """The metric the book's line shows for an epoch record: `preferred` when the record's
    evaluation has it, else its first figure (a model's own test_step logs its own), else
    loss."""
    part = evaluated_part(record)
    if part == "train":  # nothing evaluated (no test part): the training logs'
        named = [key[len("train_"):] for key in record if key.startswith("train_")]
        if record_key(part, preferred) in record:
            return preferred
        logged_loss = not math.isnan(record.get("loss", math.nan))  # a GAN logs none
        return "loss" if logged_loss or not named else named[0]
    if record_key(part, preferred) in record:
        return preferred
    named = [key[len(part) + 1:] for key in record if key.startswith(f"{part}_")
             and key not in (f"{part}_examples", f"{part}_loss")]
    if named:
        return ACCURACY if named[0] == "acc" else named[0]
    return "loss"


def read_history(model_dir: str) -> list[dict[str, Any]]:
    """The epoch records of an earlier run's metrics.json ([] if there is none)."""
    path = storage.join(model_dir, METRICS_FILE)
    try:
        return storage.read_json(path).get("epochs", []) if storage.exists(path) else []
    except (OSError, ValueError, AttributeError):
        return []


# TensorBoard: one folder per part, the same tags in each, so that TensorBoard draws train,
# validation and test of a quantity in one chart (as Keras's callback does); epoch_* by
# epoch, batch_* (train only) by global step.
TENSORBOARD_PARTS = ("train", "val", "test")
EVALUATED = ("val", "test")  # an epoch record's evaluations: part_loss, part_<metric>

# accuracy.png is drawn after an epoch when it was last drawn (or the run started) this long
# ago, and at the end: drawing it costs a few tenths of a second, a cost per epoch for short
# epochs (a run shorter than this draws it once, at its end).
REDRAW_SECONDS = 30.0

MARKED_EPOCHS = 30  # up to this many epochs each one gets a marker; beyond, a plain line


def plot_accuracy(history, path, title, metric=ACCURACY):
    """The run's picture (draw_run), as PNG bytes written to `path` (any file system
    TensorFlow knows) and returned."""
    import matplotlib.pyplot as plt

    fig = draw_run(history, title, metric)
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=100)
    plt.close(fig)
    storage.write_bytes(path, png.getvalue())
    return png.getvalue()


def draw_run(history, title, metric=ACCURACY):
    """A figure of three panels by epoch, like the book's animator: accuracy (or the run's
    primary metric; none for a loss-only model) and loss (train dashed, test solid) and the
    learning rate at each epoch's end (tfmulti's warm-up and schedule). One legend, below
    the panels, clear of every point. Any number of epochs: whole-epoch ticks, at most about
    ten of them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    epochs = [r["epoch"] for r in history]
    style = "o-" if len(epochs) <= MARKED_EPOCHS else "-"
    panels = 3 if metric != "loss" else 2
    fig, axes = plt.subplots(1, panels, figsize=(11 if panels == 3 else 7.6, 3.6))
    loss, rate = axes[-2:]
    parts = [(part, colour) for part, colour in zip(EVALUATED, ("C1", "C0"))
             if f"{part}_loss" in history[-1]]
    for part, colour in parts:
        loss.plot(epochs, [r.get(f"{part}_loss") for r in history], style, color=colour,
                  label=part)
    loss.plot(epochs, [r["loss"] for r in history], "--", color="gray", label="train")
    loss.set(ylabel="loss", ylim=(0, None) if min(r["loss"] for r in history) >= 0 else None)
    if panels == 3:
        acc = axes[0]
        for part, colour in parts:
            acc.plot(epochs, [r.get(record_key(part, metric)) for r in history], style,
                     color=colour)
        acc.plot(epochs, [r[record_key("train", metric)] for r in history], "--", color="gray")
        acc.set(ylabel=metric, **({"ylim": (0, 1)} if metric == ACCURACY else {}))
    rate.plot(epochs, [r["learning_rate"] for r in history], style, color="C2")
    rate.set(ylabel="learning rate (epoch end)", ylim=(0, None))
    for ax in axes:
        ax.set(xlabel="epoch", xlim=(min(epochs) - 0.5, max(epochs) + 0.5))
        ax.xaxis.set_major_locator(MaxNLocator(nbins=10, integer=True, min_n_ticks=1))
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0.08, 1, 1))  # the bottom strip is the legend's
    fig.legend(*loss.get_legend_handles_labels(), loc="lower center", ncol=len(parts) + 1,
               frameon=False)
    return fig


class RunReport:
    """Collects epoch records and keeps model_dir's files current after every epoch."""

    def __init__(self, model_dir, run_info, write_files=True, history=(),
                 serving_features=None, draw=True):
        """serving_features: the serving signature's input of a model that is not an image
        classifier (export.input_signature); None for an image classifier. draw False:
        no accuracy.png (a tuning trial's run: the session draws every trial)."""
        self.model_dir, self.run_info, self.write_files = model_dir, dict(run_info), write_files
        self.draw = draw
        self.serving_features = serving_features
        self.history = list(history)  # a resumed run's earlier epochs
        self._writers, self._steps, self._series = {}, [], None
        self._drawn = time.monotonic()  # when accuracy.png was last drawn, or the run began
        if write_files:
            storage.makedirs(model_dir)
            self._writers = {part: tf.summary.create_file_writer(
                storage.join(model_dir, TENSORBOARD_DIR, part)) for part in TENSORBOARD_PARTS
                if part != "val" or run_info.get("validation_examples")}

    def path(self, name):
        return storage.join(self.model_dir, name)

    def on_steps(self, step, loss, learning_rate):
        """After each training call: its steps' mean loss and the rate, by global step (kept
        here, written to TensorBoard at the epoch's end in one call: a summary op per call
        cost a small model's step half its time)."""
        if self._writers:
            self._steps.append((step, loss, learning_rate))

    def _write_steps(self):
        if not self._steps:
            return
        if self._series is None:
            from tensorboard.plugins.scalar import metadata

            scalar = metadata.create_summary_metadata(display_name=None, description=None)
            spec = [tf.TensorSpec([None], tf.int64)] + [tf.TensorSpec([None], tf.float32)] * 2

            @tf.function(input_signature=spec, autograph=False)
            def series(steps, losses, rates):  # tags as given (scalar() would add "while/")
                def write(i):
                    with tf.control_dependencies([
                            tf.summary.write("batch_loss", losses[i], steps[i], metadata=scalar),
                            tf.summary.write("batch_learning_rate", rates[i], steps[i],
                                             metadata=scalar)]):
                        return i + 1

                tf.while_loop(lambda i: i < tf.shape(steps)[0], write, [tf.constant(0)])

            self._series = series
        steps, losses, rates = zip(*self._steps)
        with self._writers["train"].as_default():
            self._series(np.array(steps, np.int64), np.array(losses, np.float32),
                         np.array(rates, np.float32))
        self._steps = []

    def on_epoch_end(self, record):
        self.history.append(record)
        if not self.write_files:
            return
        epoch = record["epoch"]
        self._write_steps()
        names = self.run_info.get("metrics", [ACCURACY])
        self._scalars("train", epoch, {
            "epoch_loss": record["loss"],
            **{f"epoch_{n}": record[record_key("train", n)] for n in names
               if record_key("train", n) in record},
            "epoch_learning_rate": record["learning_rate"],
            "epoch_images_per_sec": record["images_per_sec"],
            **{f"epoch_{kind}_share": record.get(f"{kind}_share", 0.0)
               for kind in ("input_wait", "compute", "allreduce")},
            **({"epoch_mfu": record["mfu"]} if "mfu" in record else {}),
            # several workers: each one's seconds computing (a straggler stands out)
            **{f"epoch_worker_{i}_compute_seconds": seconds
               for i, seconds in enumerate(record.get("worker_compute_seconds", ()))}})
        for part in EVALUATED:
            if f"{part}_loss" in record and part in self._writers:
                self._scalars(part, epoch, {
                    "epoch_loss": record[f"{part}_loss"],
                    **{f"epoch_{n}": record[record_key(part, n)] for n in names
                       if record_key(part, n) in record}})
        for writer in self._writers.values():
            writer.flush()
        storage.write_json(self.path(METRICS_FILE), {**self.run_info, "epochs": self.history})
        if self.draw and time.monotonic() - self._drawn >= REDRAW_SECONDS:
            self._draw()

    def _draw(self):
        plot_accuracy(self.history, self.path(PLOT_FILE),
                      f"{self.run_info['model']} on [{', '.join(self.run_info['devices'])}]\n"
                      f"{self.run_info['dataset']}", self.run_info.get("primary_metric", ACCURACY))
        self._drawn = time.monotonic()

    def _scalars(self, part, step, values):
        with self._writers[part].as_default(step=step):
            for tag, value in values.items():
                tf.summary.scalar(tag, value)

    def finish(self, model=None, fingerprints=()):
        """Saves the model (a Keras one) for people without tfmulti (export.py: model.keras,
        saved_model/, class_names.txt); returns the book's line (also in metrics.json).
        fingerprints: each worker's weights fingerprint (workers.every_workers_fingerprint),
        metrics.json's weights_fingerprints."""
        info = self.run_info
        line = book_line(self.history, info["devices"], info["dataset"],
                         info.get("primary_metric", ACCURACY), info.get("examples_word", "images"))
        if self.write_files:
            if self.history and self.draw:
                self._draw()
            if model is not None:
                skipped = export.write(model, self.model_dir, info["class_names"],
                                       info["image_shape"], info["image_dtype"],
                                       self.serving_features, info.get("outputs", ()))
                if skipped:
                    print(skipped)
            storage.write_json(self.path(METRICS_FILE),
                               {**self.run_info, "epochs": self.history, "summary": line,
                                "weights_fingerprints": list(fingerprints)})
        return line
