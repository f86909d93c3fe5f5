"""--validation_split: a part of the training data held out (the same for a seed, each class
its share), trained on by nobody, evaluated every epoch beside the test set; a tuning
trial evaluates it alone."""
import dataclasses
import json

import numpy as np
import pytest

from tfmulti.data import folder, validation
from tfmulti.errors import DataError
from tfmulti.run.config import RunConfig
from tfmulti.training import train


def test_the_held_out_part_is_stratified_disjoint_and_fixed_by_the_seed():
    labels = np.repeat(np.arange(4, dtype=np.int32), [500, 300, 150, 50])
    np.random.default_rng(0).shuffle(labels)
    kept, held = validation.held_out_indices(labels, 0.1, seed=7)
    assert len(np.intersect1d(kept, held)) == 0 and len(kept) + len(held) == len(labels)
    assert np.bincount(labels[held]).tolist() == [50, 30, 15, 5]  # each class its tenth
    again = validation.held_out_indices(labels, 0.1, seed=7)[1]
    other = validation.held_out_indices(labels, 0.1, seed=8)[1]
    assert np.array_equal(held, again) and not np.array_equal(held, other)


def test_targets_that_are_not_classes_and_named_features_are_split_alike():
    features = {"age": np.arange(200, dtype=np.float32), "words": np.zeros((200, 5), np.int32)}
    targets = (np.arange(200, dtype=np.float32) * 2, np.ones((200, 3), np.float32))
    kept, held = validation.held_out_indices(targets, 0.25, seed=0)
    assert len(held) == 50
    part = validation.take(features, held), validation.take(targets, held)
    assert np.array_equal(part[0]["age"] * 2, part[1][0]) and part[0]["words"].shape == (50, 5)


def test_a_folder_of_images_is_split_by_its_paths_without_reading_them(tmp_path):
    files = folder.ImageFiles("folder:x", [str(tmp_path / f"{i}.png") for i in range(10)],
                              (8, 8), 1)  # the files do not exist: nothing may read them
    part = validation.take(files, np.array([2, 5]))
    assert isinstance(part, folder.ImageFiles) and part.shape == (2, 8, 8, 1)
    assert [p.rsplit("/", 1)[1] for p in part.paths] == ["2.png", "5.png"]


def test_a_share_that_leaves_no_validation_example_is_one_line(tiny_synthetic):
    few = dataclasses.replace(tiny_synthetic, train_features=tiny_synthetic.train_features[:20],
                              train_targets=tiny_synthetic.train_targets[:20])
    with pytest.raises(DataError, match="--validation_split=0.01 of the 20 training images "
                                        "leaves no validation examples; give a share"):
        validation.split(few, 0.01, 0)


def test_the_main_job_reports_the_validation_part_every_epoch(two_replicas, tiny_synthetic,
                                                             tmp_path, capsys):
    cfg = RunConfig(model="lenet", width=2, epochs=2, per_replica_batch_size=32,
                    validation_split=0.2, seed=3)
    _, history = train.train_and_evaluate(two_replicas, tiny_synthetic, cfg,
                                          model_dir=str(tmp_path), verbose=1)
    held = len(validation.held_out_indices(tiny_synthetic.train_targets, 0.2, 3)[1])
    for record in history:
        assert record["val_examples"] == held and record["test_examples"] == 250
        assert {"val_loss", "val_acc", "test_loss", "test_acc"} <= set(record)
    # what it printed: the part held out, then each epoch's line, the validation figures
    # before the test set's
    printed = capsys.readouterr().out.splitlines()
    assert [line for line in printed if line.startswith("Training lenet on ")][0].split(
        " on [")[0].endswith(f" ({1024 - held} images, {held} held out for validation, "
                             "10 classes)")
    epochs = [line for line in printed if line.startswith("  val acc ")]
    assert epochs == [
        f"  val acc {r['val_acc']:.4f}, val loss {r['val_loss']:.4f} ({held} images); "
        f"test acc {r['test_acc']:.4f}, test loss {r['test_loss']:.4f} (250 images), "
        f"{r['seconds']:.1f} s, {r['images_per_sec']:.0f} images/s, input "
        f"{r['input_wait_share']:.0%}, compute {r['compute_share']:.0%}, all-reduce "
        f"{r['allreduce_share']:.0%}, MFU {r['mfu']:.1%}" for r in history]
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["train_examples"] == 1024 - held and metrics["validation_examples"] == held
    assert (tmp_path / "tensorboard" / "val").is_dir()
    # a tuning trial: the validation part alone, the test set untouched
    _, trial = train.train_and_evaluate(two_replicas, tiny_synthetic, cfg, verbose=0, test=False)
    assert "val_acc" in trial[-1] and not [k for k in trial[-1] if k.startswith("test")]
    assert trial[-1]["val_loss"] == pytest.approx(history[-1]["val_loss"], rel=1e-5)
