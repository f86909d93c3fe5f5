"""Data read from its files by index: TFRecord shards written here with a parse function of
the user's, and a tensorflow-datasets set prepared here as TFRecord and as ArrayRecord. Each
trains as the same examples in memory do (1 and 2 replicas, 2 workers), resumes bit for bit
after kill -9, and a bad file or function is one line."""
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf
from test_multiworker import environment
from test_resume import killed_when_saved, weights
from test_userdata import TFDS_BUILDER

from tfmulti.data import sources, synthetic
from tfmulti.errors import DataError, UsageError, UserError
from tfmulti.run.config import RunConfig
from tfmulti.training import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN, TEST = 192, 48  # synthetic images written as records
SHARDS = 3  # training files: fewer than some worker counts, more than others

PARSE = '''
import tensorflow as tf

FEATURES = {"image": tf.io.FixedLenFeature([], tf.string),
            "label": tf.io.FixedLenFeature([], tf.int64)}


def parse(serialized):
    example = tf.io.parse_single_example(serialized, FEATURES)
    return tf.reshape(tf.io.decode_raw(example["image"], tf.uint8), [28, 28]), example["label"]


def raises(serialized):
    raise ValueError("this record format is not mine")


def three(serialized):
    image, label = parse(serialized)
    return image, label, label


def named(serialized):
    image, label = parse(serialized)
    return {"pixels": image}, label


def cnn(input_shape, num_classes):  # a user's model with a random layer
    import keras
    inputs = keras.Input(input_shape)  # the images as parse returns them: uint8 [28, 28]
    x = keras.layers.Reshape((28, 28, 1))(keras.layers.Rescaling(1 / 255)(inputs))
    x = keras.layers.Conv2D(4, 3, activation="relu")(x)
    x = keras.layers.Dropout(0.25)(keras.layers.Flatten()(x))
    return keras.Model(inputs, keras.layers.Dense(num_classes)(x))
'''


def write_records(path, images, labels):
    with tf.io.TFRecordWriter(str(path)) as writer:
        for image, label in zip(images, labels):
            writer.write(tf.train.Example(features=tf.train.Features(feature={
                "image": tf.train.Feature(bytes_list=tf.train.BytesList(value=[image.tobytes()])),
                "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[int(label)])),
            })).SerializeToString())


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """(folder, in-memory twin): the synthetic set's first TRAIN/TEST images as TFRecord
    shards (train-0000X-of-00003, test-00000-of-00001) and its parse function, my_records."""
    folder = tmp_path_factory.mktemp("records")
    (x, y), (tx, ty) = synthetic.make_dataset(TRAIN, TEST, 5)
    for i, part in enumerate(np.array_split(np.arange(TRAIN), SHARDS)):
        write_records(folder / f"train-{i:05d}-of-{SHARDS:05d}", x[part], y[part])
    write_records(folder / "test-00000-of-00001", tx, ty)
    (folder / "my_records.py").write_text(PARSE)
    return folder, ((x, y), (tx, ty))


@pytest.fixture()
def on_path(shards, monkeypatch):
    monkeypatch.syspath_prepend(str(shards[0]))
    return shards[0]


def spec(folder):
    return f"tfrecord:{folder}/train-*,{folder}/test-*"


def test_tfrecord_shards_are_read_by_index_as_the_examples_written(shards, on_path):
    folder, ((x, y), (tx, ty)) = shards
    dataset = sources.load(spec(folder), parse="my_records:parse")
    assert dataset.images and dataset.input_shape == (28, 28, 1)
    assert dataset.class_names == tuple(str(i) for i in range(10))
    assert "4 TFRecord files" in dataset.source and "read by index" in dataset.source
    np.testing.assert_array_equal(dataset.train_targets, y)
    np.testing.assert_array_equal(np.asarray(dataset.test_targets), ty)
    np.testing.assert_array_equal(dataset.train_features[[5, 150, 64]], x[[5, 150, 64], ..., None])
    np.testing.assert_array_equal(np.asarray(dataset.test_features)[..., 0], tx)
    resized = sources.load(spec(folder), parse="my_records:parse", image_size=(14, 14))
    assert resized.input_shape == (14, 14, 1) and resized.train_features[:2].shape == (2, 14, 14, 1)
    given = sources.load(spec(folder), parse="my_records:parse", as_given=True)
    assert given.images_as_given and given.example_word == "images"  # your model's images


def test_scanning_records_runs_no_autotuning(shards, on_path, tmp_path, monkeypatch, iterated):
    """Records scanned for their index (a cache of its own, so they are) without tf.data's
    autotuning, which can make freeing the iterator wait up to a minute."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    sources.load(spec(shards[0]), parse="my_records:parse")
    assert len(iterated) >= 4 and set(iterated) == {False}, iterated


@pytest.mark.parametrize("replicas", ["one_replica",  # two replicas in make soak (32 s on
                                      pytest.param("two_replicas", marks=pytest.mark.soak)])
# the slower kind's stand-in, against 12 s)
def test_records_train_step_for_step_as_the_same_examples_in_memory(
        shards, on_path, replicas, request, tmp_path):
    """The stream is the same pure function of (seed, epoch, step) whether the examples are
    read from their files or from memory: the same losses, the same weights; and a validation
    share held out of records is the one held out of the arrays."""
    folder, ((x, y), (tx, ty)) = shards
    strategy = request.getfixturevalue(replicas)
    from tfmulti.data.dataset import DataSet

    arrays = DataSet("twin", "memory", x, y, tx, ty)
    records = sources.load(spec(folder), parse="my_records:parse")
    cfg = RunConfig(model="lenet", width=2, epochs=2, global_batch_size=32, seed=4,
                    deterministic=True, validation_split=0.25)
    for name in ("memory", "records"):
        (tmp_path / name).mkdir()
    results = [train.train_and_evaluate(strategy, data, cfg, model_dir=str(tmp_path / name))
               for name, data in (("memory", arrays), ("records", records))]
    keys = ("loss", "test_loss", "val_loss", "val_examples", "test_examples")
    memory, read = ([{k: r[k] for k in keys} for r in history] for _, history in results)
    assert read[-1]["val_examples"] == memory[-1]["val_examples"] > 0
    assert memory == read
    prints = [json.loads((tmp_path / n / "metrics.json").read_text())["weights_fingerprints"]
              for n in ("memory", "records")]
    assert prints[0] == prints[1]


# make soak (35-41 s): make test keeps test_resume_yours's kill -9 mid-epoch (the same resume
# path: the step is the data position whatever the source) and the in-process records tests
@pytest.mark.soak
def test_a_tfrecord_run_resumes_bit_for_bit_after_kill_9_mid_epoch(shards, tmp_path):
    """A user's model with Dropout, 12 steps an epoch (192 images at 16); killed after a
    checkpoint inside epoch 2. The runs read the records from their files (--nodecode_once);
    the rerun decodes them into memory (the default where they fit) and still ends bit for
    bit where the whole run did."""
    folder = shards[0]
    command = [sys.executable, "-m", "tfmulti.main", f"--dataset={spec(folder)}",
               "--parse=my_records:parse", "--model=my_records:cnn", "--cpu_replicas=2",
               "--global_batch_size=16", "--epochs=2", "--steps_per_call=1",
               "--checkpoint_steps=5", "--deterministic"]
    env = {**environment(), "PYTHONPATH": str(folder)}
    whole = subprocess.run([*command, "--nodecode_once", f"--model_dir={tmp_path}/whole"],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert "read by index" in json.loads((tmp_path / "whole" / "run.json").read_text())[
        "dataset_source"]
    assert "images read from their files by the run (--nodecode_once)" in whole.stdout
    step = killed_when_saved([*command, "--nodecode_once", f"--model_dir={tmp_path}/killed"], env,
                        tmp_path / "killed", lambda step: step > 12)
    again = subprocess.run([*command, f"--model_dir={tmp_path}/killed"], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"at step {step + 1}" in again.stdout
    assert f"{TRAIN} training images decoded once; the run reads them from memory" in again.stdout
    for a, b in zip(weights(tmp_path / "whole"), weights(tmp_path / "killed")):
        np.testing.assert_array_equal(a, b)
    # tfmulti.evaluate reads the run's records with the parse function the run recorded
    evaluated = subprocess.run([sys.executable, "-m", "tfmulti.evaluate",
                                f"--model_dir={tmp_path}/whole"], cwd=folder, env=env,
                               capture_output=True, text=True, timeout=300)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    last = json.loads((tmp_path / "whole" / "metrics.json").read_text())["epochs"][-1]
    result = json.loads((tmp_path / "whole" / "evaluation-train.json").read_text())
    assert result["accuracy"] == pytest.approx(last["test_acc"], abs=1e-6)
    assert result["examples"] == TEST
    other = tmp_path / "other"  # a parse module that is not the file the run recorded
    other.mkdir()
    (other / "my_records.py").write_text(PARSE + "\n# changed\n")
    refused = subprocess.run([sys.executable, "-m", "tfmulti.evaluate",
                              f"--model_dir={tmp_path}/whole"], cwd=other,
                             env={**env, "PYTHONPATH": str(other)}, capture_output=True,
                             text=True, timeout=300)
    assert refused.returncode == 1 and "names the parse function my_records:parse" in (
        refused.stderr), refused.stderr[-2000:]


def two_workers_end_as(reference, flags, env):
    """tfmulti.launch's 2 workers with these flags (--model_dir among them) end with the
    weights of the run in `reference`; returns what they said."""
    launched = subprocess.run([sys.executable, "-m", "tfmulti.launch", "--workers=2", "--",
                               *flags], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=300)
    assert launched.returncode == 0, (launched.stdout + launched.stderr)[-3000:]
    model_dir = next(f.split("=", 1)[1] for f in flags if f.startswith("--model_dir="))
    for a, b in zip(weights(reference), weights(model_dir)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    return launched.stdout


@pytest.mark.soak  # 24 s each: make soak; the suite compares records with memory on 2 replicas
@pytest.mark.parametrize("files", ["train-*", "train-00000-*"])
def test_two_workers_read_their_own_examples_as_two_replicas_do(shards, tmp_path, files):
    """Two workers on 3 training files, and on 1 (more workers than files): each reads its own
    slices of every global batch (by index, whatever the file count) and they end where a
    2-replica process ends."""
    folder = shards[0]
    run = [f"--dataset=tfrecord:{folder}/{files},{folder}/test-*", "--parse=my_records:parse",
           "--model=lenet",
           "--width=2", "--global_batch_size=16", "--epochs=1", "--deterministic",
           "--intra_op_threads=1"]
    env = {**environment(), "PYTHONPATH": str(folder)}
    single = subprocess.run([sys.executable, "-m", "tfmulti.main", *run, "--cpu_replicas=2",
                             f"--model_dir={tmp_path}/single"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    assert single.returncode == 0, single.stderr[-3000:]
    said = two_workers_end_as(tmp_path / "single", [*run, f"--model_dir={tmp_path}/workers"],
                              env)
    assert "weights: the same on all 2 workers" in said


# 21 s, a whole tuning session: make soak (make test keeps test_sessions' session and the
# records' decode-once in one process)
@pytest.mark.soak
def test_a_session_on_records_decodes_them_once_and_best_cfg_keeps_the_parse(shards,
                                                                           tmp_path):
    folder = shards[0]
    result = subprocess.run(
        [sys.executable, "-m", "tfmulti.tune", f"--dataset={spec(folder)}",
         "--parse=my_records:parse", "--model=lenet", "--width=2", "--cpu_replicas=1",
         "--epochs=1", "--max_trials=1", "--tune_batch_sizes=16",
         f"--model_dir={tmp_path}/session"], cwd=ROOT,
        env={**environment(), "PYTHONPATH": str(folder)}, capture_output=True, text=True,
        timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"{TRAIN} training images decoded once" in result.stdout
    best = (tmp_path / "session" / "best.cfg").read_text()
    assert "--parse=my_records:parse" in best and f"--dataset={spec(folder)}" in best


def corrupt(folder, target):
    """A copy of the shards with one training file spoiled as `target` says."""
    import shutil

    copy = folder.parent / f"{folder.name}-{target}"
    shutil.copytree(folder, copy, dirs_exist_ok=True)
    victim = copy / "train-00001-of-00003"
    data = bytearray(victim.read_bytes())
    if target == "flipped":
        data[len(data) // 2] ^= 0xFF  # a byte inside a record: its checksum fails
    elif target == "truncated":
        data = data[:len(data) - 100]  # cut inside the last record
    else:  # an empty shard
        data = bytearray()
    victim.write_bytes(bytes(data))
    return copy


@pytest.mark.parametrize("target, words", [
    ("flipped", r"train-00001-of-00003 cannot be read: .*(corrupted|checksum|crc)"),
    ("truncated", r"train-00001-of-00003 cannot be read: .*(truncated|corrupted)"),
    ("empty", r"train-00001-of-00003 holds no record \(a shard left empty"),
])
def test_a_spoiled_shard_is_one_line_naming_it(shards, on_path, target, words):
    with pytest.raises(DataError, match=words):
        sources.load(spec(corrupt(shards[0], target)), parse="my_records:parse")


@pytest.mark.parametrize("parse, error, words", [
    ("my_records:raises", UserError, "--parse=my_records:raises raised ValueError on a "
                                     "serialized record: this record format is not mine"),
    ("my_records:three", UserError, "--parse=my_records:three returned"),
    ("my_records:named", UserError, "a dict of named inputs is not read from records yet"),
    ("my_records:absent", UsageError, "my_records has no function 'absent'"),
])
def test_a_parse_function_that_cannot_serve_is_one_line(shards, on_path, parse, error, words):
    with pytest.raises(error, match=re.escape(words)):
        sources.load(spec(shards[0]), parse=parse)


def test_patterns_and_flags_that_cannot_be_are_one_line(shards, on_path):
    folder = shards[0]
    with pytest.raises(DataError, match="no file matches the eval pattern .*/nothing-"):
        sources.load(f"tfrecord:{folder}/train-*,{folder}/nothing-*", parse="my_records:parse")
    for settings, words in (
            ({"dataset": f"tfrecord:{folder}/train-*"}, "give tfrecord:TRAIN_FILES,EVAL_FILES"),
            ({"dataset": spec(folder)}, "give --parse=MODULE:FUNCTION"),
            ({"dataset": "synthetic", "parse": "a:b"}, "--parse=a:b reads TFRecord files"),
            ({"dataset": "synthetic", "eval_split": "test"}, "--eval_split=test: only a "
                                                             "tensorflow-datasets set"),
            ({"dataset": "tfds:x", "train_split": "train", "eval_split": "train"},
             "both train: a run is not judged on the examples it trained on")):
        with pytest.raises(UsageError, match=re.escape(words)):
            RunConfig(**settings)


@pytest.fixture()
def scans(monkeypatch):
    """The record files the indexing pass reads through (their names), as the test goes."""
    from tfmulti.data import records

    read = []
    for name in ("_scan_tfrecord", "_scan_array_record"):
        def counted(path, target, real=getattr(records, name)):
            read.append(os.path.basename(path))
            return real(path, target)

        monkeypatch.setattr(records, name, counted)
    return read


def kept_indexes(cache):
    return sorted((cache / "tfmulti" / "index").iterdir())


def test_the_index_of_records_is_kept_until_their_file_or_the_parse_function_changes(
        shards, tmp_path, monkeypatch, scans):
    import shutil

    folder, ((x, y), _) = tmp_path / "records", shards[1]
    shutil.copytree(shards[0], folder)
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.delitem(sys.modules, "my_records", raising=False)
    cache = tmp_path / "cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))

    def load():
        scans.clear()
        return sources.load(spec(folder), parse="my_records:parse")

    load()
    assert len(scans) == SHARDS + 1 and len(kept_indexes(cache)) == SHARDS + 1
    again = load()
    assert scans == []  # every file's index kept: none read through
    np.testing.assert_array_equal(again.train_targets, y)
    np.testing.assert_array_equal(again.train_features[[0, 100, TRAIN - 1]],
                                  x[[0, 100, TRAIN - 1], ..., None])
    # one file written again with one more record: that file alone is read through
    last = np.array_split(np.arange(TRAIN), SHARDS)[-1]
    write_records(folder / "train-00002-of-00003", x[[*last, 0]], y[[*last, 0]])
    grown = load()
    assert scans == ["train-00002-of-00003"]
    np.testing.assert_array_equal(grown.train_targets, np.concatenate([y, y[:1]]))
    np.testing.assert_array_equal(grown.train_features[[TRAIN, TRAIN - 1]], x[[0, -1], ..., None])
    # its kept index cut short on disk (a real truncation): read through again, the same
    newest = max(kept_indexes(cache), key=os.path.getmtime)
    newest.write_bytes(newest.read_bytes()[:newest.stat().st_size // 2])
    assert np.array_equal(load().train_targets, grown.train_targets)
    assert scans == ["train-00002-of-00003"]
    # the parse function's file changed: every target read again, as it now says
    (folder / "my_records.py").write_text(PARSE.replace(', example["label"]\n',
                                                        ', 9 - example["label"]\n', 1))
    monkeypatch.delitem(sys.modules, "my_records")
    assert np.array_equal(load().train_targets, 9 - grown.train_targets)
    assert len(scans) == SHARDS + 1
    # a cache that cannot be written (a file where its folder would be) stops nothing
    (tmp_path / "not-a-folder").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "not-a-folder"))
    assert np.array_equal(load().train_targets, 9 - grown.train_targets)
    assert len(scans) == SHARDS + 1


def scanned_together(path, me, other, folder):
    """Marks record file `path` read through by `me` (a file in `folder`), then waits until
    `other` has read it through too: neither keeps its index of it before both have read it."""
    import os
    import time

    name = os.path.basename(path)
    open(os.path.join(folder, f"{me}-{name}"), "w").close()
    deadline = time.monotonic() + 120
    while not os.path.exists(os.path.join(folder, f"{other}-{name}")):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{other} never read {name} through")
        time.sleep(0.001)


# The child of the test below: scanned_together's source, then this
INDEXING_CHILD = """
import hashlib, os, sys, time
sys.path.insert(0, {folder!r})
from tfmulti.data import records, sources

read = records._scan_tfrecord


def scan(path, target):
    found = read(path, target)
    scanned_together(path, "child", "test", {meet!r})
    return found


records._scan_tfrecord = scan
open({ready!r}, "w").close()  # imported
while not os.path.exists({go!r}):
    time.sleep(0.001)
d = sources.load({spec!r}, parse="my_records:parse")
print("TARGETS", hashlib.sha256(d.train_targets.astype("int32").tobytes()).hexdigest())
"""


@pytest.mark.soak  # make soak: several processes, 10 s (make test: one process's index in place)
def test_two_processes_indexing_the_same_records_at_once_keep_one_whole_index_each(
        shards, on_path, tmp_path, monkeypatch, scans):
    """A child process and this one index the same files into one cache at once: the child
    imports, says so and waits for a go file, which this process writes just before its own
    call; then each reads every file through and waits for the other to have read it too
    (scanned_together) before keeping its index, so both write each file's index at the same
    moment."""
    import hashlib
    import inspect

    from tfmulti.data import records

    folder, ((_, y), _) = shards
    meet, ready, go = tmp_path / "meet", tmp_path / "ready", tmp_path / "go"
    meet.mkdir()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the child's too
    code = inspect.getsource(scanned_together) + INDEXING_CHILD.format(
        folder=str(folder), meet=str(meet), ready=str(ready), go=str(go), spec=spec(folder))
    child = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=environment(),
                             text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    read = records._scan_tfrecord  # the scans fixture's: it counts the files read through

    def scan(path, target):
        found = read(path, target)
        scanned_together(path, "test", "child", str(meet))
        return found

    monkeypatch.setattr(records, "_scan_tfrecord", scan)
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert child.poll() is None and time.monotonic() < deadline, child.stderr.read()
            time.sleep(0.01)
        go.touch()
        here = sources.load(spec(folder), parse="my_records:parse")
        out, err = child.communicate(timeout=300)
    finally:
        child.kill()  # (nothing once it has ended)
    assert child.returncode == 0, err[-3000:]
    assert len(scans) == SHARDS + 1  # every file read through here, none taken from the child
    truth = hashlib.sha256(y.astype("int32").tobytes()).hexdigest()
    assert out.split("TARGETS ")[-1].strip() == truth
    np.testing.assert_array_equal(here.train_targets, y)
    kept = kept_indexes(tmp_path / "cache")
    assert len(kept) == SHARDS + 1 and all(p.name.endswith(".npz") for p in kept), kept
    for path in kept:  # each whole
        with np.load(path) as index:
            assert len(index["where"]) == len(index["targets"]) > 0


def test_a_bad_tfrecord_run_says_one_line_and_makes_nothing(shards, tmp_path, tool,
                                                            monkeypatch, one_replica):
    """The command in this process, as cli.main runs it."""
    folder = corrupt(shards[0], "flipped")
    monkeypatch.syspath_prepend(str(folder))
    code, _, err = tool("main", f"--dataset={spec(folder)}", "--parse=my_records:parse",
                        "--model=lenet", f"--model_dir={tmp_path}/run", strategy=one_replica)
    assert code == 1
    said = [line for line in err.splitlines() if line.startswith("tfmulti: error:")]
    assert len(said) == 1 and "train-00001-of-00003 cannot be read" in said[0], err
    assert "Traceback" not in err and not (tmp_path / "run").exists()


SERVICE = """
import time
import tensorflow as tf
service = tf.data.experimental.service
dispatcher = service.DispatchServer()
workers = [service.WorkerServer(service.WorkerConfig(
    dispatcher_address=dispatcher.target.split("://")[1])) for _ in range(2)]
print(dispatcher.target, flush=True)
while True:
    time.sleep(60)
"""


@pytest.fixture(scope="module")
def service_here():
    """A tf.data service (a dispatcher and two workers) in a process of its own, killed at
    the end: grpc://HOST:PORT. (Servers in the test's own process took up to a minute to
    stop under the suite's load, waiting for their tasks.)"""
    import select

    process = subprocess.Popen([sys.executable, "-c", SERVICE], cwd=ROOT, env=environment(),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ready, _, _ = select.select([process.stdout], [], [], 120)
    line = process.stdout.readline() if ready else ""
    if not line.startswith("grpc://"):
        process.kill()
        pytest.fail(f"the service did not start in 120 s: {process.communicate()[1][-2000:]}")
    yield line.strip()
    process.kill()
    process.wait(30)


@pytest.mark.soak  # make soak: a tf.data service and two readers, 8 s
def test_records_are_streamed_once_a_pass_to_the_workers_that_share_a_job(
        shards, on_path, service_here, monkeypatch):
    """Two training workers' pipelines (two consumers of one job) through two service
    workers: in each whole pass over the files every record of the split comes once, to one
    of them, and no record outside it (a held-out share) ever does."""
    from tfmulti.data import service

    folder, _ = shards
    monkeypatch.setattr(service, "FILES_AT_ONCE", 2)  # fewer than the 3 files: past it
    records = sources.load(spec(folder), parse="my_records:parse").train_features
    kept = np.sort(np.random.default_rng(0).permutation(TRAIN)[:150])  # 42 held out
    passes = 5
    streams = [iter(service.passes_of_records(records.subset(kept).files, seed=3, first=0)
                    .apply(tf.data.experimental.service.distribute(
                        processing_mode=tf.data.experimental.service.ShardingPolicy.DYNAMIC,
                        service=service_here, job_name="shared-by-two")))
               for _ in range(2)]
    seen = {}
    for turn in range(passes * len(kept)):
        got_pass, index, _ = next(streams[turn % 2])
        seen.setdefault(int(got_pass), []).append(int(index))
    for whole in (0, 1):  # 4 files in flight at most (2 workers x 2): passes 0, 1 are done
        assert sorted(seen[whole]) == list(range(len(kept))), whole
    for got in seen.values():
        assert len(got) == len(set(got)) and set(got) <= set(range(len(kept)))


def test_records_train_through_the_service_and_say_what_it_keeps(
        shards, on_path, service_here, one_replica, tmp_path, capsys):
    """TFRecord shards through the service: each batch's targets are its records' (the
    service reads them with their images), the run's first line and run.json say what the
    streamed order keeps, and it trains its epochs to the end."""
    from tfmulti.data import service

    folder, ((x, y), _) = shards
    dataset = sources.load(spec(folder), parse="my_records:parse")
    label_of = {image.tobytes(): label for image, label in zip(x, y)}
    served = service.served_records(dataset.train_features, lambda i: tf.gather(y, i), 8, 8,
                                    seed=1, start_step=0, service=service_here)
    for images, targets in served.take(30):
        assert [label_of[image[..., 0].tobytes()] for image in images.numpy()] == list(targets)
    cfg = RunConfig(model="lenet", width=4, epochs=3, global_batch_size=16, seed=2,
                    data_service=service_here.split("://")[1], dataset=dataset.name,
                    parse="my_records:parse")
    (tmp_path / "run").mkdir()
    _, history = train.train_and_evaluate(one_replica, dataset, cfg,
                                          model_dir=str(tmp_path / "run"))
    said = capsys.readouterr().out
    assert (f"Training batches from the tf.data service at {service_here.split('://')[1]}: "
            f"{service.STREAMED}") in said
    run_json = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run_json["data_service"]["guarantee"] == service.STREAMED
    assert [r["step"] for r in history] == [12, 24, 36]  # 192 records at 16 an epoch
    assert all(np.isfinite(r["loss"]) for r in history)


@pytest.mark.soak  # make soak: a tfds set through the service, 12 s (make test: records)
def test_a_tfds_set_in_tfrecord_files_is_streamed_by_the_service_slice_and_all(
        tfds_formats, service_here, one_replica, tmp_path):
    """tiny_shades prepared as TFRecord, its slice train[:75%] through the service: only
    the slice's records come (each once a pass), with their own labels, and a run trains."""
    from tfmulti.data import service

    data_dir = str(tfds_formats / "tfrecord")
    whole = sources.load("tfds:tiny_shades", data_dir=data_dir)
    sliced = sources.load("tfds:tiny_shades", data_dir=data_dir,
                          splits=("train[:75%]", "train[75%:]"))
    images = np.asarray(whole.train_features)
    index_of = {image.tobytes(): i for i, image in enumerate(images)}
    assert len(index_of) == len(images) == 40
    passes = {}
    for got_pass, index, record in service.passes_of_records(
            sliced.train_features.files, seed=0, first=0).take(90):  # three passes, here
        passes.setdefault(int(got_pass), []).append(int(index))
    assert [sorted(got) for got in passes.values()] == [list(range(30))] * 3
    served = service.served_records(sliced.train_features,
                                    lambda i: tf.gather(sliced.train_targets, i), 5, 5,
                                    seed=0, start_step=0, service=service_here)
    got = [(index_of[image.tobytes()], int(label))
           for batch, labels in served.take(12) for image, label in zip(batch.numpy(), labels)]
    assert {i for i, _ in got} <= set(range(30))  # the slice's first 30 of the file's 40
    assert all(label == whole.train_targets[i] for i, label in got)
    cfg = RunConfig(model="lenet", width=2, epochs=2, global_batch_size=6,
                    dataset="tfds:tiny_shades", data_service=service_here.split("://")[1])
    (tmp_path / "run").mkdir()
    _, history = train.train_and_evaluate(one_replica, sliced, cfg, model_dir=str(tmp_path / "run"))
    assert len(history) == 2


def test_the_workers_of_one_run_agree_on_their_job_and_two_runs_do_not(monkeypatch):
    """The job name each worker computes from its own TF_CONFIG: the same for both tasks of
    one cluster, another for another run folder, none for a process alone."""
    from tfmulti.data import service

    cluster = {"worker": ["localhost:2222", "localhost:2223"]}
    names = []
    for index in (0, 1):
        monkeypatch.setenv("TF_CONFIG", json.dumps(
            {"cluster": cluster, "task": {"type": "worker", "index": index}}))
        resolved = tf.distribute.cluster_resolver.TFConfigClusterResolver().cluster_spec()
        names.append(service.shared_job(resolved.as_dict(), "runs/a", 40))
    assert names[0] == names[1] and names[0].startswith("tfmulti-")
    assert service.shared_job(cluster, "runs/b", 40) != names[0]
    assert service.shared_job(cluster, "runs/a", 41) != names[0]
    assert service.shared_job(None, "runs/a", 40) is None
    assert service.shared_job({"worker": ["localhost:2222"]}, "runs/a", 40) is None


@pytest.mark.soak  # 2 training workers and 2 service workers, real processes
def test_two_workers_share_the_streamed_records_of_the_launchers_service(shards, tmp_path):
    folder = shards[0]
    done = subprocess.run(
        [sys.executable, "-m", "tfmulti.launch", "--workers=2", "--data_service_workers=2",
         "--", f"--dataset={spec(folder)}", "--parse=my_records:parse", "--model=lenet",
         "--width=2", "--global_batch_size=16", "--epochs=2", f"--model_dir={tmp_path}/run"],
        cwd=ROOT, env={**environment(), "PYTHONPATH": str(folder)}, capture_output=True,
        text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    from tfmulti.data import service

    assert service.STREAMED in done.stdout and "test acc:" in done.stdout
    assert "weights: the same on all 2 workers" in done.stdout
    epochs = json.loads((tmp_path / "run" / "metrics.json").read_text())["epochs"]
    assert [e["step"] for e in epochs] == [TRAIN // 16, 2 * TRAIN // 16]


@pytest.mark.soak  # make soak: a real process, 7 s
def test_array_records_with_the_data_service_are_one_line_and_make_nothing(
        tfds_formats, tmp_path):
    """ArrayRecord files are read through Python only: the service's workers could not."""
    result = subprocess.run(
        [sys.executable, "-m", "tfmulti.main", "--dataset=tfds:tiny_shades",
         f"--data_dir={tfds_formats / 'array_record'}", "--model=lenet",
         "--data_service=localhost:1", f"--model_dir={tmp_path}/run"],
        cwd=ROOT, env=environment(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "tfmulti: error: --data_service with --dataset=tfds:tiny_shades: its records are in "
        "ArrayRecord files, which only Python reads and the tf.data service's workers cannot; "
        "prepare the set as TFRecord (tensorflow-datasets: file_format='tfrecord'), or train "
        "without the service"]
    assert not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def tfds_formats(tmp_path_factory):
    """data_dirs with tiny_shades prepared as TFRecord and as ArrayRecord, by a process of
    their own."""
    folder = tmp_path_factory.mktemp("tfds_formats")
    (folder / "tiny_shades_builder.py").write_text(TFDS_BUILDER)
    subprocess.run([sys.executable, "-c", "import tiny_shades_builder as b\n"
                    f"b.TinyShades(data_dir={str(folder / 'tfrecord')!r}).download_and_prepare()\n"
                    f"b.TinyShades(data_dir={str(folder / 'array_record')!r}, "
                    "file_format='array_record').download_and_prepare()"],
                   cwd=folder, check=True, capture_output=True, timeout=300)
    return folder


@pytest.mark.soak  # both file formats trained; make test keeps test_userdata's tfds set (make soak)
def test_a_tfds_set_is_read_from_its_files_in_either_format(tfds_formats, one_replica, tmp_path,
                                                            scans):
    """tiny_shades (train 40, validation 12, test 10) as TFRecord and as ArrayRecord: the
    same images and labels as tensorflow-datasets gives, any split and slice, and the same
    training."""
    import tensorflow_datasets as tfds

    loaded = {kind: sources.load("tfds:tiny_shades", data_dir=str(tfds_formats / kind))
              for kind in ("tfrecord", "array_record")}
    truth = tfds.as_numpy(tfds.builder("tiny_shades", data_dir=str(tfds_formats / "tfrecord"))
                          .as_dataset("train", as_supervised=True, batch_size=-1))
    for dataset in loaded.values():
        assert "read from its files by index" in dataset.source
        np.testing.assert_array_equal(np.asarray(dataset.train_features), truth[0])
        np.testing.assert_array_equal(dataset.train_targets, truth[1])
    scans.clear()  # its files' index is kept from the load above: none read through
    sliced = sources.load("tfds:tiny_shades", data_dir=str(tfds_formats / "array_record"),
                          splits=("train[:75%]", "train[75%:]"))
    assert scans == []
    assert (len(sliced.train_features), len(sliced.test_features)) == (30, 10)
    np.testing.assert_array_equal(np.asarray(sliced.test_features), truth[0][30:])
    cfg = RunConfig(model="lenet", width=2, epochs=1, global_batch_size=8, deterministic=True,
                    dataset="tfds:tiny_shades")
    for kind in loaded:
        (tmp_path / kind).mkdir()
    histories = [train.train_and_evaluate(one_replica, dataset, cfg,
                                          model_dir=str(tmp_path / kind))[1]
                 for kind, dataset in loaded.items()]
    assert histories[0][-1]["loss"] == histories[1][-1]["loss"]


@pytest.mark.soak  # 70 s: make soak; the suite does both with TFRecord shards
def test_a_tfds_set_on_its_files_resumes_after_kill_9_and_trains_on_two_workers(
        tfds_formats, tmp_path):
    """tiny_shades as ArrayRecord, read from its files: killed mid-epoch (5 steps an epoch)
    and run again, it ends bit for bit as the run never stopped; two workers end where a
    2-replica process ends."""
    data = [f"--data_dir={tfds_formats / 'array_record'}", "--dataset=tfds:tiny_shades",
            "--model=lenet", "--width=2", "--global_batch_size=8", "--deterministic"]
    command = [sys.executable, "-m", "tfmulti.main", *data, "--cpu_replicas=2", "--epochs=3",
               "--steps_per_call=1", "--checkpoint_steps=2", "--nodecode_once"]
    env = environment()
    whole = subprocess.run([*command, f"--model_dir={tmp_path}/whole"], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=300)
    assert whole.returncode == 0, whole.stderr[-3000:]
    step = killed_when_saved([*command, f"--model_dir={tmp_path}/killed"], env,
                        tmp_path / "killed", lambda step: step > 5 and step % 5)
    again = subprocess.run([*command, f"--model_dir={tmp_path}/killed"], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and f"at step {step + 1}" in again.stdout, again.stderr[-3000:]
    for a, b in zip(weights(tmp_path / "whole"), weights(tmp_path / "killed")):
        np.testing.assert_array_equal(a, b)
    said = two_workers_end_as(tmp_path / "whole",
                              [*data, "--epochs=3", f"--model_dir={tmp_path}/workers"], env)
    assert "read by index from 1 training file" in said


def test_a_tfds_set_without_a_test_split_evaluates_its_validation_split(tfds_formats,
                                                                        tmp_path):
    """A set with train and validation only (ImageNet's form): evaluated on validation by
    default; --eval_split names another; a split it lacks names the ones it has."""
    import shutil

    data_dir = tmp_path / "no_test"
    shutil.copytree(tfds_formats / "array_record", data_dir)
    info = data_dir / "tiny_shades" / "1.0.0" / "dataset_info.json"
    record = json.loads(info.read_text())
    record["splits"] = [s for s in record["splits"] if s["name"] != "test"]
    info.write_text(json.dumps(record))
    dataset = sources.load("tfds:tiny_shades", data_dir=str(data_dir))
    assert len(dataset.test_features) == 12 and "train and validation" in dataset.source
    with pytest.raises(DataError, match=re.escape(
            "--eval_split=test: tfds:tiny_shades has no split 'test' (it has: train, "
            "validation)")):
        sources.load("tfds:tiny_shades", data_dir=str(data_dir), splits=("", "test"))
    cfg = dataclasses.replace(RunConfig(dataset="tfds:tiny_shades", data_dir=str(data_dir)),
                              train_split="train[:50%]")
    assert len(sources.load_for(cfg).train_features) == 20


def test_the_memory_a_process_may_use_counts_its_cgroups_limits(tmp_path):
    """A container's or a Slurm job's cgroup (v2, or v1's memory controller), or one above
    it, limits what decode-once may take; "max" and v1's unlimited value do not."""
    from tfmulti.decoded import dataonce

    machine = dataonce.memory_bytes(cgroups=str(tmp_path / "none"))
    v2 = tmp_path / "v2" / "job" / "step"
    v2.mkdir(parents=True)
    (v2 / "memory.max").write_text("max\n")
    (v2.parent / "memory.max").write_text(f"{3 * 2**30}\n")
    v1 = tmp_path / "v2" / "memory" / "slurm" / "uid_0" / "job_7"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    (v1.parent / "memory.limit_in_bytes").write_text(f"{2 * 2**30}\n")
    listed = tmp_path / "cgroup"
    listed.write_text("0::/job/step\n")
    assert dataonce.memory_bytes(str(listed), str(tmp_path / "v2")) == min(machine, 3 * 2**30)
    listed.write_text("9:cpu,cpuacct:/\n4:memory:/slurm/uid_0/job_7\n0::/\n")
    assert dataonce.memory_bytes(str(listed), str(tmp_path / "v2")) == min(machine, 2 * 2**30)
    listed.write_text("0::/\n")
    assert dataonce.memory_bytes(str(listed), str(tmp_path / "v2")) == machine


BIG_PARSE = '''
import numpy as np
import tensorflow as tf

WIDTH = 16384  # float32 features: 64 KB a record


def parse(serialized):
    example = tf.io.parse_single_example(serialized, {
        "x": tf.io.FixedLenFeature([], tf.string), "y": tf.io.FixedLenFeature([], tf.int64)})
    return tf.reshape(tf.io.decode_raw(example["x"], tf.float32), [WIDTH]), example["y"]


def in_memory():  # the same set as numpy arrays: what a cap must refuse
    def read(pattern):
        data = tf.data.TFRecordDataset(tf.io.gfile.glob(pattern)).map(parse).batch(1024)
        parts = list(data.as_numpy_iterator())
        return np.concatenate([x for x, _ in parts]), np.concatenate([y for _, y in parts])
    import os
    folder = os.path.dirname(os.path.abspath(__file__))
    return read(folder + "/train-*"), read(folder + "/test-*")


def linear(input_shape, num_classes):
    import keras
    inputs = keras.Input(input_shape)
    return keras.Model(inputs, keras.layers.Dense(num_classes)(inputs))
'''


def memory_cgroup(tmp_path, limit):
    """A cgroup of the memory controller (v2, else v1) holding at most `limit` bytes, and a
    function that moves the calling process into it (a Popen's preexec_fn)."""
    name = f"tfmulti-test-{os.getpid()}-{tmp_path.name}"
    v2 = "/sys/fs/cgroup"
    if "memory" in open(f"{v2}/cgroup.controllers").read().split() if os.path.exists(
            f"{v2}/cgroup.controllers") else False:
        folder, files = f"{v2}/{name}", {"memory.max": limit, "memory.swap.max": 0}
    else:
        folder, files = f"/sys/fs/cgroup/memory/{name}", {"memory.limit_in_bytes": limit}
    try:
        os.makedirs(folder, exist_ok=True)
        for file, value in files.items():
            with open(f"{folder}/{file}", "w") as f:
                f.write(str(value))
    except OSError as e:
        pytest.fail(f"this test caps a process's memory with a cgroup, which needs root (make "
                    f"soak runs as root): {e}")

    def join():
        with open(f"{folder}/cgroup.procs", "w") as f:
            f.write(str(os.getpid()))
    return folder, join


@pytest.mark.soak  # 1.5 GB written and read: make soak (as root, for the cgroup)
def test_a_set_three_times_larger_than_the_memory_cap_trains_to_the_end(tmp_path):
    """24,000 records of 64 KB (1.5 GB) under a 500 MB cgroup cap: too large to decode into
    memory, the run decodes them once into a file of its cache (said) and trains from it
    mapped into memory to the end; with --nodecode_once it reads them from their files each
    epoch to the end; the same examples as arrays from a function, under the same cap,
    cannot (the cap is real)."""
    rng = np.random.default_rng(0)
    for split, count, shards in (("train", 24000, 6), ("test", 2000, 1)):
        for shard in range(shards):
            with tf.io.TFRecordWriter(str(tmp_path / f"{split}-{shard:05d}")) as writer:
                for _ in range(count // shards):
                    label = int(rng.integers(0, 10))
                    x = rng.normal(0, 1, 16384).astype(np.float32)
                    x[label * 100:(label + 1) * 100] += 1.0
                    writer.write(tf.train.Example(features=tf.train.Features(feature={
                        "x": tf.train.Feature(bytes_list=tf.train.BytesList(value=[x.tobytes()])),
                        "y": tf.train.Feature(int64_list=tf.train.Int64List(value=[label]))}))
                        .SerializeToString())
    (tmp_path / "big.py").write_text(BIG_PARSE)
    cap = 500 * 2**20
    folder, join = memory_cgroup(tmp_path, cap)
    env = {**environment(), "PYTHONPATH": str(tmp_path),
           "XDG_CACHE_HOME": str(tmp_path / "cache")}
    common = [sys.executable, "-m", "tfmulti.main", "--model=big:linear", "--epochs=1",
              "--cpu_replicas=2", "--global_batch_size=256", "--steps_per_call=5"]
    try:
        records = [f"--dataset=tfrecord:{tmp_path}/train-*,{tmp_path}/test-*",
                   "--parse=big:parse"]
        for name, extra, said in (
                ("mapped", [], "24000 training examples decoded once into"),
                ("files", ["--nodecode_once"],
                 "examples read from their files by the run (--nodecode_once)")):
            capped = subprocess.run([*common, *records, *extra, f"--model_dir={tmp_path}/{name}"],
                                    cwd=tmp_path, env=env, preexec_fn=join,
                                    capture_output=True, text=True, timeout=1200)
            assert capped.returncode == 0, capped.stderr[-3000:]
            assert said in capped.stdout, capped.stdout[-3000:]
            metrics = json.loads((tmp_path / name / "metrics.json").read_text())
            assert metrics["epochs"][-1]["test_examples"] == 2000
        in_memory = subprocess.run([*common, "--dataset=big:in_memory",
                                    f"--model_dir={tmp_path}/in_memory"], cwd=tmp_path, env=env,
                                   preexec_fn=join, capture_output=True, text=True, timeout=1200)
        # killed by the cap (the kernel's SIGKILL), or out of memory
        assert in_memory.returncode == -signal.SIGKILL or "MemoryError" in in_memory.stderr or (
            "ResourceExhausted" in in_memory.stderr), (in_memory.returncode,
                                                        in_memory.stderr[-2000:])
    finally:
        subprocess.run(["rmdir", folder], capture_output=True)


def test_past_a_batch_of_the_check_and_of_the_index_the_first_bad_one_is_named(tmp_path,
                                                                                monkeypatch):
    """More files than one batch of the folder check (CHECK_BATCH) and more records in a
    file than one batch of the indexing pass (SCAN_BATCH): the first file that does not
    decode is named, whichever batch it is in, and every record is where the index says."""
    from tfmulti.data import folder, records

    image = tf.io.encode_png(np.full((4, 4, 1), 7, np.uint8)).numpy()
    paths = []
    for i in range(folder.CHECK_BATCH * 2 + 40):
        paths.append(str(tmp_path / f"{i:04d}.png"))
        (tmp_path / f"{i:04d}.png").write_bytes(image)
    assert folder.first_unreadable(paths, None, 1) is None
    for bad in (folder.CHECK_BATCH + 44, len(paths) - 1):  # a middle batch, the short last one
        (tmp_path / f"{bad:04d}.png").write_bytes(b"not a png")
    assert folder.first_unreadable(paths, None, 1) == folder.CHECK_BATCH + 44
    monkeypatch.setattr(records, "SCAN_BATCH", 64)  # the same code past it, with fewer records
    count = 64 * 3 + 5
    write_records(tmp_path / "many", np.arange(count * 784, dtype=np.int64).astype(np.uint8)
                  .reshape(count, 28, 28), np.arange(count) % 10)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "my_records.py").write_text(PARSE)
    files, labels = records.index_files("x", "tfrecord", [(str(tmp_path / "many"), 0, None)],
                                        lambda s: tf.cast(tf.io.parse_single_example(s, {
                                            "label": tf.io.FixedLenFeature([], tf.int64)})[
                                            "label"], tf.int32))
    np.testing.assert_array_equal(labels, np.arange(count) % 10)
    wanted = [0, 63, 64, 150, count - 1]
    parsed = [tf.io.parse_single_example(s, {"label": tf.io.FixedLenFeature([], tf.int64)})[
        "label"].numpy() for s in files.read(np.array(wanted))]
    assert parsed == [w % 10 for w in wanted]
