"""--dataset=MODULE:FUNCTION, folder:DIR, tfds:NAME: your own data, written here by the tests
(numpy functions, tf.data sets, a folder of PNG files, a tensorflow-datasets set prepared in a
temporary data_dir), loaded, checked, and trained through real processes."""
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import keras
import numpy as np
import plain_consumer
import pytest
import tensorflow as tf

from tfmulti.data import checks, folder, pipeline, sources, tfds_sets
from tfmulti.errors import DataError, UsageError
from tfmulti.models import zoo
from tfmulti.run import config, datasets, usercode
from tfmulti.run.config import RunConfig
from tfmulti.rundir import lifecycle, names
from tfmulti.training import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLASSES = ("cat", "dog", "emu")

MODULE = textwrap.dedent('''
    import numpy as np
    import tensorflow as tf


    def _split(n, seed, shape=(16, 16, 3)):
        rng = np.random.default_rng(seed)
        y = rng.integers(0, 3, n)
        x = (rng.integers(0, 60, (n, *shape)) + 90 * y.reshape(-1, *[1] * len(shape)))
        return x.astype(np.uint8), y


    def arrays():
        """keras.datasets' form: uint8 RGB images, labels of shape (n, 1) as cifar10's."""
        (x, y), (tx, ty) = _split(96, 0), _split(24, 1)
        return (x, y.reshape(-1, 1)), (tx, ty.reshape(-1, 1))


    def untested():
        """fit(x, y)'s data: a training part alone."""
        return _split(96, 0), None


    def named_gray():
        """Grayscale [n, h, w] images, no channel axis, and the class names."""
        return _split(60, 0, (14, 14)), _split(12, 1, (14, 14)), ["cat", "dog", "emu"]


    def floats():
        (x, y), (tx, ty) = _split(60, 0), _split(12, 1)
        return (x / 255.0 - 0.5, y), (tx / 255.0 - 0.5, ty)


    def datasets():
        """Unbatched tf.data sets of (image, label) and the class count."""
        return (tf.data.Dataset.from_tensor_slices(_split(40, 0)),
                tf.data.Dataset.from_tensor_slices(_split(10, 1)), 3)


    def endless():
        train, test, n = datasets()
        return train.repeat(), test, n


    def batched():
        train, test, n = datasets()
        return train.batch(8), test, n


    def batched_short():
        train, test, n = datasets()
        return train.batch(16), test, n


    def tabular():
        (x, y), (tx, ty) = _split(20, 0), _split(5, 1)
        return ((x.reshape(20, -1)[:, :16].astype(np.float32), y),
                (tx.reshape(5, -1)[:, :16].astype(np.float32), ty))


    def no_count():
        return datasets()[:2]


    def labels_too_big():
        (x, y), test = _split(20, 0), _split(5, 1)
        return (x, y + 5), test, ["a", "b", "c"]


    def one_hot():
        (x, y), (tx, ty) = _split(20, 0), _split(5, 1)
        return (x, np.eye(3)[y]), (tx, np.eye(3)[ty])


    def sizes_differ():
        return _split(20, 0), _split(5, 1, (12, 12, 3))


    def ints():
        (x, y), test = _split(20, 0), _split(5, 1)
        return (x.astype(np.int64), y), test


    def a_dict():
        return {"train": _split(20, 0)}


    def raises():
        return _read("/data/missing.npz")


    def _read(path):
        raise FileNotFoundError(f"no such file: {path}")


    def wants_a_path(path):
        return None


    def deep(depth=5):
        """Raises 5 calls down: the innermost 3 of your frames are shown."""
        return deep(depth - 1) if depth else _read("/data/deep.npz")


    def many():
        """1100 images as unbatched tf.data: read in more than one batch of 1024."""
        x, y = _split(1100, 0, (4, 4, 1))
        return (tf.data.Dataset.from_tensor_slices((x, y)),
                tf.data.Dataset.from_tensor_slices(_split(10, 1, (4, 4, 1))), 3)


    def disjoint():
        """Train labels 20-29, test labels 0-9: a 30-class model could only score 0."""
        (x, y), (tx, ty) = _split(30, 0), _split(10, 1)
        return (x, np.arange(30) % 10 + 20), (tx, np.arange(10))


    def partly_empty():
        """Train labels 5-9 only, test labels 0-9: classes 0-4 cannot be learned."""
        (x, y), (tx, ty) = _split(30, 0), _split(20, 1)
        return (x, np.arange(30) % 5 + 5), (tx, np.arange(20) % 10)


    def declared_empty():
        """The same labels, the 10 classes named by the function: its own declaration."""
        train, test = partly_empty()
        return train, test, [f"c{i}" for i in range(10)]
''')


@pytest.fixture
def module(importable):
    """The module above, importable from the working directory under a name of its own."""
    return importable("user_data", MODULE)


def write_folder(root, sizes=None, per_class=(8, 2), gray=()):
    """root/train/<class>/*.png and root/test/<class>/*.png, each class its own brightness;
    `sizes` maps (split, class) to an image size other than 20x24, `gray` lists grayscale
    classes."""
    rng = np.random.default_rng(0)
    for split, n in zip(("train", "test"), per_class):
        for index, name in enumerate(CLASSES):
            folder = root / split / name
            folder.mkdir(parents=True, exist_ok=True)
            height, width = (sizes or {}).get((split, name), (20, 24))
            channels = 1 if name in gray else 3
            for k in range(n):
                image = rng.integers(0, 60, (height, width, channels)) + 90 * index
                tf.io.write_file(str(folder / f"{k:03d}.png"),
                                 tf.io.encode_png(image.astype(np.uint8)))
    return root


# ----------------------------------------------------------------------------- MODULE:FUNCTION

def test_numpy_arrays_as_keras_datasets_give_them(module):
    """cifar10's form: (n, 1) labels flattened, class names 0..k-1, uint8 kept (scaled to
    [0, 1] on the way to the model)."""
    dataset = sources.load(f"{module}:arrays")
    assert dataset.input_shape == (16, 16, 3) and dataset.num_classes == 3
    assert dataset.class_names == ("0", "1", "2")
    assert dataset.train_features.dtype == np.uint8 and dataset.train_targets.shape == (96,)
    assert dataset.display_name == f"{module}:arrays" and "arrays" in dataset.source
    batch = pipeline.to_model_input(tf.constant(dataset.train_features[:4]))
    np.testing.assert_allclose(batch.numpy(), dataset.train_features[:4] / 255.0, rtol=1e-6)


def test_grayscale_without_a_channel_and_floats_as_they_are(module):
    gray = sources.load(f"{module}:named_gray")
    assert gray.input_shape == (14, 14, 1) and gray.class_names == CLASSES
    assert pipeline.to_model_input(tf.constant(gray.train_features[:2])).shape == (2, 14, 14, 1)
    floats = sources.load(f"{module}:floats")
    assert floats.train_features.dtype == np.float32
    batch = pipeline.to_model_input(tf.constant(floats.train_features[:2])).numpy()
    np.testing.assert_array_equal(batch, floats.train_features[:2])  # not scaled again
    assert batch.min() < 0


def test_rows_of_numbers_and_one_hot_targets_are_a_task_of_your_own(module):
    """Features that are not images are taken as they are (the model gets them unscaled);
    one-hot targets keep uint8 images images, with no classes: a compiled model's loss
    decides (test_yourtask.py shows an uncompiled one refused)."""
    rows = sources.load(f"{module}:tabular")
    assert not rows.images and rows.input_shape == (16,) and rows.num_classes == 3
    assert rows.train_features.dtype == np.float32 and rows.example_word == "examples"
    one_hot = sources.load(f"{module}:one_hot")
    assert one_hot.images and one_hot.num_classes == 0
    assert one_hot.train_targets.dtype == np.float32 and one_hot.train_targets.shape == (20, 3)


def test_tf_data_sets_are_read_once_into_memory(module):
    dataset = sources.load(f"{module}:datasets")
    assert (len(dataset.train_features), len(dataset.test_features)) == (40, 10)
    assert dataset.num_classes == 3 and dataset.input_shape == (16, 16, 3)
    resized = sources.load(f"{module}:datasets", image_size=(8, 10))
    assert resized.input_shape == (8, 10, 3) and resized.train_features.dtype == np.uint8
    counted = sources.load(f"{module}:no_count")  # (train, test) alone, as fit takes them
    assert counted.num_classes == 3 and counted.class_names == ("0", "1", "2")


@pytest.mark.parametrize("function, words", [
    ("raises", "raised FileNotFoundError: no such file: /data/missing.npz \\(at user_data_\\d+"
               "\\.py:\\d+ in _read <- user_data_\\d+\\.py:\\d+ in raises\\)"),
    ("wants_a_path", "calls wants_a_path\\(\\) without arguments; yours takes \\(path\\)"),
    ("a_dict", "returned a dict; tfmulti takes \\(\\(x_train"),
    ("endless", "the train set is endless"),
    ("batched", "the train set gives batches of images, \\(None, 16, 16, 3\\): a batched set\\? "
                "give it unbatched \\(dataset.unbatch\\(\\)\\)"),
    ("batched_short", "the train set gives batches of images, .*give it unbatched"),
    ("labels_too_big", "train label [5-7] \\(example \\d+\\) is outside the 3 classes 0-2"),
    ("disjoint", "train and test have no class in common \\(train labels 20-29, test labels "
                 "0-9\\); the test accuracy could only be 0"),
    ("sizes_differ", "train images are 16x16x3, test images 12x12x3; give --image_size"),
    ("ints", "images are int64; give uint8"),
    ("nothing_here", "user_data_\\d+ has no function 'nothing_here'"),
])
def test_a_data_function_that_cannot_work_is_one_line(module, function, words):
    with pytest.raises((DataError, UsageError), match=words) as error:
        sources.load(f"{module}:{function}")
    assert "\n" not in str(error.value)


def test_classes_training_cannot_learn_are_said_before_the_first_step(module, one_replica,
                                                                      capsys):
    """Labels counted from the largest one leave classes 0-4 without a training example:
    one line, before the first step (a user's function naming its classes declares them)."""
    dataset = sources.load(f"{module}:partly_empty")
    assert dataset.notes == (
        f"--dataset={module}:partly_empty: 5 of the 10 classes cannot be learned: labels 0-4 "
        "have no training example (the 10 classes are counted from the largest label, 9); "
        "10 test examples are of those classes",)
    assert sources.load(f"{module}:declared_empty").notes == ()
    assert sources.load(f"{module}:arrays").notes == ()
    cfg = RunConfig(model="lenet", width=2, dataset=f"{module}:partly_empty", epochs=1,
                    global_batch_size=10)
    train.train_and_evaluate(one_replica, dataset, cfg)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == dataset.notes[0] and out[1].startswith("Training lenet on "), out[:2]


def test_past_the_chunk_and_frame_limits(module):
    """A raise deeper than MAX_FRAMES (3) shows the innermost 3 frames; a tf.data set past
    the 1024-element batches it is read in, and a resize past its 4096-image chunks, keep
    every example in order."""

    with pytest.raises(UsageError) as error:
        sources.load(f"{module}:deep")
    frames = str(error.value).split("(at ")[1].rstrip(")").split(" <- ")
    assert len(frames) == usercode.MAX_FRAMES == 3
    assert frames[0].endswith("in _read") and all(f.endswith("in deep") for f in frames[1:])
    read = sources.load(f"{module}:many")
    assert len(read.train_features) == 1100
    np.testing.assert_array_equal(read.train_targets[1020:1030],
                                  _module_labels(module, 1100)[1020:1030])
    images = np.arange(4100 * 2 * 2, dtype=np.uint8).reshape(4100, 2, 2) % 251
    same = checks.resized(images, (2, 2))
    assert same.shape == (4100, 2, 2, 1)
    np.testing.assert_array_equal(same[..., 0], images)  # a resize to its own size, chunked


def _module_labels(module, n):
    return sys.modules[module]._split(n, 0, (4, 4, 1))[1]


def test_dataset_flags_are_checked():
    assert [datasets.source_of(d).name for d in ("synthetic", "m.sub:load", "folder:/a/b",
                                             "tfds:cifar10")] == [
        "builtin", "function", "folder", "tfds"]
    assert datasets.label("folder:/data/flowers/") == "flowers"
    assert datasets.label("tfds:cifar10:3.0.2") == "cifar10_3.0.2"
    assert datasets.label("m:load") == "m.load"
    assert config.image_size("32") == (32, 32) and config.image_size("24x40") == (24, 40)
    for settings, words in [({"dataset": "cifar"}, "choose one of fashion_mnist, synthetic, "
                                                   "or your own"),
                            ({"dataset": "folder:"}, "give a directory after 'folder:'"),
                            ({"image_size": "32x"}, "give HEIGHTxWIDTH"),
                            ({"image_size": "0"}, "give HEIGHTxWIDTH")]:
        with pytest.raises(UsageError, match=words):
            RunConfig(**settings)


CSV_SOURCE = """
import numpy as np
from tfmulti.data.dataset import DataSet


def load(spec, request):
    rows = np.loadtxt(spec[len("csv:"):], delimiter=",", dtype=np.float32)
    x, y = rows[:, :-1], rows[:, -1].astype(np.int32)
    return DataSet(spec, "a CSV file", x[:6], y[:6], x[6:], y[6:], class_names=("a", "b"),
                   images=False)
"""


def test_a_new_source_is_one_module_and_one_entry_and_the_table_needs_no_tensorflow(
        tmp_path, monkeypatch):
    (tmp_path / "csv_source.py").write_text(CSV_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    table = tmp_path / "rows.csv"
    table.write_text("\n".join(f"{i},{i * 2},{i % 2}" for i in range(8)))
    with pytest.raises(UsageError, match="choose one of"):
        RunConfig(dataset=f"csv:{table}")
    csv = datasets.Source("csv", "csv:FILE", "csv_source", lambda s: s.startswith("csv:"),
                          label=lambda s: "rows")
    monkeypatch.setattr(datasets, "SOURCES", (csv, *datasets.SOURCES))
    cfg = RunConfig(dataset=f"csv:{table}", model="lenet")
    assert datasets.label(cfg.dataset) == "rows" and not cfg.features_as_given
    read = sources.load_for(cfg)
    assert (read.train_size, read.test_size, read.input_shape) == (6, 2, (2,))
    np.testing.assert_array_equal(read.test_targets, [0, 1])
    for source in datasets.SOURCES:  # every source's module reads it (and its named splits)
        assert callable(sources.reader(source).load), source.name
        assert not source.named_splits or callable(sources.reader(source).named_split)
    checked = subprocess.run(
        [sys.executable, "-c", "import sys; from tfmulti.run import config; "
         "config.RunConfig(dataset='tfds:mnist', train_split='train[:50%]'); "
         "print(sorted(m for m in ('tensorflow', 'keras') if m in sys.modules))"],
        capture_output=True, text=True, check=True)
    assert checked.stdout.strip() == "[]", checked.stderr


def test_a_built_in_model_takes_any_image_shape_and_class_count():
    assert zoo.build("resnet18", 4, (9, 11, 3), 5).output_shape == (None, 5)
    assert zoo.build("lenet", 4, (14, 14, 3), 2).output_shape == (None, 2)
    with pytest.raises(UsageError, match="--model=lenet needs images of at least 14x14; the "
                                         "data set's are 12x12: give --image_size"):
        zoo.check_input("lenet", (12, 12, 3))


def test_a_built_in_model_on_data_without_a_test_part_says_so(module, tool, one_replica):
    """Images and class ids with no test part: the built-in classifier has nothing to be
    judged on, and the one line says that (it once said the features were not images)."""
    code, _, err = tool("main", "--model=lenet", f"--dataset={module}:untested",
                        "--model_dir=", strategy=one_replica)
    assert code == 1 and err.strip().splitlines() == [
        "tfmulti: error: --model=lenet is judged on the data set's test part, and it has none: "
        "return ((x_train, y_train), (x_test, y_test)), or give a model of your own "
        "(--model=MODULE:FUNCTION)"]


# ----------------------------------------------------------------------------- folder:DIR

def test_a_folder_of_images_gives_sorted_classes_in_one_size(tmp_path):
    """Classes are train/'s folder names, sorted; images of another size are resized to the
    first one's; a grayscale class takes the first image's channels."""
    root = write_folder(tmp_path / "pets", sizes={("train", "emu"): (10, 12)}, gray=("dog",))
    dataset = sources.load(f"folder:{root}")
    assert dataset.class_names == CLASSES and dataset.input_shape == (20, 24, 3)
    assert (len(dataset.train_features), len(dataset.test_features)) == (24, 6)
    np.testing.assert_array_equal(dataset.train_targets, np.repeat([0, 1, 2], 8))
    first = tf.io.decode_png(tf.io.read_file(str(root / "train" / "cat" / "000.png")))
    np.testing.assert_array_equal(dataset.train_features[0], first.numpy())
    dog = dataset.train_features[8]
    np.testing.assert_array_equal(dog[..., 0], dog[..., 2])  # gray, as 3 equal channels
    sized = sources.load(f"folder:{root}", image_size=(16, 16))
    assert sized.input_shape == (16, 16, 3) and sized.source == f"image files in {root}"


def test_a_folder_past_one_decoding_batch_keeps_every_file_in_order(tmp_path):
    """1030 files: decoded in batches of 1024, each image with its own file's pixels."""
    for k in range(1030):
        folder = tmp_path / "many" / ("train" if k < 1025 else "test") / f"c{k % 2}"
        folder.mkdir(parents=True, exist_ok=True)
        tf.io.write_file(str(folder / f"{k:04d}.png"),
                         tf.io.encode_png(np.full((2, 2, 1), k % 251, np.uint8)))
    dataset = sources.load(f"folder:{tmp_path / 'many'}")
    assert len(dataset.train_features) == 1025 and dataset.class_names == ("c0", "c1")
    train = np.asarray(dataset.train_features)  # all 1025 read: past one batch of 1024
    even = [k % 251 for k in range(0, 1025, 2)]
    np.testing.assert_array_equal(train[:len(even), 0, 0, 0], even)
    assert train[-1, 0, 0, 0] == dataset.train_features[-1, 0, 0, 0] == 1023 % 251


def test_an_empty_class_folder_and_skipped_files_are_said_in_one_line_each(tmp_path):
    root = write_folder(tmp_path / "pets")
    (root / "train" / "ten").mkdir()
    (root / "train" / "cat" / "notes.txt").write_text("taken in May")
    (root / "test" / "dog" / ".DS_Store").write_bytes(b"\0")
    dataset = sources.load(f"folder:{root}")
    assert dataset.class_names == (*CLASSES, "ten")
    assert dataset.notes == (
        f"--dataset=folder:{root}: 1 of the 4 classes cannot be learned: folder train/ten/ "
        "holds no image",
        f"--dataset=folder:{root}: 2 files in the class folders are not an image (.png, .jpg, "
        ".jpeg, .bmp, .gif) and skipped: test/dog/.DS_Store, train/cat/notes.txt")


def test_a_folder_that_cannot_work_is_one_line(tmp_path):
    def refused(root, words):
        with pytest.raises(DataError, match=words) as error:
            sources.load(f"folder:{root}")
        assert "\n" not in str(error.value)

    refused(tmp_path / "nowhere", "is not a directory")
    (tmp_path / "empty" / "train" / "cat").mkdir(parents=True)
    (tmp_path / "empty" / "test" / "cat").mkdir(parents=True)
    refused(tmp_path / "empty", "empty/train holds no image files \\(.png, .jpg")
    no_test = write_folder(tmp_path / "no_test")
    shutil.rmtree(no_test / "test")
    refused(no_test, "no test split: .*no_test/test is missing")
    unknown = write_folder(tmp_path / "unknown")
    (unknown / "test" / "yak").mkdir()
    refused(unknown, "test/yak is a class train/ does not have")
    for name, damage in (("truncated", lambda b: b[:len(b) // 2]), ("text", lambda b: b"hi")):
        broken = write_folder(tmp_path / name)
        victim = broken / "train" / "dog" / "003.png"
        victim.write_bytes(damage(victim.read_bytes()))
        refused(broken, f"{victim} is not a readable image")


def test_each_worker_checks_its_share_of_the_files_and_all_agree(tmp_path):
    """With several workers each decodes only its share of the files before the run (the
    train files, then the test files, dealt out in turn): worker 1 of 2 does not see a
    corrupt file of worker 0's share; told of it by the others' smallest index, it names it
    too, so every worker stops with a line about the same file. (Across real processes, with
    the all-reduce that agrees: make soak.)"""

    root = write_folder(tmp_path / "pets")
    victim = root / "train" / "cat" / "002.png"  # the third file: worker 0's share of 2
    victim.write_bytes(victim.read_bytes()[:40])
    spec = f"folder:{root}"
    assert len(sources.load(spec, place=(1, 2)).train_features) == 24  # not in its share
    with pytest.raises(DataError, match=f"{victim} is not a readable image \\(Invalid PNG"):
        sources.load(spec, place=(0, 2))
    with pytest.raises(DataError, match=f"{victim} is not a readable image \\(found by "
                                        "another worker\\)"):
        sources.load(spec, place=(1, 2), smallest=lambda mine: min(mine, 2))
    told = []
    sources.load(f"folder:{write_folder(tmp_path / 'fine')}", place=(1, 3),
              smallest=lambda mine: told.append(mine) or mine)
    assert told == [30]  # nothing unreadable: the file count, 24 train + 6 test
    assert folder.first_unreadable([], (2, 2), 1) is None


def test_a_folder_is_read_as_the_batches_need_it(tmp_path):
    """folder: images stay files until the pipeline reads a batch: the batches of a
    2-replica stream hold the files' own pixels, and indexing reads only what it touches."""
    root = write_folder(tmp_path / "pets")
    dataset = sources.load(f"folder:{root}")
    images = dataset.train_features
    assert images.shape == (24, 20, 24, 3) and images.dtype == np.uint8 and len(images) == 24
    np.testing.assert_array_equal(images[[3, 9]], np.stack([images[3], images[9]]))
    assert images[5, 0, 0].shape == (3,) and np.asarray(images).shape == images.shape
    labels = np.arange(24, dtype=np.int32)  # gathered with the images: which examples
    dataset_fn = pipeline.train_input_fn(images, labels, per_replica_batch_size=4, seed=0)
    context = tf.distribute.InputContext(num_input_pipelines=1, input_pipeline_id=0,
                                         num_replicas_in_sync=2)
    for x, idx in dataset_fn(context).take(3):
        np.testing.assert_allclose(x.numpy(), images[idx.numpy()] / 255.0, rtol=1e-6)


def worker_needs(n_train, n_test, global_batch, epochs, seed=0, workers=2):
    """The train and test files each of `workers` workers (1 replica each) reads: its slices
    of the stream's global batches, its share of the check, and the first image."""
    needs = []
    for w in range(workers):
        context = tf.distribute.InputContext(num_input_pipelines=workers, input_pipeline_id=w,
                                             num_replicas_in_sync=workers)
        per_replica = global_batch // workers
        train = pipeline.train_input_fn(np.zeros((n_train, 1, 1), np.uint8),
                                    np.arange(n_train, dtype=np.int32), per_replica, seed)
        steps = n_train // global_batch * epochs
        taken = {int(i) for _, idx in train(context).take(steps) for i in idx.numpy()}
        test = pipeline.eval_input_fn(np.zeros((n_test, 1, 1), np.uint8),
                                  np.arange(n_test, dtype=np.int32), per_replica)
        tested = {int(i) for _, idx, _ in test(context) for i in idx.numpy()}
        checked = set(range(w, n_train + n_test, workers))
        needs.append(({0} | taken | {i for i in checked if i < n_train},
                      tested | {i - n_train for i in checked if i >= n_train}))
    return needs


@pytest.mark.soak  # about a minute: make soak
def test_each_worker_reads_only_its_share_of_the_folder(tmp_path):
    """Two workers (real processes, one replica each), each in a folder of its own where every
    file it should not need is garbage: both finish, with the weights of one process on 2
    replicas reading the intact folder. A corrupt file in worker 1's share of the check: both
    stop with a line naming it, and no run folder is made."""
    from tfmulti.processes import launcher

    flags = ["--model=lenet", "--width=4", "--global_batch_size=12", "--epochs=2",
             "--deterministic", "--dataset=folder:pets"]
    intact = write_folder(tmp_path / "intact" / "pets", per_class=(16, 4))
    reference = command(tmp_path / "intact", tmp_path / "reference", 2, *flags)
    out, err = reference.communicate(timeout=300)
    assert reference.returncode == 0, err[-2000:]
    files = {split: sorted((intact / split).glob("*/*.png")) for split in ("train", "test")}
    needs = worker_needs(len(files["train"]), len(files["test"]), 12, 2)
    assert all(len(n[0]) < len(files["train"]) for n in needs)  # a share, not all
    hosts = ",".join(f"localhost:{p}" for p in launcher.free_ports(2))
    workers = []
    for w, (train_part, test_part) in enumerate(needs):
        mine = tmp_path / f"worker{w}"
        shutil.copytree(intact, mine / "pets")
        for split, keep in (("train", train_part), ("test", test_part)):
            for i, path in enumerate(files[split]):
                if i not in keep:
                    (mine / path.relative_to(intact.parent)).write_bytes(b"not for this worker")
        env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
        workers.append(subprocess.Popen(
            [sys.executable, "-m", "tfmulti.main", *flags, "--num_gpus=0",
             f"--worker_hosts={hosts}", f"--task_index={w}",
             f"--model_dir={tmp_path / 'shared'}"], cwd=mine, env={**env, "PYTHONPATH": ROOT},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = [p.communicate(timeout=300) for p in workers]
    assert [p.returncode for p in workers] == [0, 0], outputs[0][1][-2000:] + outputs[1][1][-2000:]
    for a, b in zip(_weights(tmp_path / "reference"), _weights(tmp_path / "shared")):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    # One corrupt file, checked by worker 1 only: both name it, nothing is made.
    victim = files["train"][1]  # the second file: worker 1's share
    victim.write_bytes(victim.read_bytes()[:50])
    hosts = ",".join(f"localhost:{p}" for p in launcher.free_ports(2))
    refused = [command(tmp_path / "intact", tmp_path / "refused", 1, *flags,
                       f"--worker_hosts={hosts}", f"--task_index={w}") for w in range(2)]
    lines = []
    for process in refused:
        _, err = process.communicate(timeout=300)
        assert process.returncode == 1, err[-2000:]
        lines.append(err.strip().splitlines()[-1])
    name = f"pets/train/{victim.parent.name}/{victim.name} is not a readable image"
    assert name in lines[0] and "(found by another worker)" in lines[0], lines
    assert name in lines[1] and "(Invalid PNG data" in lines[1], lines
    assert not (tmp_path / "refused").exists()


@pytest.mark.soak  # make soak
def test_a_file_broken_during_the_run_stops_it_in_one_line(tmp_path):
    """The files are checked at the start and read again every epoch: overwritten after
    training began, the run stops with one line (not TensorFlow's traceback), keeping its
    checkpoints for a resume once the file is replaced."""
    root = write_folder(tmp_path / "pets", per_class=(16, 4))
    run = command(tmp_path, tmp_path / "run", 2, "--model=lenet", "--width=4",
                  "--global_batch_size=4", "--epochs=3", "--dataset=folder:pets")
    for line in run.stdout:
        if line.startswith("Epoch 1/3"):
            break
    for path in sorted(root.glob("*/*/*.png"))[1:]:  # all but the first image
        path.write_bytes(b"overwritten")
    _, err = run.communicate(timeout=300)
    assert run.returncode == 1, err[-2000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("tfmulti: error: an image file no longer decodes (Unknown image "
                           "file format"), last
    assert "Traceback" not in err


def _weights(model_dir):
    model = keras.saving.load_model(os.path.join(model_dir, names.MODEL_FILE))
    return model.get_weights()


# ----------------------------------------------------------------------------- tfds:NAME

TFDS_BUILDER = textwrap.dedent('''
    import numpy as np
    import tensorflow_datasets as tfds


    class TinyShades(tfds.core.GeneratorBasedBuilder):
        """Two classes of 16x16 RGB images, dark and light; train, validation and test
        splits."""
        VERSION = tfds.core.Version("1.0.0")

        def _info(self):
            return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({
                "image": tfds.features.Image(shape=(16, 16, 3)),
                "label": tfds.features.ClassLabel(names=["dark", "light"])}),
                supervised_keys=("image", "label"))

        def _split_generators(self, dl_manager):
            return {"train": self._generate_examples(40, 0),
                    "validation": self._generate_examples(12, 2),
                    "test": self._generate_examples(10, 1)}

        def _generate_examples(self, n, seed):
            rng = np.random.default_rng(seed)
            for i in range(n):
                yield i, {"image": (rng.integers(0, 100, (16, 16, 3)) + 150 * (i % 2)
                                    ).astype(np.uint8), "label": i % 2}
''')


@pytest.fixture(scope="module")
def tfds_dir(tmp_path_factory):
    """A tensorflow-datasets data_dir with tiny_shades prepared, by a process of its own (so
    this one finds it from its files alone, as a user's process would)."""
    folder = tmp_path_factory.mktemp("tfds")
    (folder / "tiny_shades_builder.py").write_text(TFDS_BUILDER)
    subprocess.run([sys.executable, "-c", "import tiny_shades_builder as b; "
                    f"b.TinyShades(data_dir={str(folder / 'data')!r}).download_and_prepare()"],
                   cwd=folder, check=True, capture_output=True, timeout=300)
    return folder / "data"


def test_a_tensorflow_datasets_set_from_its_data_dir(tfds_dir):
    dataset = sources.load("tfds:tiny_shades", data_dir=str(tfds_dir))
    assert dataset.class_names == ("dark", "light") and dataset.input_shape == (16, 16, 3)
    assert (len(dataset.train_features), len(dataset.test_features)) == (40, 10)
    assert dataset.train_features[dataset.train_targets == 1].mean() > 150
    with pytest.raises(DataError, match="--dataset=tfds:no_such_set: tensorflow-datasets cannot "
                                        "find it"):
        sources.load("tfds:no_such_set", data_dir=str(tfds_dir))


def test_no_data_set_tfmulti_reads_runs_tf_datas_autotuning(tmp_path, module, tfds_dir,
                                                              iterated):
    """A folder's files checked and decoded, your tf.data sets read once, a tensorflow-datasets
    set read: every dataset iterated runs without tf.data's autotuning."""
    sources.load(f"folder:{write_folder(tmp_path / 'pets')}")
    sources.load(f"{module}:datasets")
    sources.load("tfds:tiny_shades", data_dir=str(tfds_dir))
    assert len(iterated) >= 5 and set(iterated) == {False}, iterated


def test_a_named_split_is_the_validation_part_every_epoch(tfds_dir, one_replica, tmp_path,
                                                          capsys):
    """--validation_set=validation: the run trains on all 40 training images and validates
    on the 12 of the split each epoch (val_ figures); a slice of it takes its share."""
    cfg = RunConfig(model="lenet", width=2, dataset="tfds:tiny_shades",
                    data_dir=str(tfds_dir), validation_set="validation", epochs=2,
                    global_batch_size=8)
    dataset = sources.load_for(cfg)
    assert [len(a) for a in dataset.validation] == [12, 12]
    assert dataset.validation[0].shape[1:] == dataset.train_features.shape[1:]
    _, history = train.train_and_evaluate(one_replica, dataset, cfg, model_dir=str(tmp_path))
    assert [(r["val_examples"], r["test_examples"]) for r in history] == [(12, 10), (12, 10)]
    said = capsys.readouterr().out
    assert "(40 images, validating on its split validation (12), 2 classes)" in said
    half = sources.load_for(dataclasses.replace(cfg, validation_set="validation[:50%]"))
    assert len(half.validation[0]) == 6 and len(half.train_features) == 40


@pytest.mark.parametrize("settings, words", [
    ({"validation_set": "test"}, "--validation_set=test: the test set is for the end"),
    ({"validation_set": "train[90%:]"}, "--validation_set=train[90%:]: that is the training "
                                        "data; hold a share of it out with --validation_split"),
    ({"validation_set": "validation", "validation_split": 0.1},
     "--validation_set=validation and --validation_split=0.1: give one"),
    ({"validation_set": "validation", "dataset": "synthetic"},
     "--validation_set=validation: only a tensorflow-datasets set (--dataset=tfds:NAME) has "
     "named splits; for --dataset=synthetic hold a share"),
])
def test_a_validation_set_that_cannot_be_is_one_line(settings, words):
    with pytest.raises(UsageError, match=re.escape(words)):
        RunConfig(**{"dataset": "tfds:tiny_shades", **settings})


def test_a_split_the_set_does_not_have_names_the_ones_it_has(tfds_dir):
    for split, words in (("valid", "--validation_set=valid: tfds:tiny_shades has no split "
                                   "'valid' (it has: "),
                         ("validation[:200%]", "--validation_set=validation[:200%]: ")):
        with pytest.raises(DataError, match=re.escape(words)):
            sources.load_for(RunConfig(dataset="tfds:tiny_shades", data_dir=str(tfds_dir),
                                       validation_set=split))


@pytest.mark.soak  # a tuning session, 35 s of make test (test_sessions.py keeps one there)
def test_a_session_chooses_on_a_named_split_and_best_cfg_keeps_it(tfds_dir, tmp_path):
    """tfmulti.tune --validation_set=validation: each trial trains on all the training images
    and is scored on the split; best.cfg trains with it and says so."""
    session = tmp_path / "session"
    result = subprocess.run(
        [sys.executable, "-m", "tfmulti.tune", "--dataset=tfds:tiny_shades",
         f"--data_dir={tfds_dir}", "--validation_set=validation", "--model=lenet", "--width=2",
         "--cpu_replicas=1", "--epochs=1", "--max_trials=1", "--tune_batch_sizes=8",
         f"--model_dir={session}"], cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    with open(session / "trials" / "trial_0" / "run" / "metrics.json") as f:
        record = json.load(f)["epochs"][-1]
    assert record["val_examples"] == 12 and "test_loss" not in record
    best = (session / "best.cfg").read_text()
    assert "--validation_set=validation" in best and "on the split validation." in best
    assert "--validation_split=0.0" in best


def test_a_tensorflow_datasets_set_that_cannot_be_downloaded_fails_at_once(tmp_path, monkeypatch):
    """Offline, tensorflow-datasets retries for minutes (3.5 measured here); the mirror's
    host is asked first, and no answer is one line (the host made unreachable here, so the
    test holds on a machine with a network too)."""

    asked = []

    def unreachable(url):
        asked.append(url)
        raise OSError("storage.googleapis.com is unreachable: no route")

    monkeypatch.setattr(tfds_sets, "check_download_host", unreachable)
    with pytest.raises(DataError, match="--dataset=tfds:mnist: not prepared in .* and the download "
                                        "failed \\(no network\\? storage.googleapis.com is "
                                        "unreachable"):
        sources.load("tfds:mnist", data_dir=str(tmp_path))
    assert asked == [tfds_sets.TFDS_MIRROR]


# ----------------------------------------------------------------------------- runs

def command(cwd, model_dir, replicas, *flags, tool="main"):
    env = {**os.environ, "PYTHONPATH": ROOT}  # the user's module: the working directory
    return subprocess.Popen(
        [sys.executable, "-m", f"tfmulti.{tool}", f"--model_dir={model_dir}",
         f"--cpu_replicas={replicas}", *flags],
        cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


USER_MODEL = textwrap.dedent('''
    import keras
    from keras import layers


    def small(input_shape, num_classes):
        inputs = keras.Input(input_shape)
        x = layers.Conv2D(8, 3, strides=2, activation="relu",
                          kernel_initializer=keras.initializers.GlorotUniform(seed=1))(inputs)
        x = layers.GlobalAveragePooling2D()(x)
        return keras.Model(inputs, layers.Dense(num_classes, kernel_initializer=
                                                keras.initializers.GlorotUniform(seed=2))(x))
''')


@pytest.mark.soak  # 21 s of make test; there a folder trains on 2 replicas through the
# tf.data service (test_dataservice.py) and is read batch by batch (in process, above)
def test_your_model_trains_on_a_folder_of_images_with_2_replicas(tmp_path, tool, monkeypatch):
    """A real `python -m tfmulti.main --model=my_models:small --dataset=folder:pets` started in
    the user's folder: it learns the three brightness classes, run.json records the class
    names, a resume with another class list is refused, the exported model serves elsewhere,
    and evaluate reads other images of its classes."""
    write_folder(tmp_path / "pets", per_class=(40, 8))
    (tmp_path / "my_models.py").write_text(USER_MODEL)
    flags = ["--model=my_models:small", "--dataset=folder:pets", "--global_batch_size=24",
             "--base_lr=1", "--momentum=0.9", "--epochs=4"]
    run = command(tmp_path, tmp_path / "run", 2, *flags)
    out, err = run.communicate(timeout=300)
    assert run.returncode == 0, err[-2000:]
    assert ("Training my_models:small on folder:pets (120 images, 3 classes) on "
            "[CPU:0, CPU:1]") in out
    metrics = json.loads((tmp_path / "run" / names.METRICS_FILE).read_text())
    assert metrics["epochs"][-1]["test_acc"] > 0.9, metrics["epochs"]
    recorded = json.loads((tmp_path / "run" / lifecycle.RUN_FILE).read_text())
    assert recorded["class_names"] == list(CLASSES) and recorded["image_shape"] == [20, 24, 3]
    # Handed on: the SavedModel takes uint8 images of any batch in a process without tfmulti
    test = sources.load(f"folder:{tmp_path / 'pets'}")
    used = plain_consumer.consume(tmp_path / "run", test.test_features, test.test_targets,
                                  tmp_path)
    acc = metrics["epochs"][-1]["test_acc"]
    assert used["saved_acc"] == pytest.approx(acc, abs=1e-6) == used["keras_acc"], used
    assert used["classes"] == used["names_match"] and set(used["classes"]) <= set(CLASSES)
    assert used["batch_dimension"] is None and not used["tfmulti_imported"]
    (tmp_path / "pets" / "train" / "emu").rename(tmp_path / "pets" / "train" / "eel")
    (tmp_path / "pets" / "test" / "emu").rename(tmp_path / "pets" / "test" / "eel")
    monkeypatch.chdir(tmp_path)  # where the command ran: --dataset=folder:pets
    renamed = sources.load("folder:pets")
    again = lifecycle.run_file(RunConfig(**{**recorded["config"], "epochs": 5}), renamed,
                            recorded["global_batch_size"], 1, 1)
    with pytest.raises(UsageError, match=re.escape(
            "holds a different run (class_names ['cat', 'dog', 'emu'] there, ['cat', 'dog', "
            "'eel'] now)")):
        lifecycle.open_run(str(tmp_path / "run"), again)
    # Evaluated on other images of its classes; a data set of other classes is refused
    more = write_folder(tmp_path / "more", per_class=(1, 10))
    code, out, err = tool("evaluate", f"--model_dir={tmp_path / 'run'}",
                          f"--dataset=folder:{more}")
    assert code == 0, err
    result = json.loads((tmp_path / "run" / "evaluation-more.json").read_text())
    assert result["examples"] == 30 and result["accuracy"] > 0.9, result
    assert list(result["per_class"]) == list(CLASSES)
    assert (tmp_path / "run" / "confusion-more.png").exists()
    code, _, err = tool("evaluate", f"--model_dir={tmp_path / 'run'}",
                        f"--dataset=folder:{tmp_path / 'pets'}")
    assert code == 1 and "its classes (cat, dog, eel) are not the run's (cat, dog, emu)" in err


def test_bad_data_stops_before_a_run_folder_is_made(tmp_path, tool, two_replicas, monkeypatch):
    """The command in this process, as cli.main runs it, on the suite's 2 replicas."""
    (tmp_path / "my_data.py").write_text(MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    code, _, err = tool("main", f"--model_dir={tmp_path / 'run'}", "--cpu_replicas=2",
                        "--dataset=my_data:raises", "--model=lenet", strategy=two_replicas)
    assert code == 1, err[-1000:]
    lines = MODULE.splitlines()
    read, raises = (lines.index(f"def {name}(" + args) + 2
                    for name, args in (("_read", "path):"), ("raises", "):")))
    assert err.strip().splitlines()[-1] == (
        "tfmulti: error: --dataset=my_data:raises raised FileNotFoundError: no such file: "
        f"/data/missing.npz (at my_data.py:{read} in _read <- my_data.py:{raises} in raises)")
    assert not (tmp_path / "run").exists()


BAD_MODELS = textwrap.dedent('''
    import keras
    from keras import layers

    _MADE_AT_IMPORT = keras.Sequential(
        [keras.Input((16, 16, 3)), layers.Flatten(), layers.Dense(3)])


    def made_at_import(input_shape, num_classes):
        return _MADE_AT_IMPORT


    def softmaxed(input_shape, num_classes):
        inputs = keras.Input(input_shape)
        return keras.Model(inputs, layers.Dense(num_classes, activation="softmax")(
            layers.Flatten()(inputs)))


    def nan_logits(input_shape, num_classes):
        inputs = keras.Input(input_shape)
        x = layers.Lambda(lambda t: t * float("nan"))(layers.Flatten()(inputs))
        return keras.Model(inputs, layers.Dense(num_classes)(x))
''')


def test_the_doctors_check_passes_your_model_and_data(two_replicas, importable):
    from tfmulti.doctor import yourcode

    models_module, data_module = importable("good_models", USER_MODEL), importable("data", MODULE)
    cfg = RunConfig(model=f"{models_module}:small", dataset=f"{data_module}:arrays")
    findings = list(yourcode.findings_of(cfg, two_replicas))
    assert [(k, label) for k, label, _ in findings] == [
        ("info", "data"), ("info", ""), ("info", "model"), ("info", "steps"),
        ("info", "variables"),
        ("info", "step"),
        ("info", "export")], findings


@pytest.mark.soak
def test_the_doctor_checks_your_model_and_data_in_a_real_process(tmp_path):
    """python -m tfmulti.doctor --model=my_models:small --dataset=my_data:arrays: the data,
    the model, its variables, one step on 2 logical replicas and the export round trip, each
    a line; exit 0."""
    (tmp_path / "my_data.py").write_text(MODULE)
    (tmp_path / "my_models.py").write_text(USER_MODEL)
    result = subprocess.run(
        [sys.executable, "-m", "tfmulti.doctor", "--model=my_models:small",
         "--dataset=my_data:arrays", "--cpu_replicas=2", "--global_batch_size=16",
         "--nodoctor_predict", "--doctor_allreduce_mb=1"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True,
        timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert ("data: my_data:arrays: 96 + 24 examples, features uint8 [n, 16, 16, 3], targets "
            "int32 [n], 3 classes") in out
    assert ("your model takes its features as your function returns them, as model.fit gives "
            "them: uint8 [n, 16, 16, 3] (0-255") in out
    assert ("model: my_models:small: 251 trainable parameters, outputs (None, 3) logits for 3 "
            "classes") in out
    assert "variables: all 4 made under the strategy, mirrored on 2 replicas" in out
    assert "step: one training step on 2 logical CPU replicas, 4 images each: loss " in out
    assert "export: SavedModel with a serving signature, the model's predictions on 8" in out
    assert not list(tmp_path.glob("runs")), "the doctor writes nothing"


@pytest.mark.parametrize("model, dataset, words", [
    ("made_at_import", "arrays", "--model={models}:made_at_import: trainable variable "
                                 "sequential\\S*/dense\\S*/kernel \\(2 of 2\\) was made "
                                 "outside the strategy's scope"),
    ("softmaxed", "arrays", "--model={models}:softmaxed ends in a softmax"),
    ("nan_logits", "arrays", "--model={models}:nan_logits: one training step on 2 replicas "),
    ("softmaxed", "raises", "--dataset={data}:raises raised FileNotFoundError"),
])
def test_the_doctors_check_names_your_function(two_replicas, importable, model, dataset, words):
    from tfmulti.doctor import yourcode

    models_module, data_module = importable("bad_models", BAD_MODELS), importable("data", MODULE)
    cfg = RunConfig(model=f"{models_module}:{model}", dataset=f"{data_module}:{dataset}")
    findings = list(yourcode.findings_of(cfg, two_replicas))
    kind, _, text = findings[-1]
    assert kind == "problem" and len(text.splitlines()) == 1, findings
    assert re.search(words.format(models=models_module, data=data_module), text), text
    assert [k for k, _, _ in findings[:-1]] == ["info"] * (len(findings) - 1)


def newest_checkpoint(model_dir):
    found = [int(p.name.split("-")[1].split(".")[0])
             for p in (model_dir / lifecycle.CHECKPOINT_DIR).glob("ckpt-*.index")]
    return max(found, default=0)


@pytest.mark.soak
def test_on_your_data_a_killed_run_resumes_exactly_and_on_1_replica(tmp_path):
    """A numpy data function and your model, 2 replicas, --deterministic: kill -9 after a
    periodic checkpoint; resumed on 2 replicas it ends bit for bit as the uninterrupted run,
    resumed on 1 replica (the same global batch) within float rounding."""
    (tmp_path / "my_data.py").write_text(MODULE)
    (tmp_path / "my_models.py").write_text(USER_MODEL)
    flags = ["--model=my_models:small", "--dataset=my_data:arrays", "--global_batch_size=16",
             "--epochs=3", "--checkpoint_steps=2", "--steps_per_call=2", "--deterministic"]
    whole = command(tmp_path, tmp_path / "whole", 2, *flags)
    killed = command(tmp_path, tmp_path / "same", 2, *flags)
    deadline = time.time() + 300
    while newest_checkpoint(tmp_path / "same") < 4 and time.time() < deadline:
        assert killed.poll() is None, killed.communicate()[1][-2000:]
        time.sleep(0.01)
    killed.send_signal(signal.SIGKILL)
    killed.communicate(timeout=60)
    shutil.copytree(tmp_path / "same", tmp_path / "elastic")
    for name, replicas in (("same", 2), ("elastic", 1)):
        resumed = command(tmp_path, tmp_path / name, replicas, *flags)
        out, err = resumed.communicate(timeout=300)
        assert resumed.returncode == 0 and "Resuming the run" in out, err[-2000:]
    assert whole.wait(300) == 0

    def final(name):
        return keras.saving.load_model(tmp_path / name / names.MODEL_FILE).get_weights()

    reference = final("whole")
    for got, want in zip(final("same"), reference):
        np.testing.assert_array_equal(got, want)
    worst = max(np.abs(a - b).max() for a, b in zip(final("elastic"), reference))
    assert worst < 1e-5, worst


def test_a_folders_odd_entries_are_skipped_and_a_huge_image_refused(tmp_path):
    """A FIFO named x.png (reading it would block for ever), a folder named y.png and a link
    to an image outside the folder are skipped and said; an image whose header promises
    more pixels than the limit (a decompression bomb) is refused, naming it, before any
    decoding. Every header kind is read: PNG, GIF, BMP, JPEG."""
    root = write_folder(tmp_path / "pets")
    os.mkfifo(root / "train" / "cat" / "x.png")
    (root / "train" / "dog" / "y.png").mkdir()
    outside = tmp_path / "elsewhere.png"
    shutil.copy(root / "train" / "emu" / "000.png", outside)
    (root / "test" / "emu" / "link.png").symlink_to(outside)
    dataset = sources.load(f"folder:{root}")
    assert len(dataset.train_features) == 24 and len(dataset.test_features) == 6
    assert dataset.notes == (
        f"--dataset=folder:{root}: 3 entries with an image's name skipped: not a regular file "
        "(a FIFO, a folder) or a link out of the folder: test/emu/link.png, train/cat/x.png, "
        "train/dog/y.png",)

    small = np.zeros((3, 5, 3), np.uint8)
    for kind, encoded in (("png", tf.io.encode_png(small)), ("jpg", tf.io.encode_jpeg(small))):
        (tmp_path / f"s.{kind}").write_bytes(encoded.numpy())
        assert folder.pixels_in_header(str(tmp_path / f"s.{kind}")) == (5, 3)
    (tmp_path / "s.gif").write_bytes(b"GIF89a\x05\x00\x03\x00" + b"\x00" * 20)
    (tmp_path / "s.bmp").write_bytes(b"BM" + b"\x00" * 16 + (5).to_bytes(4, "little")
                                     + (-3).to_bytes(4, "little", signed=True) + b"\x00" * 8)
    assert [folder.pixels_in_header(str(tmp_path / f"s.{k}")) for k in ("gif", "bmp")] == [
        (5, 3), (5, 3)]
    bomb = root / "train" / "dog" / "bomb.png"  # a real PNG header: 20000 x 20000 pixels
    header = bytearray(tf.io.encode_png(small).numpy())
    header[16:24] = (20000).to_bytes(4, "big") + (20000).to_bytes(4, "big")
    bomb.write_bytes(bytes(header))
    with pytest.raises(DataError, match=re.escape(
            f"{bomb} is 20000x20000 pixels, more than the 89,478,485 tfmulti decodes")):
        sources.load(f"folder:{root}")
