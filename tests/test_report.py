"""Reports at real lengths: 1 to 500 epochs, steps in the hundreds of thousands.

Runs longer than 20 epochs once died at epoch 21 in the plot; these tests cross that limit
on fake histories, and one real run resumes across it.
"""
import dataclasses
import io
import json
import os

import numpy as np
import pytest
import tensorflow as tf

from tfmulti.data import sources
from tfmulti.distribution import storage
from tfmulti.models import zoo
from tfmulti.run.config import RunConfig
from tfmulti.rundir import lifecycle, names, report
from tfmulti.training import engine, optim, train

DATASET_NAME = "synthetic Fashion-like data (not Fashion-MNIST)"


def history(epochs, steps_per_epoch=5000):
    """A made-up run of `epochs` epochs (accuracy climbing, steps far past 100,000)."""
    rng = np.random.default_rng(epochs)
    return [{"epoch": e, "step": e * steps_per_epoch, "loss": 2.0 / e,
             "train_acc": min(0.99, 0.1 + e / (epochs + 1)), "test_loss": 2.1 / e,
             "test_acc": float(min(0.95, 0.1 + e / (epochs + 2) + rng.normal(0, 0.01))),
             "test_examples": 10000, "seconds": 7.0 + rng.random(), "eval_seconds": 0.5,
             "images_per_sec": 900.0 + rng.random(), "learning_rate": 0.1}
            for e in range(1, epochs + 1)]


@pytest.mark.parametrize("epochs", [1, 2, 20, 21, 30, 31, 60, 90, 500])
def test_the_plot_takes_any_number_of_epochs(tmp_path, epochs):
    import matplotlib.image

    path = str(tmp_path / "accuracy.png")
    png = report.plot_accuracy(history(epochs), path, "resnet18 on [CPU:0, CPU:1]\nsynthetic")
    with open(path, "rb") as f:
        assert f.read() == png
    image = matplotlib.image.imread(io.BytesIO(png), format="png")
    assert image.shape[:2] == (360, 1100)


@pytest.mark.parametrize("epochs", [1, 20, 21, 500])
def test_the_plot_ticks_are_whole_epochs_and_few(epochs):
    fig = report.draw_run(history(epochs), "title")
    for ax in fig.axes:
        low, high = ax.get_xlim()
        ticks = [t for t in ax.get_xticks() if low <= t <= high]
        assert 1 <= len(ticks) <= 12
        assert all(float(t).is_integer() and 1 <= t <= epochs for t in ticks), ticks


@pytest.mark.parametrize("epochs", [1, 7, 60])
def test_the_plot_shows_accuracy_loss_and_the_rate_with_the_legend_clear_of_them(epochs):
    """What the picture shows, read from the figure as drawn: train and test accuracy and
    loss, the learning rate (a warm-up over 3 epochs, then a decay), and a legend whose box
    lies outside every panel, so it covers no point."""
    records = history(epochs)
    for r in records:  # warm-up, then a step down at two thirds
        r["learning_rate"] = 0.4 * min(1.0, r["epoch"] / 3) * (0.1 if r["epoch"] > 40 else 1)
    fig = report.draw_run(records, "resnet18 on [CPU:0, CPU:1]\nsynthetic")
    fig.canvas.draw()
    acc, loss, rate = fig.axes
    assert [ax.get_ylabel() for ax in fig.axes] == ["accuracy", "loss",
                                                   "learning rate (epoch end)"]

    def shown(ax):
        return sorted(tuple(np.round(line.get_ydata(), 6)) for line in ax.get_lines())

    assert shown(acc) == sorted([tuple(np.round([r[k] for r in records], 6))
                                 for k in ("test_acc", "train_acc")])
    assert shown(loss) == sorted([tuple(np.round([r[k] for r in records], 6))
                                  for k in ("test_loss", "loss")])
    assert shown(rate) == [tuple(np.round([r["learning_rate"] for r in records], 6))]
    legend = fig.legends[0]
    assert [t.get_text() for t in legend.get_texts()] == ["test", "train"]
    box = legend.get_window_extent()
    for ax in fig.axes:
        assert not box.overlaps(ax.get_window_extent()), ax.get_ylabel()
    assert not acc.get_legend() and not loss.get_legend() and not rate.get_legend()
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_the_book_line_over_500_epochs():
    records = history(500)
    line = report.book_line(records, ["GPU:0", "GPU:1"], DATASET_NAME)
    seconds = np.mean([r["seconds"] for r in records])
    assert line.startswith(f"test acc: {records[-1]['test_acc']:.2f}, {seconds:.1f} sec/epoch "
                           "on [GPU:0, GPU:1], ")
    assert line.endswith(f" images/s, {DATASET_NAME}")


def test_a_resumed_runs_partial_epoch_counts_as_the_part_it_trained():
    """sec/epoch: the training time over the epochs trained; an epoch a resumed run began at
    step 31 of 40 (resumed_at_step 71 in epoch 2) is a quarter of an epoch, not a whole."""
    records = [{"epoch": 1, "step": 40, "seconds": 8.0, "images_per_sec": 100.0, "test_acc": 0.5},
               {"epoch": 2, "step": 80, "seconds": 2.0, "images_per_sec": 100.0, "test_acc": 0.6,
                "resumed_at_step": 71},
               {"epoch": 3, "step": 120, "seconds": 8.0, "images_per_sec": 100.0,
                "test_acc": 0.7}]
    assert report.epochs_trained(records[1]) == 0.25
    line = report.book_line(records, ["CPU:0"], DATASET_NAME)
    assert line.startswith("test acc: 0.70, 8.0 sec/epoch on [CPU:0], 100 images/s")  # not 6.0


def test_a_500_epoch_report_in_every_file(tmp_path):
    """metrics.json, the plot and TensorBoard hold every one of 500 epochs (steps up to
    2,500,000), written through the report as a run writes them."""
    model_dir = str(tmp_path / "run")
    run = report.RunReport(model_dir, {"model": "resnet18", "devices": ["CPU:0"],
                                       "dataset": DATASET_NAME}, history=history(499))
    run.on_epoch_end(history(500)[-1])
    line = run.finish()
    metrics = json.loads((tmp_path / "run" / names.METRICS_FILE).read_text())
    assert [r["epoch"] for r in metrics["epochs"]] == list(range(1, 501))
    assert metrics["epochs"][-1]["step"] == 2_500_000 and metrics["summary"] == line
    assert (tmp_path / "run" / names.PLOT_FILE).read_bytes()[:4] == b"\x89PNG"
    assert scalars(model_dir, "test", "epoch_accuracy") == [(500, pytest.approx(
        history(500)[-1]["test_acc"]))]  # the earlier 499 came from "history" (metrics.json)


def scalars(model_dir, part, tag):
    """(step, value) of every `tag` scalar in TensorBoard's `part` folder of a run."""
    events = tf.io.gfile.glob(os.path.join(model_dir, names.TENSORBOARD_DIR, part, "events.*"))
    return [(e.step, float(tf.make_ndarray(v.tensor)))
            for path in events for e in tf.compat.v1.train.summary_iterator(path)
            for v in e.summary.value if v.tag == tag]


def test_tensorboard_overlays_train_and_test_and_has_every_steps_loss_and_rate(tmp_path):
    """train/ and test/ hold the same epoch tags (TensorBoard draws them in one chart); the
    loss and learning rate of every training call are there by global step, train/ only."""
    model_dir = str(tmp_path / "run")
    run = report.RunReport(model_dir, {"model": "lenet", "devices": ["CPU:0"],
                                       "dataset": DATASET_NAME})
    records = history(2, steps_per_epoch=4)
    for step in range(1, 9):
        run.on_steps(step, 3.0 / step, 0.05 * step)
        if step % 4 == 0:
            run.on_epoch_end(records[step // 4 - 1])
    for tag, trained, tested in (("epoch_loss", "loss", "test_loss"),
                                 ("epoch_accuracy", "train_acc", "test_acc")):
        assert scalars(model_dir, "train", tag) == [
            (r["epoch"], pytest.approx(r[trained])) for r in records]
        assert scalars(model_dir, "test", tag) == [
            (r["epoch"], pytest.approx(r[tested])) for r in records]
    assert scalars(model_dir, "train", "batch_loss") == [
        (s, pytest.approx(3.0 / s)) for s in range(1, 9)]
    assert scalars(model_dir, "train", "batch_learning_rate") == [
        (s, pytest.approx(0.05 * s)) for s in range(1, 9)]
    assert scalars(model_dir, "test", "batch_loss") == []


def test_tensorboard_has_each_workers_compute_time(tmp_path):
    model_dir = str(tmp_path / "run")
    run = report.RunReport(model_dir, {"model": "lenet", "devices": ["CPU:0"],
                                       "dataset": DATASET_NAME})
    records = [{**r, "worker_compute_seconds": [1.0 * r["epoch"], 3.0 * r["epoch"]]}
               for r in history(2, steps_per_epoch=4)]
    for record in records:
        run.on_epoch_end(record)
    for worker, factor in ((0, 1.0), (1, 3.0)):
        assert scalars(model_dir, "train", f"epoch_worker_{worker}_compute_seconds") == [
            (1, factor), (2, 2 * factor)]
    assert scalars(model_dir, "train", "epoch_worker_2_compute_seconds") == []


def test_checkpoint_numbers_and_rotation_at_hundreds_of_thousands_of_steps(one_replica):
    """Checkpoints named by step keep their order and rotation far past any short run."""
    eng = engine.Engine(one_replica, lambda: zoo.lenet(width=2), optim.constant(0.1), 8)
    manager = eng.checkpoint_manager("ram://rotation/checkpoints")
    for step in (99_999, 100_000, 250_000, 999_999, 1_000_000):
        eng.steps_taken.assign(step)  # the engine's step count
        manager.save(checkpoint_number=step)
    assert {int(path.rsplit("-", 1)[1]) for path in manager.checkpoints} == {999_999, 1_000_000}
    again = eng.checkpoint_manager("ram://rotation/checkpoints")
    assert again.latest_checkpoint.endswith("ckpt-1000000")
    eng.steps_taken.assign(0)
    assert lifecycle.saved_checkpoints("ram://rotation/checkpoints") == [
        "ram://rotation/checkpoints/ckpt-999999", "ram://rotation/checkpoints/ckpt-1000000"]
    assert lifecycle.restore_latest(eng, "ram://rotation/checkpoints",
                                    say=lambda *a: None) == 1_000_000


@pytest.mark.soak  # 30 s; the suite keeps the fake histories of 1 to 500 epochs above
def test_a_real_run_resumes_across_the_old_20_epoch_limit(one_replica):
    """19 epochs, then the same run resumed to 22: the plot and metrics.json cover all 22
    (it crashed at epoch 21 before). On TensorFlow's in-memory file system."""
    dataset = sources.load("synthetic", synthetic_train_size=64, synthetic_test_size=32, seed=0)
    model_dir = "ram://long-run"
    cfg = RunConfig(model="lenet", width=2, per_replica_batch_size=32, steps_per_call=2,
                    checkpoint_steps=5, epochs=19)
    lifecycle.prepare_model_dir(model_dir)
    _, first = train.train_and_evaluate(one_replica, dataset, cfg, model_dir=model_dir,
                                        verbose=0)
    assert [r["epoch"] for r in first] == list(range(1, 20))
    _, whole = train.train_and_evaluate(one_replica, dataset, dataclasses.replace(cfg, epochs=22),
                                        model_dir=model_dir, verbose=0)
    assert [r["epoch"] for r in whole] == list(range(1, 23))
    assert [r["step"] for r in whole] == [2 * e for e in range(1, 23)]
    metrics = storage.read_json(f"{model_dir}/{names.METRICS_FILE}")
    assert [r["epoch"] for r in metrics["epochs"]] == list(range(1, 23))
    with tf.io.gfile.GFile(f"{model_dir}/{names.PLOT_FILE}", "rb") as f:
        assert f.read(4) == b"\x89PNG"
    assert tf.io.gfile.exists(f"{model_dir}/{names.MODEL_FILE}")
    assert tf.io.gfile.exists(f"{model_dir}/{lifecycle.RUN_FILE}")
    assert tf.io.gfile.listdir(f"{model_dir}/{names.TENSORBOARD_DIR}")
    assert "ckpt-44.index" in tf.io.gfile.listdir(f"{model_dir}/{lifecycle.CHECKPOINT_DIR}")
    assert not os.path.exists("ram:")  # nothing went to a local folder named after the URL


def test_precision_recall_f1_and_support_per_class_from_the_confusion_matrix():
    from tfmulti.evaluate import evaluation

    confusion = [[3, 1, 0],  # rows: true class, columns: predicted
                 [0, 2, 0],
                 [0, 0, 0]]  # a class never seen and never predicted
    scores = evaluation.per_class_scores(confusion, ["a", "b", "c"])
    assert scores["a"] == {"precision": 1.0, "recall": 0.75, "f1": pytest.approx(6 / 7),
                           "support": 4}
    assert scores["b"] == {"precision": 2 / 3, "recall": 1.0, "f1": pytest.approx(0.8),
                           "support": 2}
    assert scores["c"] == {"precision": None, "recall": None, "f1": None, "support": 0}


def test_the_plot_is_redrawn_after_redraw_seconds_and_at_the_end(tmp_path, monkeypatch):
    """After an epoch, accuracy.png is drawn only when it was last drawn (or the run began)
    REDRAW_SECONDS ago, and once more at the end: the clock is moved past the limit and
    not."""
    clock = [1000.0]
    monkeypatch.setattr(report.time, "monotonic", lambda: clock[0])
    drawn = []
    monkeypatch.setattr(report, "plot_accuracy",
                        lambda history, path, title, metric: drawn.append(len(history)))
    run = report.RunReport(str(tmp_path / "run"), {"model": "lenet", "devices": ["CPU:0"],
                                                   "dataset": DATASET_NAME})
    records = history(5)
    clock[0] += report.REDRAW_SECONDS - 1
    run.on_epoch_end(records[0])  # within the limit since the start: not drawn
    clock[0] += 1
    run.on_epoch_end(records[1])  # at the limit since the start: drawn
    clock[0] += report.REDRAW_SECONDS - 1
    run.on_epoch_end(records[2])  # within the limit since the last drawing: not
    clock[0] += 1
    run.on_epoch_end(records[3])  # at the limit: drawn
    clock[0] += 0.5
    run.on_epoch_end(records[4])
    assert drawn == [2, 4]
    run.finish()
    assert drawn == [2, 4, 5]  # the end: every epoch
