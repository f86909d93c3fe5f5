import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from tfmulti.data import pipeline, sources
from tfmulti.errors import UsageError
from tfmulti.models import zoo
from tfmulti.scratch import lesson
from tfmulti.training import engine, optim

DEVICES = ["/CPU:0", "/CPU:1", "/CPU:2", "/CPU:3"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def on(device, tensor):
    return tensor.device.endswith(device.lstrip("/").replace("CPU", "device:CPU"))


@pytest.mark.parametrize("kind", ["naive", "ring"])
@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("shape", [(5, 3), (1,), (7,), (3, 3, 1, 4)])
def test_allreduce_sums_onto_every_device(kind, k, shape):
    rng = np.random.default_rng(k)
    values = [rng.normal(size=shape).astype(np.float32) for _ in range(k)]
    data_ = [lesson.copy_to(tf.constant(v), d) for v, d in zip(values, DEVICES[:k])]
    out = lesson.ALLREDUCE[kind](data_, DEVICES[:k])
    assert len(out) == k
    for device, tensor in zip(DEVICES, out):
        assert on(device, tensor), tensor.device
        assert tensor.shape == shape
        np.testing.assert_allclose(tensor.numpy(), np.sum(values, axis=0), rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(tensor.numpy(), out[0].numpy())  # the same bits


def test_book_allreduce_example():
    """The book: [[1, 1]] on gpu(0) and [[2, 2]] on gpu(1) become [[3, 3]] on both."""
    data_ = [lesson.copy_to(tf.ones((1, 2)) * (i + 1), DEVICES[i]) for i in range(2)]
    for kind in ("naive", "ring"):
        assert [t.numpy().tolist() for t in lesson.ALLREDUCE[kind](data_, DEVICES[:2])] == [
            [[3.0, 3.0]], [[3.0, 3.0]]]


def test_split_batch_with_a_remainder():
    X, y = tf.reshape(tf.range(20.0), (10, 2)), tf.range(10)
    X_shards, y_shards = lesson.split_batch(X, y, DEVICES[:3])
    assert [len(s) for s in y_shards] == [4, 3, 3]
    assert tf.concat(y_shards, 0).numpy().tolist() == list(range(10))
    assert all(on(d, s) for d, s in zip(DEVICES, X_shards))


def test_get_params_copies_to_the_device():
    params = lesson.init_params(width=4, seed=0)
    copy = lesson.get_params(params, "/CPU:1")
    assert all(on("/CPU:1", v) for v in copy)
    for a, b in zip(params, copy):
        np.testing.assert_array_equal(a, b.numpy())


def batch(n, seed=0):
    ds = sources.load("synthetic", synthetic_train_size=n, synthetic_test_size=10, seed=seed)
    return (tf.constant(ds.train_features[..., None] / 255.0, tf.float32),
            tf.constant(ds.train_targets))


def step_on(devices, X, y, params, kind, lr=0.1):
    device_params = [lesson.get_params(params, d) for d in devices]
    lesson.train_batch(X, y, device_params, devices, lr, lesson.ALLREDUCE[kind])
    return device_params


@pytest.mark.parametrize("global_batch", [12, 10])  # 10 leaves remainders on 3 and 4 devices
def test_k_devices_take_the_single_device_step(global_batch):
    X, y = batch(global_batch)
    params = lesson.init_params(width=4, seed=0)
    reference = [v.numpy() for v in step_on(DEVICES[:1], X, y, params, "naive")[0]]
    assert not np.allclose(reference[0], params[0])
    results = {}
    for kind in ("naive", "ring"):
        for k in (1, 2, 3, 4):
            device_params = step_on(DEVICES[:k], X, y, params, kind)
            for copy in device_params[1:]:  # every device holds bit-identical parameters
                for a, b in zip(device_params[0], copy):
                    np.testing.assert_array_equal(a.numpy(), b.numpy())
            for a, b in zip(device_params[0], reference):
                np.testing.assert_allclose(a.numpy(), b, rtol=1e-5, atol=1e-7)
            results[kind, k] = [v.numpy() for v in device_params[0]]
    for k in (2, 3, 4):  # ring and naive agree
        for a, b in zip(results["naive", k], results["ring", k]):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_gradient_equals_mirrored_strategys(two_replicas):
    """The scratch step and the main job's engine (MirroredStrategy) move the same weights."""
    lr, global_batch = 0.1, 32
    ds = sources.load("synthetic", synthetic_train_size=256, synthetic_test_size=10, seed=4)
    eng = engine.Engine(two_replicas, lambda: zoo.lenet(width=4, seed=0), optim.constant(lr),
                        global_batch)
    start = [w.copy() for w in eng.model.get_weights()]
    fn = pipeline.train_input_fn(ds.train_features, ds.train_targets, global_batch // 2, seed=0)
    list(eng.train_steps(iter(eng.distribute(fn)), 1))
    X, y = next(iter(pipeline.train_input_fn(ds.train_features, ds.train_targets, global_batch,
                                         seed=0)(tf.distribute.InputContext())))
    device_params = step_on(DEVICES[:2], X, y, start, "ring", lr)
    for before, mirrored, own in zip(start, eng.model.get_weights(), device_params[0]):
        np.testing.assert_allclose((before - own.numpy()) / lr, (before - mirrored) / lr,
                                   rtol=1e-4, atol=1e-6)


def test_a_short_run_learns_and_reports(tmp_path):
    ds = sources.load("synthetic", synthetic_train_size=1024, synthetic_test_size=500, seed=1)
    line, history, device_params = lesson.train(
        ds, DEVICES[:2], 32, 0.3, 4, allreduce="ring", model_dir=str(tmp_path), verbose=0)
    assert history[-1]["test_acc"] > 0.5  # chance is 0.1
    assert history[-1]["test_examples"] == 500
    assert "sec/epoch on [CPU:0, CPU:1]" in line and "not Fashion-MNIST" in line
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["allreduce"] == "ring" and metrics["summary"] == line
    assert (tmp_path / "accuracy.png").exists()
    for a, b in zip(*device_params):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_a_run_past_20_epochs_reports_to_an_object_store():
    """Past the old 20-epoch limit of the plot, on TensorFlow's in-memory file system (which,
    like gs://, has no local path): every report file lands there."""
    import tensorflow as tf

    ds = sources.load("synthetic", synthetic_train_size=64, synthetic_test_size=16, seed=1)
    _, history, _ = lesson.train(ds, DEVICES[:2], 32, 0.1, 21, width=2,
                                  model_dir="ram://scratch-run", verbose=0)
    assert len(history) == 21
    metrics = json.loads(tf.io.gfile.GFile("ram://scratch-run/metrics.json").read())
    assert [r["epoch"] for r in metrics["epochs"]] == list(range(1, 22))
    assert tf.io.gfile.GFile("ram://scratch-run/accuracy.png", "rb").read(4) == b"\x89PNG"
    assert tf.io.gfile.listdir("ram://scratch-run/tensorboard")
    assert not os.path.exists("ram:")


def test_batch_smaller_than_device_count():
    ds = sources.load("synthetic", synthetic_train_size=64, synthetic_test_size=10)
    with pytest.raises(UsageError, match="leaves devices without examples"):
        lesson.train(ds, DEVICES[:3], 2, 0.1, 1, verbose=0)


def run_scratch(*args):
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    return subprocess.run([sys.executable, "-m", "tfmulti.scratch", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.soak  # make soak: the real command (make test: such a run in this process, above)
def test_command_line(tmp_path):
    """The real command on the smoke flagfile (a smaller data set: the batch and rate the
    flagfile gives do not depend on it)."""
    result = run_scratch("--flagfile=flags/scratch_smoke.cfg", "--synthetic_train_size=512",
                         "--synthetic_test_size=64", f"--model_dir={tmp_path}/run")
    assert result.returncode == 0, result.stderr
    assert "naive allreduce" in result.stdout
    line = [printed for printed in result.stdout.splitlines() if printed.startswith("test acc: ")]
    assert len(line) == 1 and "on [CPU:0, CPU:1]" in line[0]
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["global_batch_size"] == 64 and metrics["learning_rate"] == pytest.approx(0.05)
