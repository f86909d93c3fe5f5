"""The cache (~/.cache/tfmulti) is the user's own: folders 0700, files 0600, and what
another user could have planted there is never read (#54 item 5). Each planted entry is a
real file: a record index that would change a run's labels (0, 1, ... read as 7), a decoded
copy, XLA's verdicts."""
import os
import shutil
import stat

import numpy as np
import pytest
import tensorflow as tf

from tfmulti import caches
from tfmulti.data import records
from tfmulti.decoded import ondisk
from tfmulti.training import xla

LABELS = np.array([0, 1] * 10)


@pytest.fixture()
def shard(tmp_path, monkeypatch):
    """A TFRecord file of 20 records labelled 0, 1, 0, 1, ... and a cache of its own."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = tmp_path / "train.tfrecord"
    with tf.io.TFRecordWriter(str(path)) as writer:
        for label in LABELS:
            writer.write(tf.train.Example(features=tf.train.Features(feature={
                "y": tf.train.Feature(int64_list=tf.train.Int64List(value=[int(label)]))}))
                .SerializeToString())
    return path


def label(serialized):
    return tf.io.parse_single_example(serialized, {"y": tf.io.FixedLenFeature([], tf.int64)})["y"]


def indexed(path):
    return records.index_files("test", "tfrecord", [(str(path), 0, None)], label, "labels")[1]


def mode(path):
    return stat.S_IMODE(os.lstat(path).st_mode)


def plant(kept, how, tmp_path):
    """A kept index for the file whose labels are all 7, put there `how`."""
    forged = tmp_path / "forged.npz"
    with np.load(kept) as got:
        np.savez(forged, where=got["where"], lengths=got["lengths"],
                 targets=np.full_like(got["targets"], 7))
    os.remove(kept)
    if how == "a link":
        os.symlink(forged, kept)
        return
    shutil.copy(forged, kept)
    if how == "writable by others":
        os.chmod(kept, 0o666)
    elif how == "offsets that do not fit the file":
        with np.load(forged) as got:
            np.savez(kept, where=got["where"] + 1, lengths=got["lengths"],
                     targets=got["targets"])
        os.chmod(kept, 0o600)


HOWS = ["writable by others", "a link", "offsets that do not fit the file"]


def test_the_cache_is_made_for_its_user_alone(shard):
    assert list(indexed(shard)) == list(LABELS)
    [kept] = os.listdir(caches.folder("index"))
    assert mode(caches.home()) == mode(caches.folder("index")) == 0o700
    assert mode(os.path.join(caches.folder("index"), kept)) == 0o600
    # a folder an earlier tfmulti made with the umask's mode: narrowed before it is used
    os.chmod(caches.folder("index"), 0o777)
    assert indexed(shard).tolist() == LABELS.tolist()
    assert mode(caches.folder("index")) == 0o700


@pytest.mark.parametrize("how", HOWS)
def test_a_planted_record_index_is_never_read(shard, tmp_path, how):
    """Labels 0, 1, ... with an index planted that says 7, 7, ...: not read (it was: a later
    run trained on the planted labels); the file is read through again."""
    indexed(shard)
    kept = records.kept_index_path("tfrecord", str(shard), "labels")
    plant(kept, how, tmp_path)
    assert indexed(shard).tolist() == LABELS.tolist()


def test_a_file_or_folder_of_another_user_is_not_trusted(shard, tmp_path):
    """As root (CI): an index planted as nobody's file (0644), then the index folder made
    nobody's: neither is read. As another user, who cannot give a file away: a file and a
    folder of root's are not trusted."""
    indexed(shard)
    kept = records.kept_index_path("tfrecord", str(shard), "labels")
    if os.getuid() != 0:
        assert not caches.trusted_file("/etc/passwd") and os.path.exists("/etc/passwd")
        assert not caches.own_folder("/etc")
        return
    plant(kept, "as it is", tmp_path)
    os.chown(kept, 65534, 65534)
    os.chmod(kept, 0o644)
    assert indexed(shard).tolist() == LABELS.tolist()
    os.chown(caches.folder("index"), 65534, 65534)
    assert not caches.own_folder(caches.folder("index"))
    assert indexed(shard).tolist() == LABELS.tolist()


def test_an_index_of_ones_own_that_fits_is_read_and_not_read_through(shard, monkeypatch):
    indexed(shard)
    monkeypatch.setattr(records, "_scan_tfrecord", lambda *a: pytest.fail("read through"))
    assert indexed(shard).tolist() == LABELS.tolist()


def test_a_cache_folder_that_is_a_link_is_not_used(shard, tmp_path):
    """tfmulti/ planted as a link to a folder elsewhere: nothing read from it or kept in it;
    the decoded copy is not made there either (one line says why) and XLA keeps no verdict."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.makedirs(os.path.dirname(caches.home()), exist_ok=True)
    os.symlink(elsewhere, caches.home())
    assert indexed(shard).tolist() == LABELS.tolist()
    assert not os.listdir(elsewhere)
    assert not xla.record_verdict("key", {"ratio": 2.0, "refused": "", "step_s": 1,
                                          "step_s_xla": 0.5})
    assert xla._read(xla.verdicts_path()) == {}
    assert not os.listdir(elsewhere)


def test_a_decoded_copy_is_its_users_alone_and_a_planted_one_is_not_mapped(tmp_path,
                                                                           monkeypatch):
    from tfmulti.data import sources

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    images = tmp_path / "images"
    for split, count in (("train", 6), ("test", 2)):
        for name in ("a", "b"):
            (images / split / name).mkdir(parents=True)
            for i in range(count):
                tf.io.write_file(str(images / split / name / f"{i}.png"), tf.io.encode_png(
                    tf.fill([4, 4, 1], tf.constant(40 * i, tf.uint8))))
    dataset = sources.load(f"folder:{images}")
    mapped, said = ondisk.decoded_file(dataset)
    assert "decoded once into" in said and mode(mapped.path) == 0o600
    truth = np.asarray(mapped).copy()
    os.chmod(mapped.path, 0o666)  # writable by others: what is in it now is not trusted
    with open(mapped.path, "r+b") as f:
        f.write(b"\xff" * 16)
    again, said = ondisk.decoded_file(dataset)
    assert "decoded once into" in said, said  # decoded anew, not mapped
    np.testing.assert_array_equal(np.asarray(again), truth)
