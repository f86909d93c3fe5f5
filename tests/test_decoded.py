"""Training examples that stay in files and do not fit in memory, decoded once into a file
of the user's cache and mapped into memory: the run trains on it as on the same examples in
memory (the same weights), a later run reads the same file again, a changed file makes
another, a truncated one is decoded again, processes killed while decoding leave nothing a
run reads and their temporary files are removed, and two processes decoding at once each end
with the whole file."""
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from test_resume import environment
from test_userdata import CLASSES, write_folder

from tfmulti.data import sources
from tfmulti.decoded import dataonce, ondisk
from tfmulti.run.config import RunConfig
from tfmulti.training import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    """A cache of its own, and memory too small for any decoded set."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(dataonce, "MEMORY_SHARE", 1e-12)
    return tmp_path / "cache" / "tfmulti" / "decoded"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_folder(tmp_path_factory.mktemp("decoded") / "images", per_class=(24, 4))


def cached_files(cache):
    return sorted(p.name for p in cache.iterdir()) if cache.exists() else []


def test_a_folder_too_big_for_memory_trains_from_its_decoded_file_as_from_memory(
        folder, cache, one_replica, tmp_path, capsys, monkeypatch):
    row = 20 * 24 * 3  # an image's bytes: written 5 at a time, synced every 2 chunks
    monkeypatch.setattr(ondisk, "CHUNK_BYTES", 5 * row)
    monkeypatch.setattr(ondisk, "SYNC_BYTES", 7 * row)
    dataset = sources.load(f"folder:{folder}")
    on_disk = dataonce.for_run(dataset, True, verbose=True)
    said = capsys.readouterr().out
    assert isinstance(on_disk.train_features, ondisk.MappedExamples)
    assert "training images decoded once into" in said and "mapped into memory" in said
    [name] = cached_files(cache)
    in_memory = np.asarray(dataset.train_features)
    np.testing.assert_array_equal(np.asarray(on_disk.train_features), in_memory)
    np.testing.assert_array_equal(on_disk.train_features[[5, 0, 17], 3:5],
                                  in_memory[[5, 0, 17], 3:5])
    copy = pickle.loads(pickle.dumps(on_disk.train_features.subset(np.array([3, 1]))))
    np.testing.assert_array_equal(np.asarray(copy), in_memory[[3, 1]])
    import dataclasses

    cfg = RunConfig(model="lenet", width=2, epochs=2, global_batch_size=16, seed=1,
                    deterministic=True, validation_split=0.2, dataset=dataset.name)
    runs = {"memory": dataclasses.replace(dataset, train_features=in_memory), "disk": on_disk}
    histories = {}
    for kind, data in runs.items():
        (tmp_path / kind).mkdir()
        histories[kind] = train.train_and_evaluate(one_replica, data, cfg, write_model=False,
                                                   model_dir=str(tmp_path / kind))[1]
    keys = ("loss", "train_acc", "val_loss", "val_acc", "test_loss", "test_acc")
    assert ([{k: r[k] for k in keys} for r in histories["memory"]]
            == [{k: r[k] for k in keys} for r in histories["disk"]])

    again = dataonce.for_run(sources.load(f"folder:{folder}"), True, verbose=True)
    assert "decoded once by an earlier run" in capsys.readouterr().out
    assert again.train_features.path == on_disk.train_features.path
    assert cached_files(cache) == [name]


def test_a_changed_file_makes_another_and_a_truncated_one_is_decoded_again(
        tmp_path, cache, capsys):
    images = write_folder(tmp_path / "images", per_class=(6, 2))
    first = dataonce.for_run(sources.load(f"folder:{images}"), True, verbose=False)
    path = first.train_features.path
    os.truncate(path, os.path.getsize(path) - 100)  # a real truncated file
    again = dataonce.for_run(sources.load(f"folder:{images}"), True, verbose=True)
    assert "decoded once into" in capsys.readouterr().out
    assert again.train_features.path == path
    np.testing.assert_array_equal(np.asarray(again.train_features),
                                  np.asarray(sources.load(f"folder:{images}").train_features))
    one = next((images / "train").glob("*/000.png"))
    one.write_bytes(one.read_bytes())  # the same pixels, a new time: another file
    os.utime(one, ns=(time.time_ns(), time.time_ns() + 10**9))
    changed = dataonce.for_run(sources.load(f"folder:{images}"), True, verbose=False)
    assert changed.train_features.path != path and len(cached_files(cache)) == 2


def test_without_room_on_disk_the_files_are_read_and_the_run_says_why(folder, cache,
                                                                      monkeypatch):
    monkeypatch.setattr(ondisk, "DISK_SHARE", 1e-12)
    dataset = dataonce.for_run(sources.load(f"folder:{folder}"), True, verbose=True)
    assert not isinstance(dataset.train_features, ondisk.MappedExamples)
    assert "read from their files by the run" in dataset.reading
    assert "nor onto disk: decoded, they would take" in dataset.reading
    assert cached_files(cache) == []
    off = dataonce.for_run(sources.load(f"folder:{folder}"), False, verbose=True)
    assert "(--nodecode_once)" in off.reading


IMAGE_BYTES = 20 * 24 * 3  # write_folder's images


DECODE = textwrap.dedent('''
    import os
    import sys
    import time
    from tfmulti.data import sources
    from tfmulti.decoded import ondisk
    if len(sys.argv) > 2 and sys.argv[2]:
        ondisk.CHUNK_BYTES = int(sys.argv[2])
    while len(sys.argv) > 3 and not os.path.exists(sys.argv[3]):  # imported: waits for "go"
        time.sleep(0.002)
    mapped, said = ondisk.decoded_file(sources.load("folder:" + sys.argv[1]))
    print(said, flush=True)
    print(mapped.path if mapped is not None else "none", flush=True)
''')


def decoding(folder, cache_home, chunk_bytes=None, go=None):
    """A process that decodes folder's training images into the cache at cache_home (written
    chunk_bytes at a time: ondisk.CHUNK_BYTES unless given), once the file `go` is there
    (when given: it waits for it after its imports)."""
    return subprocess.Popen([sys.executable, "-c", DECODE, str(folder),
                             *([str(chunk_bytes or "")] if chunk_bytes or go else []),
                             *([str(go)] if go else [])], cwd=ROOT,
                            env={**environment(), "XDG_CACHE_HOME": str(cache_home)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.soak  # make soak: two processes decoding, 14 s
def test_two_processes_decoding_at_once_each_end_with_the_whole_file(folder, tmp_path,
                                                                      monkeypatch):
    """This process and a child decode the same folder into one cache. The overlap is made,
    not timed: the child, imported, waits for a "go" file, which this process makes once its
    own temporary file holds its first chunk; this process then writes no further until the
    child's temporary file (or the file it renamed it to) is there. Both decode (neither finds
    the other's file whole), end with the whole file, and leave no temporary file."""
    go = tmp_path / "go"
    child = decoding(folder, tmp_path, go=go)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(ondisk, "CHUNK_BYTES", 5 * IMAGE_BYTES)  # several chunks, each synced
    monkeypatch.setattr(ondisk, "SYNC_BYTES", IMAGE_BYTES)
    cache = tmp_path / "tfmulti" / "decoded"
    synced, paused = ondisk.written, []

    def written_then_overlapped(out):
        synced(out)
        if paused:
            return
        final = out.name.rsplit(".tmp-", 1)[0]

        def child_decodes():
            return os.path.exists(final) or any(
                name.endswith(f"-{child.pid}") for name in cached_files(cache))

        go.touch()
        deadline = time.monotonic() + 240
        while not child_decodes():
            if child.poll() is not None and not child_decodes():
                pytest.fail(f"the child ended without decoding: {child.communicate()}")
            assert time.monotonic() < deadline, "the child never started decoding"
            time.sleep(0.001)
        paused.append(final)

    monkeypatch.setattr(ondisk, "written", written_then_overlapped)
    try:
        mapped, said = ondisk.decoded_file(sources.load(f"folder:{folder}"))
        out, err = child.communicate(timeout=300)
    finally:
        if child.poll() is None:  # this process failed first: the child waits for nothing
            child.kill()
            child.communicate()
    assert child.returncode == 0, err
    assert paused == [mapped.path]  # this process paused mid-file while the child decoded
    assert "decoded once into" in said and "decoded once into" in out.splitlines()[-2], out
    paths = {out.splitlines()[-1], mapped.path}
    assert len(paths) == 1
    [path] = paths
    assert cached_files(cache) == [os.path.basename(path)]  # no temporary file left
    expected = np.asarray(sources.load(f"folder:{folder}").train_features)
    np.testing.assert_array_equal(np.asarray(ondisk.whole(path, expected.shape, np.uint8)),
                                  expected)


@pytest.mark.soak  # make soak (make test keeps a disk without room and a truncated file, above)
def test_a_write_that_fails_part_way_leaves_no_file_and_the_run_reads_the_files(folder,
                                                                                tmp_path):
    """A real write failure in the middle of the decoded file: the decoder's files may not
    grow past 40 KB (RLIMIT_FSIZE; the write fails with EFBIG, as on a full disk with
    ENOSPC): it says the file could not be written, and leaves nothing in the cache."""
    import resource

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (40_000, 40_000))

    process = subprocess.Popen([sys.executable, "-c", DECODE, str(folder), "8000"], cwd=ROOT,
                               env={**environment(), "XDG_CACHE_HOME": str(tmp_path)},
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=small_files)
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err
    said, mapped = out.strip().splitlines()[-2:]
    assert mapped == "none" and "could not be written (File too large)" in said, out
    assert cached_files(tmp_path / "tfmulti" / "decoded") == []


MANY = 4000  # training images a class: 12000, 17 MB decoded


@pytest.fixture(scope="module")
def many(tmp_path_factory):
    return write_folder(tmp_path_factory.mktemp("many") / "images", per_class=(MANY, 1))


@pytest.mark.soak  # 15 s each: make test keeps its budget (the truncated file is there)
@pytest.mark.parametrize("share", [0.0, 0.5])
def test_a_process_killed_while_decoding_leaves_nothing_a_run_reads(many, tmp_path, share):
    """kill -9 once its temporary file is there, and once it holds half the images (written
    100 at a time): no decoded file, and the next process removes the temporary one and
    decodes. (The moments are the file's, not the clock's: 12000 small PNGs decode in about
    a second on a fast CPU.)"""
    cache = tmp_path / "tfmulti" / "decoded"
    total = len(CLASSES) * MANY * IMAGE_BYTES
    process = decoding(many, tmp_path, chunk_bytes=100 * IMAGE_BYTES)
    deadline = time.monotonic() + 120

    def temporary_holds():  # bytes written so far, or None while there is no file
        for name in cached_files(cache):
            if ".tmp-" in name:
                try:
                    return (cache / name).stat().st_size
                except FileNotFoundError:
                    return None
        return None

    while (temporary_holds() or -1) < share * total:
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.002)
    process.send_signal(signal.SIGKILL)
    process.wait(30)
    assert process.returncode == -signal.SIGKILL, "it ended before it was killed"
    left = cached_files(cache)
    assert len(left) == 1 and ".tmp-" in left[0]
    assert (cache / left[0]).stat().st_size < total  # killed part way
    again = decoding(many, tmp_path)
    out, err = again.communicate(timeout=300)
    assert again.returncode == 0, err
    assert cached_files(cache) == [os.path.basename(out.splitlines()[-1])]


def test_the_doctors_line_says_what_the_cache_holds(tmp_path):
    from tfmulti import caches

    root = tmp_path / "tfmulti"
    assert caches.describe(str(root)) == f"{root}: empty"
    (root / "decoded").mkdir(parents=True)
    (root / "decoded" / "decoded-ab.raw").write_bytes(b"x" * 3 * 2**20)
    (root / "index").mkdir()
    for name in ("index-1.npz", "index-2.npz"):
        (root / "index" / name).write_bytes(b"x" * 2**19)
    (root / "xla.json").write_text("{}")
    assert caches.describe(str(root)) == (
        f"{root}: XLA verdicts: 1 file, 0.0 MB, decoded examples: 1 file, 3.0 MB, record "
        "indexes: 2 files, 1.0 MB (made again from your files when deleted)")
