import gzip
import struct

import numpy as np
import pytest
import tensorflow as tf

from tfmulti.data import idx, pipeline, sources, tfds_sets
from tfmulti.errors import DataError
from tfmulti.run import plan


def write_idx(path, array, magic=None, gz=True, cut=0):
    magic = magic if magic is not None else (0x803 if array.ndim == 3 else 0x801)
    raw = struct.pack(">I", magic) + struct.pack(f">{array.ndim}I", *array.shape)
    raw += array.astype(np.uint8).tobytes()
    raw = raw[:len(raw) - cut]
    opener = gzip.open if gz else open
    with opener(path, "wb") as f:
        f.write(raw)


@pytest.fixture
def idx_dir(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {
        "train_images": rng.integers(0, 256, (50, 28, 28)), "train_labels": rng.integers(0, 10, 50),
        "test_images": rng.integers(0, 256, (20, 28, 28)), "test_labels": rng.integers(0, 10, 20),
    }
    for key, array in arrays.items():
        write_idx(tmp_path / idx.IDX_FILES[key], array)
    return tmp_path, arrays


def test_reads_the_four_idx_files(idx_dir):
    path, arrays = idx_dir
    ds = sources.load("fashion_mnist", data_dir=str(path))
    assert ds.name == "fashion_mnist" and ds.display_name == "Fashion-MNIST"
    assert "IDX files" in ds.source
    np.testing.assert_array_equal(ds.train_features, arrays["train_images"])
    np.testing.assert_array_equal(ds.test_targets, arrays["test_labels"])
    assert ds.train_targets.dtype == np.int32


def test_reads_uncompressed_files(idx_dir):
    path, arrays = idx_dir
    target = path / idx.IDX_FILES["test_labels"]
    target.unlink()
    write_idx(str(target)[:-3], arrays["test_labels"], gz=False)
    np.testing.assert_array_equal(idx.load_idx_dir(str(path)).test_targets, arrays["test_labels"])


def rewrite(path, key, array, **kwargs):
    write_idx(path / idx.IDX_FILES[key], array, **kwargs)
    return str(path / idx.IDX_FILES[key])


@pytest.mark.parametrize("case, words", [
    ("truncated", "truncated: header says 50x28x28"),
    ("wrong_magic", "not an IDX image file"),
    ("count_mismatch", "49 labels for the 50 images"),
    ("label_range", "label 10 out of range"),
    ("corrupt_gzip", "cannot be read, truncated or corrupt"),
    ("wrong_size", "images are 32x32"),
    ("missing", "missing"),
])
def test_bad_idx_files_name_the_file(idx_dir, case, words):
    path, arrays = idx_dir
    images, labels = arrays["train_images"], arrays["train_labels"]
    if case == "truncated":
        bad = rewrite(path, "train_images", images, cut=100)
    elif case == "wrong_magic":
        bad = rewrite(path, "train_images", images, magic=0x801)
    elif case == "count_mismatch":
        bad = rewrite(path, "train_labels", labels[:49])
    elif case == "label_range":
        bad = rewrite(path, "train_labels", np.where(np.arange(50) == 7, 10, labels))
    elif case == "corrupt_gzip":
        bad = str(path / idx.IDX_FILES["train_images"])
        with open(bad, "wb") as f:
            f.write(b"\x1f\x8b\x08\x00not really gzip at all")
    elif case == "wrong_size":
        bad = rewrite(path, "train_images", np.zeros((50, 32, 32)))
    else:
        bad = str(path / idx.IDX_FILES["test_labels"])
        (path / idx.IDX_FILES["test_labels"]).unlink()
    with pytest.raises(DataError) as e:
        sources.load("fashion_mnist", data_dir=str(path))
    assert bad in str(e.value) and words in str(e.value)
    assert "\n" not in str(e.value)


def test_data_dir_must_exist(tmp_path):
    with pytest.raises(DataError, match="is not a directory"):
        sources.load("fashion_mnist", data_dir=str(tmp_path / "nope"))


def test_tfds_path_offline_with_mock_data(tmp_path):
    import tensorflow_datasets as tfds

    with tfds.testing.mock_data(num_examples=30):
        ds = tfds_sets.load_tfds(str(tmp_path), check_network=lambda url: None)
    assert ds.name == "fashion_mnist" and "tensorflow-datasets" in ds.source
    assert ds.train_features.shape == (30, 28, 28) and ds.train_features.dtype == np.uint8
    assert ds.test_features.shape == (30, 28, 28)
    assert ds.train_targets.min() >= 0 and ds.train_targets.max() <= 9


def test_tfds_without_network_says_so_and_names_the_alternatives(tmp_path):
    def unreachable(url):
        tfds_sets.check_download_host("http://fashion-mnist.invalid/", timeout=2)

    with pytest.raises(DataError) as e:
        tfds_sets.load_tfds(str(tmp_path), check_network=unreachable)
    message = str(e.value)
    assert "cannot download Fashion-MNIST" in message and "no network" in message
    assert "--data_dir=DIR" in message and "train-images-idx3-ubyte.gz" in message
    assert "--dataset=synthetic" in message


def test_synthetic_is_named_as_such():
    ds = sources.load("synthetic", synthetic_train_size=20, synthetic_test_size=10, seed=3)
    assert ds.display_name == "synthetic Fashion-like data (not Fashion-MNIST)"
    assert "seed 3" in ds.source


# ---------------------------------------------------------------- pipelines

def collect(strategy, dataset_fn, steps, fields=1):
    """Per step, per replica: the values of the element's first `fields` parts."""
    iterator = iter(strategy.distribute_datasets_from_function(dataset_fn))
    out = []
    for _ in range(steps):
        element = next(iterator)
        out.append([[strategy.experimental_local_results(part)[r].numpy()
                     for part in element[:fields]] for r in range(strategy.num_replicas_in_sync)])
    return out


def indexed_set(n):
    """Images whose pixels and labels are both the example's index."""
    return (np.repeat(np.arange(n, dtype=np.uint8), 28 * 28).reshape(n, 28, 28),
            np.arange(n, dtype=np.int32))


def test_replicas_see_distinct_examples_and_an_epoch_covers_the_set(two_replicas):
    images, labels = indexed_set(64)
    steps = plan.steps_per_epoch(64, 16)
    epochs = collect(two_replicas, pipeline.train_input_fn(images, labels, 8, seed=1), 2 * steps, 2)
    orders = []
    for epoch in (epochs[:steps], epochs[steps:]):
        seen = []
        for step in epoch:
            (x0, y0), (x1, y1) = step
            assert len(y0) == len(y1) == 8
            assert not set(y0) & set(y1)  # distinct examples on the two replicas
            np.testing.assert_allclose(x0[:, 0, 0, 0] * 255, y0, atol=1e-3)  # images match labels
            seen += list(y0) + list(y1)
        assert sorted(seen) == list(range(64))  # the epoch is the data set
        orders.append(seen)
    assert orders[0] != orders[1]  # reshuffled each epoch


def test_same_global_batch_whatever_the_replica_count(one_replica, two_replicas):
    images, labels = indexed_set(64)
    one = collect(one_replica, pipeline.train_input_fn(images, labels, 16, seed=5), 3)
    two = collect(two_replicas, pipeline.train_input_fn(images, labels, 8, seed=5), 3)
    for a, b in zip(one, two):
        np.testing.assert_array_equal(a[0][0], np.concatenate([b[0][0], b[1][0]]))


def test_stream_restarts_at_any_step(two_replicas):
    images, labels = indexed_set(48)  # 3 steps per epoch of 16
    full = collect(two_replicas, pipeline.train_input_fn(images, labels, 8, seed=2), 7)
    resumed = collect(two_replicas,
                      pipeline.train_input_fn(images, labels, 8, seed=2, start_step=4), 3)
    for a, b in zip(full[4:], resumed):
        np.testing.assert_array_equal(np.concatenate([r[0] for r in a]),
                                      np.concatenate([r[0] for r in b]))


@pytest.mark.parametrize("num_examples, per_replica, replicas", [
    (37, 5, 2), (10, 3, 1), (7, 4, 2), (40, 10, 2)])
def test_evaluation_counts_every_image_once(one_replica, two_replicas, num_examples,
                                           per_replica, replicas):
    strategy = two_replicas if replicas == 2 else one_replica
    images, labels = indexed_set(num_examples)
    steps = plan.eval_steps(num_examples, per_replica * replicas)
    batches = collect(strategy, pipeline.eval_input_fn(images, labels, per_replica), steps, 3)
    counted = []
    for step in batches:
        for _, y, w in step:
            counted += [int(label) for label, weight in zip(y, w) if weight == 1.0]
            assert set(np.unique(w)) <= {0.0, 1.0}
    assert sorted(counted) == list(range(num_examples))


def test_batch_larger_than_data(two_replicas):
    images, labels = indexed_set(10)
    with pytest.raises(DataError, match="global batch 16 is larger than the 10"):
        two_replicas.distribute_datasets_from_function(
            pipeline.train_input_fn(images, labels, 8, 0))


def test_input_is_scaled_floats(one_replica):
    images, labels = indexed_set(8)
    (x, y), = collect(one_replica, pipeline.train_input_fn(images, labels, 8, seed=0), 1, 2)[0]
    assert x.dtype == np.float32 and x.shape == (8, 28, 28, 1) and x.max() <= 7 / 255 + 1e-6
    assert tf.as_dtype(y.dtype) == tf.int32


@pytest.mark.parametrize("dtype", ["uint8", "float32"])
def test_the_served_model_sees_what_the_trained_model_saw(tmp_path, dtype):
    """One preprocessing (pipeline.to_model_input) for training, evaluation and the exported
    SavedModel: a model that returns its input, exported, gives for the stored images what
    the training pipeline fed the model for the same examples (uint8 scaled, a channel added;
    float32 as it is)."""
    import keras

    from tfmulti.rundir import export

    rng = np.random.default_rng(3)
    images = rng.integers(0, 256, (8, 5, 4)).astype(dtype)
    if dtype == "float32":
        images = images / 7.0 - 3.0  # not in [0, 1]: taken as it is
    labels = np.arange(8, dtype=np.int32) % 2
    inputs = keras.Input((5, 4, 1))
    model = keras.Model(inputs, keras.layers.Flatten()(inputs))  # its "logits": its input
    names = tuple(f"c{i}" for i in range(20))  # one per output, for the class_ids served
    export.write(model, str(tmp_path), names, (5, 4, 1), dtype)
    serve = tf.saved_model.load(str(tmp_path / "saved_model")).signatures[export.SIGNATURE]
    served = serve(images=tf.constant(images[..., None]))["logits"].numpy()
    fed, fed_labels = next(iter(pipeline.eval_input_fn(images, labels, 8)(
        tf.distribute.InputContext())))[:2]
    np.testing.assert_array_equal(fed_labels.numpy(), labels)  # in order: example i is row i
    # Bit for bit: the served graph divides by a variable, which no optimizer turns into a
    # product by 1/255 (a constant was: one unit in the last place away)
    np.testing.assert_array_equal(served, fed.numpy().reshape(8, -1))
    expected = images / 255.0 if dtype == "uint8" else images
    np.testing.assert_allclose(served, expected.reshape(8, -1), rtol=1e-6)
