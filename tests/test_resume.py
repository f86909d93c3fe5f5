"""Runs that survive faults: real processes, real signals, real checkpoint files."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tfmulti import cli
from tfmulti.errors import UsageError
from tfmulti.run.config import RunConfig
from tfmulti.rundir import lifecycle, names

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS_PER_EPOCH = 16  # 512 images, 2 replicas x 16
RUN = ["--dataset=synthetic", "--synthetic_train_size=512", "--synthetic_test_size=128",
       "--model=resnet18", "--width=8", "--per_replica_batch_size=16", "--epochs=2",
       "--steps_per_call=1", "--deterministic"]


LIGHT = ["--model=lenet", "--width=4"]  # where the model does not matter: a faster run


def command(model_dir, *extra, replicas=2):
    devices = [f"--cpu_replicas={replicas}"] if replicas > 1 else ["--num_gpus=0"]
    return [sys.executable, "-m", "tfmulti.main", *RUN, *devices, f"--model_dir={model_dir}",
            *extra]


def environment():
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run(model_dir, *extra, replicas=2):
    return subprocess.run(command(model_dir, *extra, replicas=replicas), cwd=ROOT,
                          env=environment(), capture_output=True, text=True, timeout=300)


def weights(model_dir):
    import keras

    import tfmulti.models.zoo  # noqa: F401  (registers the batch-norm layer)

    model = keras.saving.load_model(os.path.join(model_dir, names.MODEL_FILE))
    return model.get_weights()


def checkpoint_steps(model_dir):
    """The steps of the checkpoints the manager's state file lists (written atomically once a
    checkpoint is whole). A ckpt-N.index alone is a checkpoint killed before the manager
    listed it: the resume takes it too (lifecycle.saved_checkpoints)."""
    state = os.path.join(model_dir, lifecycle.CHECKPOINT_DIR, "checkpoint")
    try:
        with open(state) as f:
            text = f.read()
    except FileNotFoundError:
        return []
    return sorted(int(n) for n in re.findall(r'all_model_checkpoint_paths: "(?:.*/)?ckpt-(\d+)"',
                                             text))


def killed_when_saved(command, env, model_dir, wanted, cwd=ROOT):
    """Starts `command` and kill -9s it once its latest checkpoint's step is `wanted`
    (wanted(step) true); returns that step."""
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while time.time() < deadline and process.poll() is None:
        saved = checkpoint_steps(model_dir)
        if saved and wanted(saved[-1]):
            process.send_signal(signal.SIGKILL)
            break
        time.sleep(0.01)
    assert process.wait(60) == -signal.SIGKILL, "the run ended before it could be killed"
    return checkpoint_steps(model_dir)[-1]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted deterministic run on 2 replicas; its last two checkpoints (steps 24
    and 32, every 8 steps) are copied by the tests that break them."""
    model_dir = tmp_path_factory.mktemp("reference")
    result = run(model_dir, "--checkpoint_steps=8")
    assert result.returncode == 0, result.stderr
    return model_dir


@pytest.fixture(scope="module")
def light_reference(tmp_path_factory, two_replicas):
    """The same run with LeNet (width 4), in this process: for the tests where the model does
    not matter."""
    model_dir = tmp_path_factory.mktemp("light_reference")
    in_process(two_replicas, model_dir, "--checkpoint_steps=8", *LIGHT)
    return model_dir


# make soak runs these two and the SIGTERM run below; make test keeps the bit-for-bit resume
# after kill -9 of a model with every random layer (test_resume_yours.py), the in-process
# resume of every random layer (test_checkpointed.py), and test_config (stopped and resumed
# on 1 then 4 replicas) and test_multiworker (2 workers as 2 replicas) compare with
# uninterrupted runs.
@pytest.mark.soak
@pytest.mark.parametrize("replicas", [1, 2])
def test_deterministic_runs_give_identical_weights(reference, tmp_path, replicas):
    first = reference if replicas == 2 else tmp_path / "a"
    if replicas == 1:
        assert run(first, replicas=1).returncode == 0
    second = run(tmp_path / "b", replicas=replicas)
    assert second.returncode == 0, second.stderr
    for a, b in zip(weights(first), weights(tmp_path / "b")):
        np.testing.assert_array_equal(a, b)


@pytest.mark.soak
def test_kill_9_mid_epoch_resumes_at_the_next_step(reference, tmp_path):
    """A real kill -9 after a periodic checkpoint mid-epoch: the same command resumes at the
    next step and ends bit for bit where the uninterrupted run ends (make soak also kills a
    run past epoch 20)."""
    model_dir = tmp_path / "run"
    process = subprocess.Popen(command(model_dir, "--checkpoint_steps=3"), cwd=ROOT,
                               env=environment(), stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while time.time() < deadline and process.poll() is None:
        saved = checkpoint_steps(model_dir)
        if saved and saved[-1] % STEPS_PER_EPOCH and saved[-1] > 4:
            process.send_signal(signal.SIGKILL)
            break
        time.sleep(0.02)
    assert process.wait(60) == -signal.SIGKILL, "the run ended before it could be killed"
    killed_at = checkpoint_steps(model_dir)[-1]
    resumed = run(model_dir, "--checkpoint_steps=3")
    assert resumed.returncode == 0, resumed.stderr
    assert "Resuming the run" in resumed.stdout and "resumed at step" in resumed.stdout
    metrics = json.loads((model_dir / names.METRICS_FILE).read_text())
    assert [e["epoch"] for e in metrics["epochs"]] == [1, 2]
    assert metrics["epochs"][-1]["step"] == 2 * STEPS_PER_EPOCH
    # the epoch the rerun began mid-way is marked with the step it trained from
    assert [(e["epoch"], e["resumed_at_step"]) for e in metrics["epochs"]
            if "resumed_at_step" in e] == [(killed_at // STEPS_PER_EPOCH + 1, killed_at + 1)]
    for a, b in zip(weights(reference), weights(model_dir)):
        np.testing.assert_array_equal(a, b)  # the same as never having been killed
    print(f"killed after the checkpoint at step {killed_at}")


@pytest.mark.soak  # 37 s; the suite keeps the Ctrl-C run (the same stop, save and exit 75)
def test_sigterm_saves_and_exits_with_its_own_code(tmp_path):
    model_dir = tmp_path / "run"
    process = subprocess.Popen(command(model_dir, "--checkpoint_steps=0"), cwd=ROOT,
                               env=environment(), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    for line in process.stdout:
        if line.startswith("Epoch 1/2"):  # SIGTERM is handled from here: after the call under way
            process.send_signal(signal.SIGTERM)
            break
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 75, stderr
    message = stderr.strip().splitlines()[-1]
    assert message.startswith("tfmulti: stopped by SIGTERM at step ")
    step = int(message.split("at step ")[1].split(",")[0])
    assert 0 < step < 2 * STEPS_PER_EPOCH and checkpoint_steps(model_dir)[-1] == step
    # The same command resumes at the next step (test_kill_9... runs a resumed run to its end
    # and compares it bit for bit); a second SIGTERM once it trains saves again, further on.
    again = subprocess.Popen(command(model_dir, "--checkpoint_steps=0"), cwd=ROOT,
                             env=environment(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    seen = []
    for line in again.stdout:
        seen.append(line)
        if line.startswith("Epoch "):
            break
    again.send_signal(signal.SIGTERM)
    _, stderr = again.communicate(timeout=120)
    assert again.returncode == 75, stderr
    assert any(f"at step {step + 1}" in line and "Resuming the run" in line for line in seen), seen
    later = int(stderr.strip().splitlines()[-1].split("at step ")[1].split(",")[0])
    assert step <= later and checkpoint_steps(model_dir)[-1] == later


def test_a_second_ctrl_c_stops_at_once(monkeypatch):
    """Real SIGINTs to this process inside the run's stop handler: the first asks the run to
    stop (at a step the workers agree on, with a checkpoint), the second raises at once
    (cli turns it into one line and exit 130, as the start-up case below shows)."""
    from tfmulti.processes import ctrl_c
    from tfmulti.training import train

    monkeypatch.setattr(ctrl_c, "_arrived", [])
    said, before = [], signal.signal(signal.SIGINT, signal.default_int_handler)  # a terminal's
    with train.stop_on_request(say=said.append) as stop:
        assert stop() == ""
        os.kill(os.getpid(), signal.SIGINT)
        assert stop() == "Ctrl-C" and said[0].strip().startswith("Ctrl-C: stopping after")
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)  # the handler runs before this ends
    assert ctrl_c.arrived()  # kept, should TensorFlow's C++ have swallowed the exception
    ctrl_c._arrived.clear()
    with train.stop_on_request() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop() == "SIGTERM"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a job in the background: Ctrl-C is not its
    with train.stop_on_request() as stop:
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # left ignored
    signal.signal(signal.SIGINT, before)


def test_a_ctrl_c_tensorflow_swallows_or_turns_into_another_error_still_stops(monkeypatch,
                                                                              capsys):
    """Raised inside TensorFlow's C++, a Ctrl-C's KeyboardInterrupt has come out as a
    TypeError (its nest) or not at all, and the run trained to the end. A real SIGINT to this
    process, through the handler every tool installs once TensorFlow is imported, swallowed
    as TensorFlow did: the run stops before it trains, and an error that came out of it is
    the Ctrl-C's one line and exit 130."""
    from tfmulti import cli
    from tfmulti.processes import ctrl_c
    from tfmulti.training import train

    monkeypatch.setattr(ctrl_c, "_arrived", [])
    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # a terminal's
    try:
        ctrl_c.install()
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)  # the handler runs before this ends
        except KeyboardInterrupt:
            pass  # swallowed, as TensorFlow's C++ did
        with pytest.raises(KeyboardInterrupt), train.stop_on_request():
            pass
        with pytest.raises(SystemExit) as stopped:
            cli.handle(TypeError("what TensorFlow's nest made of it"))
        assert stopped.value.code == 130
        assert capsys.readouterr().err.strip() == cli.INTERRUPTED_LINE
        with pytest.raises(SystemExit) as chosen:  # an exit the tool chose stays its own
            cli.handle(SystemExit(3))
        assert chosen.value.code == 3
    finally:
        signal.signal(signal.SIGINT, before)


def test_ctrl_c_before_a_checkpoint_removes_the_folder_the_run_made(tmp_path, monkeypatch):
    """Ctrl-C after the run wrote run.json but before its first checkpoint (nothing trained)
    removes the folder this command made, run.json with it: the next command is a new run, not
    "a different run there". A folder with a checkpoint, or one that was there before, stays;
    so does one whose run was stopped by an error that is not a Ctrl-C."""
    import tensorflow as tf

    from tfmulti.processes import ctrl_c

    monkeypatch.setattr(ctrl_c, "_arrived", [])

    def started(name, checkpoint=False):
        folder = tmp_path / name
        (folder / "tensorboard").mkdir(parents=True)
        (folder / "run.json").write_text("{}")
        if checkpoint:
            tf.train.Checkpoint(step=tf.Variable(1)).save(str(folder / "checkpoints" / "ckpt"))
        return folder

    for name, checkpoint, existed, error, removed in [
            ("fresh", False, False, KeyboardInterrupt(), True),
            ("trained", True, False, KeyboardInterrupt(), False),
            ("there", False, True, KeyboardInterrupt(), False),
            ("failed", False, False, ValueError("not a Ctrl-C"), False)]:
        folder = started(name, checkpoint)
        with pytest.raises(type(error)), lifecycle.removed_if_refused(str(folder), existed):
            raise error
        assert folder.exists() != removed, name
    ctrl_c.record()  # a Ctrl-C TensorFlow turned into another error
    folder = started("turned")
    with pytest.raises(TypeError), lifecycle.removed_if_refused(str(folder), False):
        raise TypeError("what TensorFlow's nest made of it")
    assert not folder.exists()


def as_in_a_terminal():
    """A child's SIGINT as a terminal's foreground job has it (the test's own may be ignored,
    as pytest-xdist's workers ignore it, and an ignored signal is inherited)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def catches_sigint(pid):
    """Whether process pid has a handler of its own for SIGINT (/proc: SigCgt's bit 2)."""
    with open(f"/proc/{pid}/status") as f:
        mask = next(line.split()[1] for line in f if line.startswith("SigCgt:"))
    return bool(int(mask, 16) & (1 << (signal.SIGINT - 1)))


def test_ctrl_c_saves_and_says_how_to_go_on(tmp_path):
    """A real SIGINT (Ctrl-C) to a training run is treated as SIGTERM: a checkpoint at the
    step under way, one line, exit 75; during the start (TensorFlow importing) it stops at
    once in one line, exit 130. No traceback in either."""
    model_dir = tmp_path / "run"
    process = subprocess.Popen(command(model_dir, "--checkpoint_steps=0", *LIGHT), cwd=ROOT,
                               env=environment(), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, preexec_fn=as_in_a_terminal)
    for line in process.stdout:
        if line.startswith("Epoch 1/2"):
            process.send_signal(signal.SIGINT)
            break
    out, stderr = process.communicate(timeout=120)
    assert process.returncode == 75, stderr
    assert "Ctrl-C: stopping after the steps under way, with a checkpoint" in out
    message = stderr.strip().splitlines()[-1]
    assert message.startswith("tfmulti: stopped by Ctrl-C at step ") and message.endswith(
        "checkpoint saved; run the same command again to resume")
    step = int(message.split("at step ")[1].split(",")[0])
    assert checkpoint_steps(model_dir)[-1] == step and "Traceback" not in stderr
    # as the run's folder appears (made by this run, removed again: nothing was written in
    # it); make soak adds three moments while TensorFlow imports (below)
    ctrl_c_during_the_start(tmp_path, ("folder",))


@pytest.mark.soak  # make soak: 12 s (make test: as the folder appears, above)
def test_ctrl_c_early_in_the_start_and_late_in_it_stops_in_one_line(tmp_path):
    """A Ctrl-C inside an extension's import once came out as an ImportError's traceback."""
    ctrl_c_during_the_start(tmp_path, (0.2, 1.0, 3.0))


def ctrl_c_during_the_start(tmp_path, moments):
    """SIGINT at each of `moments` (seconds after Python handles SIGINT, or "folder": as the
    run's folder appears) into a run's start: it stops at once in one line, exit 130, and
    the folder it made is gone."""
    for moment in moments:
        early = subprocess.Popen(command(tmp_path / "early"), cwd=ROOT, env=environment(),
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 preexec_fn=as_in_a_terminal)
        deadline = time.monotonic() + 60
        while not catches_sigint(early.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        if moment == "folder":
            while not (tmp_path / "early").exists() and time.monotonic() < deadline:
                time.sleep(0.002)
        else:
            time.sleep(moment)
        sent = time.monotonic()
        early.send_signal(signal.SIGINT)
        out, stderr = early.communicate(timeout=120)
        assert early.returncode == 130 and "Traceback" not in stderr, (
            moment, early.returncode, stderr, out[-2000:], time.monotonic() - sent)
        assert stderr.strip().splitlines() == [cli.INTERRUPTED_LINE], (moment, stderr)
        assert not (tmp_path / "early").exists(), (moment, sorted(
            p.name for p in (tmp_path / "early").iterdir()))


FILL_AFTER_A_CHECKPOINT = """
mount -t tmpfs -o size=64m tmpfs "$DISK" || exit 90
"$@" --model_dir="$DISK/run" >"$LOGS/first.out" 2>"$LOGS/first.err" &
run=$!
until ls "$DISK"/run/$WAIT_FOR >/dev/null 2>&1 || ! kill -0 $run 2>/dev/null; do
  sleep 0.05
done
dd if=/dev/zero of="$DISK/fill" bs=1M >/dev/null 2>&1  # the disk is full from here
wait $run; echo "first exit $?"
ls "$DISK/run/checkpoints"
rm "$DISK/fill"  # space freed
"$@" --model_dir="$DISK/run" >"$LOGS/second.out" 2>"$LOGS/second.err"; echo "second exit $?"
"""


@pytest.mark.soak  # make soak: 35 s each (make test keeps under its 8 minutes)
@pytest.mark.parametrize("wait_for", [
    "checkpoints/*.index",  # filled after the first checkpoint
    "run.json",  # filled before any
])
def test_a_full_disk_while_saving_is_one_line_and_the_run_resumes_once_freed(tmp_path,
                                                                             wait_for):
    """A real full file system (a 64 MB tmpfs in a user namespace of this unprivileged
    process, filled with dd after the run's first checkpoint, or before it): the next write
    fails with one line naming the folder and the newest good checkpoint (or none), the
    partial checkpoint is removed, and once space is freed the same command goes on from
    that checkpoint (or from the start)."""
    (tmp_path / "disk").mkdir()
    script = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
         FILL_AFTER_A_CHECKPOINT, "sh",
         *[w for w in command("", "--checkpoint_steps=2", *LIGHT) if w != "--model_dir="]],
        env={**environment(), "DISK": str(tmp_path / "disk"), "LOGS": str(tmp_path),
             "WAIT_FOR": wait_for},
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    said = script.stdout.splitlines()
    assert "first exit 1" in said and "second exit 0" in said, (script.stdout, script.stderr)
    first = (tmp_path / "first.err").read_text()
    line = first.strip().splitlines()[-1]
    assert line.startswith(f"tfmulti: error: --model_dir={tmp_path}/disk/run is on a full file "
                           "system (No space left on device); "), first[-2000:]
    assert line.endswith(": free space there and run the same command again to resume")
    assert "Traceback" not in first
    listed = said[said.index("first exit 1") + 1:said.index("second exit 0")]
    assert not [n for n in listed if n.endswith("_temp")], listed
    second = (tmp_path / "second.out").read_text()
    if wait_for == "run.json":
        assert "no checkpoint was saved yet" in line and not any(".index" in n for n in listed)
        assert "Resuming" not in second  # nothing to resume from: it starts over
        return
    assert "the newest good checkpoint, ckpt-" in line
    kept = line.split("checkpoint, ")[1].split(",")[0]
    assert f"{kept}.index" in listed
    assert f"at step {int(kept.split('-')[1]) + 1}" in second and "Resuming the run" in second


def test_corrupt_latest_checkpoint_falls_back_and_says_so(light_reference, two_replicas,
                                                          tmp_path, capsys):
    model_dir = tmp_path / "run"
    shutil.copytree(light_reference, model_dir)
    last = 2 * STEPS_PER_EPOCH
    assert checkpoint_steps(model_dir) == [last - 8, last]
    data_file = model_dir / lifecycle.CHECKPOINT_DIR / f"ckpt-{last}.data-00000-of-00001"
    data_file.write_bytes(b"\x00garbage" * (data_file.stat().st_size // 8))
    capsys.readouterr()
    in_process(two_replicas, model_dir, "--epochs=3", "--checkpoint_steps=8", *LIGHT,
               verbose=1)  # one epoch more
    said = capsys.readouterr().out
    assert f"checkpoint ckpt-{last} is unreadable" in said
    assert "falling back to the one before it" in said
    assert "Resuming the run" in said and f"at step {last - 7}" in said
    metrics = json.loads((model_dir / names.METRICS_FILE).read_text())
    assert [e["epoch"] for e in metrics["epochs"]] == [1, 2, 3]


# A kill -9 after a checkpoint's files and before the state file that lists it: as the
# second checkpoint ends (the state file still lists the first alone) and as the first ends
# (no state file yet: the resume started over, the work lost and a run resumed on another
# replica count then ends a whole run's rounding away, #56)
@pytest.mark.parametrize("state_lists", [[24], None])
def test_a_whole_checkpoint_the_state_file_misses_is_resumed_from(
        light_reference, two_replicas, tmp_path, capsys, state_lists):
    import tensorflow as tf

    model_dir = tmp_path / "run"
    shutil.copytree(light_reference, model_dir)
    checkpoints = model_dir / lifecycle.CHECKPOINT_DIR
    last = 2 * STEPS_PER_EPOCH
    if state_lists:
        tf.compat.v1.train.update_checkpoint_state(
            str(checkpoints), str(checkpoints / f"ckpt-{state_lists[-1]}"),
            all_model_checkpoint_paths=[str(checkpoints / f"ckpt-{n}") for n in state_lists])
        newest = last
    else:
        (checkpoints / "checkpoint").unlink()
        for name in os.listdir(checkpoints):
            if name.startswith(f"ckpt-{last}."):
                (checkpoints / name).unlink()
        newest = last - 8
    assert checkpoint_steps(model_dir) == (state_lists or [])
    capsys.readouterr()
    in_process(two_replicas, model_dir, "--epochs=3", "--checkpoint_steps=8", *LIGHT,
               verbose=1)
    said = capsys.readouterr().out
    assert f"Resuming the run in {model_dir} at step {newest + 1}" in said, said
    # the state file lists it now, and the manager kept rotating from it
    assert checkpoint_steps(model_dir) == [3 * STEPS_PER_EPOCH - 8, 3 * STEPS_PER_EPOCH]
    assert sorted(n for n in os.listdir(checkpoints) if n.endswith(".index")) == [
        f"ckpt-{3 * STEPS_PER_EPOCH - 8}.index", f"ckpt-{3 * STEPS_PER_EPOCH}.index"]


def test_no_readable_checkpoint_is_refused(light_reference, two_replicas, tmp_path, capsys):
    model_dir = tmp_path / "run"
    shutil.copytree(light_reference, model_dir)
    broken = 0
    for name in os.listdir(model_dir / lifecycle.CHECKPOINT_DIR):
        if name.startswith("ckpt-") and ".data" in name:
            (model_dir / lifecycle.CHECKPOINT_DIR / name).write_bytes(b"broken")
            broken += 1
    assert broken == 2  # both checkpoints there (steps 24 and 32)
    with pytest.raises(UsageError) as refused:
        in_process(two_replicas, model_dir, "--epochs=3", "--checkpoint_steps=8", *LIGHT)
    assert one_line(refused.value, capsys).startswith("tfmulti: error: no readable checkpoint in ")


def in_process(strategy, model_dir, *extra, verbose=0):
    """The main job of command(model_dir, *extra) on `strategy` in this process, wrapped as
    tfmulti/tools/main.py wraps a run (the folder locked, removed if the run is refused
    before it wrote anything)."""
    from tfmulti.data import sources
    from tfmulti.run import config, flagdefs
    from tfmulti.training import train

    try:
        flagdefs.FLAGS(command(model_dir, *extra)[2:])  # tfmulti.main and its flags
        cfg = config.from_flags(flagdefs.FLAGS)
    finally:
        flagdefs.FLAGS.unparse_flags()
    existed = os.path.exists(model_dir)
    with lifecycle.in_use(str(model_dir), cfg.overwrite) as directory, \
            lifecycle.removed_if_refused(directory, existed):
        train.train_and_evaluate(strategy, sources.load_for(cfg), cfg, verbose=verbose,
                                 model_dir=directory)


def one_line(error, capsys):
    """The one stderr line cli.handle makes of `error` (exit 1)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        cli.handle(error)
    assert exited.value.code == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_nan_stops_at_once_naming_the_step_in_process(two_replicas, tmp_path, capsys):
    """The real command's run below, on this process's 2 replicas: FloatingPointError, and
    cli.handle's one line names the step; the checkpoints before it are kept."""
    model_dir = tmp_path / "run"
    with pytest.raises(FloatingPointError) as diverged:
        in_process(two_replicas, model_dir, "--base_lr=1e12", "--checkpoint_steps=1",
                   "--steps_per_call=4", *LIGHT)
    line = one_line(diverged.value, capsys)
    assert line.startswith("tfmulti: error: training diverged: loss is ")
    step = int(line.split(" at step ")[1].split(";")[0])
    saved = checkpoint_steps(model_dir)
    assert saved and max(saved) < step  # what was saved before stays; nothing after


@pytest.mark.soak  # make test keeps the same run in process (above)
def test_nan_stops_at_once_naming_the_step(tmp_path):
    model_dir = tmp_path / "run"
    result = run(model_dir, "--base_lr=1e12", "--checkpoint_steps=1", "--steps_per_call=4", *LIGHT)
    assert result.returncode == 1
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("tfmulti: error: training diverged: loss is ")
    step = int(line.split(" at step ")[1].split(";")[0])
    saved = checkpoint_steps(model_dir)
    assert saved and max(saved) < step  # what was saved before stays; nothing after


def test_a_different_run_in_the_same_model_dir_is_refused(light_reference, two_replicas, capsys):
    """In this process, as the command runs it (test_main keeps a real process's refusal):
    one line, and nothing of the run there changed."""
    reference = light_reference
    before = (reference / names.METRICS_FILE).read_text()
    plot = (reference / names.PLOT_FILE).read_bytes()
    events = sorted(str(p) for p in (reference / names.TENSORBOARD_DIR).rglob("*"))
    assert events
    with pytest.raises(UsageError) as refused:
        in_process(two_replicas, reference, *LIGHT, "--width=2")
    line = one_line(refused.value, capsys)
    assert "holds a different run (--width 4 there, 2 now)" in line and "--overwrite" in line
    assert (reference / names.METRICS_FILE).read_text() == before
    assert (reference / names.PLOT_FILE).read_bytes() == plot  # nothing of it deleted
    assert sorted(str(p) for p in (reference / names.TENSORBOARD_DIR).rglob("*")) == events


def run_json(tiny_synthetic, replicas=2, workers=1, global_batch=64, **settings):
    """run.json of a LeNet run on the tiny synthetic set (1024 training, 250 test images)."""
    cfg = RunConfig(**{"model": "lenet", "width": 4, "dataset": "synthetic",
                       "synthetic_train_size": 1024, "synthetic_test_size": 250, **settings})
    return lifecycle.run_file(cfg, tiny_synthetic, global_batch, replicas, workers)


def test_open_run(tmp_path, tiny_synthetic):
    first = run_json(tiny_synthetic)
    assert lifecycle.open_run(str(tmp_path), first) is None  # a new run
    assert json.loads((tmp_path / lifecycle.RUN_FILE).read_text()) == first
    # Another device count, steps per call and epochs: the same run, run.json follows
    moved = run_json(tiny_synthetic, replicas=1, workers=2, steps_per_call=3, epochs=20)
    assert lifecycle.open_run(str(tmp_path), moved) == first
    assert lifecycle.topology_change(first, moved) == "on 1 replica, was 2; on 2 workers, was 1"
    assert json.loads((tmp_path / lifecycle.RUN_FILE).read_text()) == moved
    elsewhere = {**moved, "dataset_source": "IDX files in /mnt/elsewhere"}  # --data_dir moved
    assert lifecycle.open_run(str(tmp_path), elsewhere) == moved
    with pytest.raises(UsageError, match="--width 4 there, 8 now"):
        lifecycle.open_run(str(tmp_path), run_json(tiny_synthetic, width=8))
    with pytest.raises(UsageError, match="--global_batch_size 64 there, 32 now.*give "
                                         "--global_batch_size=64"):
        lifecycle.open_run(str(tmp_path), run_json(tiny_synthetic, global_batch=32))
    cosine = run_json(tiny_synthetic, lr_schedule="cosine", epochs=20)
    (tmp_path / "cosine").mkdir()
    lifecycle.open_run(str(tmp_path / "cosine"), cosine)
    with pytest.raises(UsageError, match="--epochs 20 there, 30 now"):  # cosine fixes them
        lifecycle.open_run(str(tmp_path / "cosine"), {**cosine, "config": {
            **cosine["config"], "epochs": 30}})
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    (legacy / names.METRICS_FILE).write_text("{}")
    with pytest.raises(UsageError, match="no run.json"):
        lifecycle.open_run(str(legacy), first)


def test_a_run_json_not_of_this_tfmulti_is_refused_in_one_line(tmp_path, tiny_synthetic):
    """A flat run.json (tfmulti before its first release) or another program's: resuming and
    evaluating refuse it, naming what it lacks; --overwrite starts over from tfmulti's own,
    and is not offered for another program's."""
    old = {"model": "lenet", "width": 4, "dtype": "float32", "dataset":
           tiny_synthetic.display_name, "per_replica_batch_size": 32, "replicas": 2}
    (tmp_path / lifecycle.RUN_FILE).write_text(json.dumps(old))
    with pytest.raises(UsageError, match=r"is not a run.json of this tfmulti \(no config, "
                                         r"class_names, .*\); pass --overwrite to start over"):
        lifecycle.open_run(str(tmp_path), run_json(tiny_synthetic))
    with pytest.raises(UsageError, match="is not a run.json of this tfmulti"):
        lifecycle.read_run(str(tmp_path))
    lifecycle.prepare_model_dir(str(tmp_path), overwrite=True, say=lambda line: None)
    assert not (tmp_path / lifecycle.RUN_FILE).exists()  # tfmulti's own: --overwrite took it
    (tmp_path / lifecycle.RUN_FILE).write_text("[1, 2]")
    with pytest.raises(UsageError, match="is not a run.json of this tfmulti"):
        lifecycle.read_run(str(tmp_path))
    # another program's (Sacred writes run.json too): no --overwrite offered
    sacred = {"experiment": {"name": "mnist"}, "status": "COMPLETED", "host": {}}
    (tmp_path / lifecycle.RUN_FILE).write_text(json.dumps(sacred))
    with pytest.raises(UsageError, match=r"is not a run.json of this tfmulti \(no .*\): "
                                         r"another program's\? Choose another --model_dir$"):
        lifecycle.open_run(str(tmp_path), run_json(tiny_synthetic))


def test_an_epoch_resumed_mid_way_reports_its_whole_training(light_reference, two_replicas,
                                                             tmp_path):
    """The checkpoint holds the epoch's training metrics so far: resumed from step 24 (mid
    epoch 2), the epoch's training loss and accuracy are the uninterrupted run's over all its
    16 steps (they once covered only the 8 after the resume), up to the rounding of the
    replicas' sums read back."""
    model_dir = tmp_path / "run"
    shutil.copytree(light_reference, model_dir)
    checkpoints = model_dir / lifecycle.CHECKPOINT_DIR
    (checkpoints / "checkpoint").unlink()
    for name in os.listdir(checkpoints):
        if name.startswith(f"ckpt-{2 * STEPS_PER_EPOCH}."):
            (checkpoints / name).unlink()
    in_process(two_replicas, model_dir, "--checkpoint_steps=8", *LIGHT)
    whole = json.loads((light_reference / names.METRICS_FILE).read_text())["epochs"][-1]
    resumed = json.loads((model_dir / names.METRICS_FILE).read_text())["epochs"][-1]
    assert resumed["resumed_at_step"] == 25
    assert resumed["loss"] == pytest.approx(whole["loss"], rel=1e-5)
    assert resumed["train_acc"] == pytest.approx(whole["train_acc"], rel=1e-5)
    assert resumed["test_acc"] == whole["test_acc"]
