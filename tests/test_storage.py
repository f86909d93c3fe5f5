"""model_dir on any file system TensorFlow knows, shared by several processes at once."""
import json
import os
import re
import subprocess
import sys
import tempfile

import pytest

from tfmulti.distribution import storage
from tfmulti.errors import UsageError
from tfmulti.rundir import lifecycle, names

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Each process waits for the same moment, then repeats its part for `seconds`.
TOGETHER = """
import json, os, sys, time
from tfmulti.distribution import storage
from tfmulti.rundir import lifecycle
kind, path, barrier, seconds, me = (sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]),
                                    sys.argv[5])
expected = int(sys.argv[6])
from tfmulti import quiet
quiet.import_tensorflow()  # what storage uses, loaded before the clock starts
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
        lifecycle.prepare_model_dir(path)
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


def together(jobs, seconds=2.0):
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


def test_three_processes_check_one_model_dir_at_the_same_moment(tmp_path):
    """Workers (and tuning workers) all check the shared --model_dir at start-up. With one
    probe file for all, one process deleted it under another ("not writable")."""
    model_dir = str(tmp_path / "shared")
    os.makedirs(model_dir)
    counts = together([("probe", model_dir, str(i)) for i in range(3)], seconds=1.0)
    assert min(counts) > 50, counts  # they really overlapped, many times each
    assert os.listdir(model_dir) == []  # no probe left behind


@pytest.mark.soak  # make test keeps three processes probing one folder at once (above)
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
        lifecycle.prepare_model_dir(str(blocker))
    with pytest.raises(UsageError, match="is not writable"):
        lifecycle.prepare_model_dir(str(blocker / "run"))
    assert blocker.read_text() == "mine"


TFMULTIS_RUN_FILE = json.dumps({key: None for key in lifecycle.RUN_KEYS})  # its form


def test_only_the_chief_clears_with_overwrite(tmp_path):
    """--overwrite: only the chief deletes, and it says what it deletes."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / lifecycle.RUN_FILE).write_text(TFMULTIS_RUN_FILE)
    (run / ".scratch-worker-1-host-1-abc").mkdir()
    lifecycle.prepare_model_dir(str(run), overwrite=True, chief=False)
    assert sorted(os.listdir(run)) == [".scratch-worker-1-host-1-abc", "checkpoints",
                                       lifecycle.RUN_FILE]
    said = []
    lifecycle.prepare_model_dir(str(run), overwrite=True, say=said.append)
    assert os.listdir(run) == []
    assert said == [f"--overwrite: deleting the earlier run's checkpoints, run.json, "
                    f".scratch-worker-1-host-1-abc in {run}"]


@pytest.mark.parametrize("content", ['{"not": "tfmulti"}', "[1, 2]", "{half"])
def test_overwrite_keeps_a_folder_whose_run_json_another_program_wrote(tmp_path, content):
    """Sacred and other tools write run.json and metrics.json too: --overwrite deletes
    nothing in a folder whose run.json is not in tfmulti's form (or cannot be read), in one
    line."""
    folder = tmp_path / "experiment"
    (folder / "checkpoints").mkdir(parents=True)
    (folder / "checkpoints" / "theirs.ckpt").write_bytes(b"weights")
    (folder / "tensorboard").mkdir()
    (folder / names.METRICS_FILE).write_text('{"theirs": 1}')
    (folder / lifecycle.RUN_FILE).write_text(content)
    before = sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))
    with pytest.raises(UsageError, match="^--overwrite: .*run.json (is not a run.json of "
                                         "tfmulti \\(another program's\\?\\)|is unreadable "
                                         ".*), so nothing in --model_dir=.* is deleted; choose "
                                         "another --model_dir$"):
        lifecycle.prepare_model_dir(str(folder), overwrite=True, say=pytest.fail)
    assert sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) == before
    assert (folder / lifecycle.RUN_FILE).read_text() == content


def test_overwrite_refuses_a_folder_that_holds_no_run_and_keeps_everything(tmp_path):
    """--overwrite in a folder of someone's files that happen to carry a run's names
    (checkpoints/, metrics.json) but no run.json: refused, nothing deleted. An empty folder
    is fine."""
    folder = tmp_path / "photos"
    (folder / "checkpoints").mkdir(parents=True)
    (folder / "checkpoints" / "holiday.jpg").write_bytes(b"jpeg")
    (folder / names.METRICS_FILE).write_text("my numbers")
    with pytest.raises(UsageError, match=f"--overwrite: --model_dir={folder} holds no tfmulti "
                                         "run \\(no run.json\\), so nothing in it is deleted"):
        lifecycle.prepare_model_dir(str(folder), overwrite=True)
    assert (folder / "checkpoints" / "holiday.jpg").read_bytes() == b"jpeg"
    assert (folder / names.METRICS_FILE).read_text() == "my numbers"
    (tmp_path / "empty").mkdir()
    lifecycle.prepare_model_dir(str(tmp_path / "empty"), overwrite=True)
    with pytest.raises(UsageError, match="no run.json: not a tfmulti run's folder"):
        lifecycle.open_run(str(folder), {"config": {}})


def test_overwrite_never_leaves_the_folder_through_a_symbolic_link(tmp_path):
    """A run whose checkpoints/ and tensorboard/ are links to folders elsewhere, and whose
    saved_model/ holds a link to another folder: --overwrite removes the links, and what they
    point to survives whole."""
    precious = tmp_path / "precious"
    (precious / "deep").mkdir(parents=True)
    (precious / "deep" / "thesis.tex").write_text("years of work")
    run = tmp_path / "run"
    (run / names.SAVED_MODEL_DIR).mkdir(parents=True)
    (run / lifecycle.RUN_FILE).write_text(TFMULTIS_RUN_FILE)
    (run / "checkpoints").symlink_to(precious)
    (run / names.TENSORBOARD_DIR).symlink_to(precious / "deep")
    (run / names.SAVED_MODEL_DIR / "variables").symlink_to(precious)
    lifecycle.prepare_model_dir(str(run), overwrite=True)
    assert os.listdir(run) == []
    assert (precious / "deep" / "thesis.tex").read_text() == "years of work"


HOLD_LOCK = """
import sys, time
from tfmulti.rundir import lock
with lock.locked(sys.argv[1]):
    print("held", flush=True)
    time.sleep(600)
"""


def test_a_folder_in_use_is_refused_and_a_dead_holders_lock_taken_over(tmp_path):
    """Another process holds the run folder: in_use refuses in one line naming it, and
    --overwrite deletes nothing; once that process is killed with kill -9, the folder is
    taken at once."""
    import signal

    run = tmp_path / "run"
    run.mkdir()
    (run / lifecycle.RUN_FILE).write_text(TFMULTIS_RUN_FILE)
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(run)], cwd=ROOT,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(UsageError, match=(
                f"--model_dir={run} is in use by process {holder.pid} on \\S+ since "
                "[0-9-]+ [0-9:]+; wait for it to end, or stop it")):
            with lifecycle.in_use(str(run), overwrite=True):
                pass
        assert (run / lifecycle.RUN_FILE).exists()  # nothing deleted under the holder's feet
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(30)
    with lifecycle.in_use(str(run), overwrite=True) as folder:
        assert folder == str(run) and not (run / lifecycle.RUN_FILE).exists()


@pytest.mark.soak  # 2 real runs; the suite keeps the lock held by another real process above
def test_two_runs_started_at_once_in_one_folder_one_trains_one_is_refused(tmp_path):
    """Two real `tfmulti.main` with the same flags, started together: one trains to its end,
    the other stops in one line naming the first, and the first's report is whole."""
    flags = ["--dataset=synthetic", "--synthetic_train_size=4096", "--synthetic_test_size=256",
             "--model=lenet", "--width=4", "--global_batch_size=64", "--epochs=2",
             "--num_gpus=0", f"--model_dir={tmp_path / 'run'}"]
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    both = [subprocess.Popen([sys.executable, "-m", "tfmulti.main", *flags], cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for _ in range(2)]
    results = [(p.pid, p.returncode, out, err) for p, (out, err) in
               ((p, p.communicate(timeout=300)) for p in both)]
    codes = sorted(code for _, code, _, _ in results)
    assert codes == [0, 1], [(code, err[-500:]) for _, code, _, err in results]
    winner = next(pid for pid, code, _, _ in results if code == 0)
    refused = next(err for _, code, _, err in results if code == 1).strip().splitlines()
    assert re.fullmatch(f"tfmulti: error: --model_dir={tmp_path / 'run'} is in use by process "
                        f"{winner} on \\S+ since .*; wait for it to end, or stop it \\(its lock "
                        "is released when it ends\\)", refused[-1]), refused[-3:]
    metrics = json.loads((tmp_path / "run" / names.METRICS_FILE).read_text())
    assert [e["epoch"] for e in metrics["epochs"]] == [1, 2]


def planted(tmp_path, name):
    """A file of the user's, and a link to it planted at tmp_path/name (as another user who
    could write the folder would)."""
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's own")
    victim.chmod(0o600)
    (tmp_path / name).symlink_to(victim)
    return victim


def test_a_file_written_whole_replaces_a_planted_link_and_never_writes_through_it(tmp_path):
    """storage.write_json (run.json, metrics.json, session.json) and the caches' replacing:
    the link itself is replaced by the new file; what it pointed to is untouched."""
    victim = planted(tmp_path, "metrics.json")
    storage.write_json(str(tmp_path / "metrics.json"), {"epochs": []})
    assert victim.read_text() == "the user's own"
    assert not (tmp_path / "metrics.json").is_symlink()
    assert json.loads((tmp_path / "metrics.json").read_text()) == {"epochs": []}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.json", "victim.txt"]


def test_a_temporary_file_named_for_other_processes_is_never_made_through_a_link(tmp_path):
    """The decoded examples' and record indexes' temporary files carry a host and pid that
    others read: a link planted under that name is an error, never followed."""
    victim = planted(tmp_path, "index.npz.tmp-host-1")
    with pytest.raises(FileExistsError):
        storage.new_file(str(tmp_path / "index.npz.tmp-host-1"))
    assert victim.read_text() == "the user's own"


@pytest.mark.parametrize("kind", ["link", "hard link"])
def test_a_planted_lock_file_is_refused_in_one_line_and_its_target_untouched(tmp_path, kind):
    """The run folder's .tfmulti-lock, planted as a link to a file of the user's (a folder
    another user made first): the run is refused in one line, the file keeps its bytes (the
    lock used to be truncated and rewritten through the link)."""
    folder = tmp_path / "run"
    folder.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's own")
    if kind == "link":
        (folder / ".tfmulti-lock").symlink_to(victim)
    else:
        os.link(victim, folder / ".tfmulti-lock")
    with pytest.raises(UsageError, match=f"^--model_dir={folder} cannot be locked: its "
                                         r"\.tfmulti-lock \(.+\) is not tfmulti's; remove it"):
        with lifecycle.in_use(str(folder)):
            pass
    assert victim.read_text() == "the user's own"


def test_a_workers_log_planted_as_a_link_is_not_written_through(tmp_path):
    """The supervisor's worker logs are opened with storage.own_file: never through a link."""
    victim = planted(tmp_path, "worker-1.log")
    with pytest.raises(OSError):
        storage.own_file(str(tmp_path / "worker-1.log"), os.O_WRONLY | os.O_APPEND)
    assert victim.read_text() == "the user's own"
    fd = storage.own_file(str(tmp_path / "worker-0.log"), os.O_WRONLY | os.O_APPEND)
    os.close(fd)
    assert (tmp_path / "worker-0.log").is_file()


def test_the_xla_verdicts_replace_a_planted_link(tmp_path, monkeypatch):
    """The XLA verdicts in a shared cache folder: a link planted as the verdict file is
    replaced, not written through; a link planted as its lock is refused."""
    from tfmulti.training import xla

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = xla.verdicts_path()
    os.makedirs(os.path.dirname(path))
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's own")
    os.symlink(victim, path)
    measured = {"ratio": 1.2, "refused": "", "step_s": 0.1, "step_s_xla": 0.08}
    assert xla.record_verdict("key", measured)
    assert victim.read_text() == "the user's own" and not os.path.islink(path)
    assert json.load(open(path))["key"]["ratio"] == 1.2
    os.unlink(path + ".lock")
    os.symlink(victim, path + ".lock")
    with pytest.raises(OSError):
        xla.record_verdict("key", measured)
    assert victim.read_text() == "the user's own"
