"""model_dir on any file system TensorFlow knows, shared by several processes at once."""
import json
import os
import subprocess
import sys
import tempfile

import pytest

from tfmulti.distribution import storage
from tfmulti.training import rundir
from tfmulti.errors import UsageError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Each process waits for the same moment, then repeats its part for `seconds`.
TOGETHER = """
import json, os, sys, time
from tfmulti.distribution import storage
from tfmulti.training import rundir
kind, path, barrier, seconds, me = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]), sys.argv[5]
expected = int(sys.argv[6])
import tensorflow  # noqa: F401  (what storage uses, loaded before the clock starts)
open(os.path.join(barrier, me), "w").close()  # imported: ready
deadline = time.time() + 300
while len(os.listdir(barrier)) < expected:  # every process ready, then all start together
    if time.time() > deadline:
        sys.exit("the other processes never became ready")
    time.sleep(0.001)
start = time.time()
count = 0
while time.time() < start + seconds:
    if kind == "probe":
        rundir.prepare_model_dir(path)
    elif kind == "write":
        # Lengths that differ by writer: a reader that sized its read by the path's length
        # (as GFile.read() does) instead of the file it opened gets cut short.
        storage.write_json(path, {"writer": me, "count": count,
                                  "pad": "x" * (20000 if me == "a" else 2000)})
    else:
        try:
            payload = storage.read_json(path)
        except OSError:
            continue  # not written yet
        assert set(payload) == {"writer", "count", "pad"}, payload
    count += 1
print(count)
"""


def together(jobs, seconds=3.0):
    """Runs (kind, path, name) jobs as processes that start at the same moment."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    barrier = tempfile.mkdtemp()  # each process marks itself ready there after its imports
    processes = [subprocess.Popen([sys.executable, "-c", TOGETHER, kind, path, barrier,
                                   str(seconds), name, str(len(jobs))], cwd=ROOT, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for kind, path, name in jobs]
    results = [p.communicate(timeout=120) for p in processes]
    for p, (out, err) in zip(processes, results):
        assert p.returncode == 0, err[-2000:]
    return [int(out.split()[-1]) for out, _ in results]


def test_four_processes_check_one_model_dir_at_the_same_moment(tmp_path):
    """Workers (and tuning workers) all check the shared --model_dir at start-up. With one
    probe file for all, one process deleted it under another ("not writable")."""
    model_dir = str(tmp_path / "shared")
    os.makedirs(model_dir)
    counts = together([("probe", model_dir, str(i)) for i in range(4)])
    assert min(counts) > 50  # they really overlapped, many times each
    assert os.listdir(model_dir) == []  # no probe left behind


def test_writers_and_a_reader_of_one_json_file(tmp_path):
    """Files are written whole under a name of the writer's own, then renamed: concurrent
    writers do not collide and a reader never sees half a file."""
    path = str(tmp_path / "metrics.json")
    counts = together([("write", path, "a"), ("write", path, "b"), ("read", path, "r")])
    assert min(counts) > 20
    assert json.loads(open(path).read())["writer"] in ("a", "b")
    assert os.listdir(tmp_path) == ["metrics.json"]


def test_in_memory_file_system_roundtrip():
    """ram:// behaves like an object store: no local path exists for it."""
    directory = "ram://storage-test/run"
    storage.check_writable(directory)
    storage.write_json(storage.join(directory, "a.json"), {"x": 1})
    storage.write_json(storage.join(directory, "a.json"), {"x": 2})
    assert storage.read_json(storage.join(directory, "a.json")) == {"x": 2}
    assert storage.listdir(directory) == ["a.json"]
    storage.remove(directory)
    assert not storage.exists(directory)
    assert not os.path.exists("ram:")


def test_model_dir_under_a_file_is_refused_in_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("mine")
    with pytest.raises(UsageError, match="is a file, not a directory"):
        rundir.prepare_model_dir(str(blocker))
    with pytest.raises(UsageError, match="is not writable"):
        rundir.prepare_model_dir(str(blocker / "run"))
    assert blocker.read_text() == "mine"


def test_only_the_chief_clears_with_overwrite(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / rundir.RUN_FILE).write_text("{}")
    (run / ".scratch-worker-1-host-1-abc").mkdir()
    rundir.prepare_model_dir(str(run), overwrite=True, chief=False)
    assert sorted(os.listdir(run)) == [".scratch-worker-1-host-1-abc", "checkpoints",
                                       rundir.RUN_FILE]
    rundir.prepare_model_dir(str(run), overwrite=True)
    assert os.listdir(run) == []
