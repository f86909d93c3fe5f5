import csv
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import keras_tuner as kt
import pytest

from tfmulti.data import sources
from tfmulti.distribution import devices
from tfmulti.distribution.devices import DevicePlan
from tfmulti.errors import UsageError
from tfmulti.run.config import RunConfig
from tfmulti.tools import tune
from tfmulti.tune import keras_tuner_fixes, runner, search, session
from tfmulti.tune.objective import SessionObjective
from tfmulti.tune.trial import trial_metrics

PLAN = DevicePlan("cpu", 2)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A search space as the tune flags give it (RunConfig field -> values), and the base_lr range.
CHOICES = {"per_replica_batch_size": [64, 128, 256], "lr_scaling": ["linear", "sqrt"],
           "warmup_epochs": [0.0, 1.0], "lr_schedule": ["constant"], "momentum": [0.0],
           "weight_decay": [0.0]}
LR_RANGE = (0.01, 1.0)
ACCURACY = SessionObjective("val_accuracy", "max", "val_acc")


def hypermodel_of(dataset, base, cls=search.TrainingHyperModel, **choices):
    """A session's hypermodel; its trials hold a tenth out, as tfmulti.tune's do."""
    base = dataclasses.replace(base, validation_split=base.validation_split or 0.1)
    return cls(PLAN, dataset, base, {**CHOICES, **choices}, LR_RANGE, ACCURACY)


def environment():
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run(*args, module="tfmulti.tune"):
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=environment(),
                          capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("rule, per_replica, base_lr, expected", [
    ("linear", 64, 0.1, 0.1 * 128 / 256), ("sqrt", 256, 0.2, 0.2 * (512 / 256) ** 0.5),
    ("linear", 256, 0.3, 0.3 * 2)])
def test_trial_learning_rate_is_base_times_rule(tiny_synthetic, rule, per_replica, base_lr,
                                                expected):
    """What a trial's process reports (trial_metrics) for the trial's settings on the 2
    replicas of PLAN: the global batch and rate of its plan."""
    hypermodel = hypermodel_of(tiny_synthetic, RunConfig(model="lenet", width=2))
    hp = kt.HyperParameters()
    hypermodel.build(hp)
    hp.values.update(per_replica_batch_size=per_replica, base_lr=base_lr, lr_scaling=rule)
    metrics = trial_metrics(hypermodel.trial_config(hp), PLAN.count, ACCURACY, 0.5, 1.0)
    assert metrics["learning_rate"] == pytest.approx(expected)
    assert metrics["global_batch_size"] == 2 * per_replica


def test_a_trial_of_an_older_session_keeps_what_it_trained_with(tiny_synthetic):
    """Sessions begun before momentum, weight decay and the schedule were searched have trials
    without them; hyperband's best.cfg trains for the best trial's own epochs."""
    hypermodel = hypermodel_of(tiny_synthetic, RunConfig(model="lenet", width=2, epochs=9))
    old = kt.HyperParameters()
    old.values.update(per_replica_batch_size=64, base_lr=0.3, lr_scaling="sqrt",
                      warmup_epochs=1.0)
    cfg = hypermodel.trial_config(old, old.values.get("tuner/epochs"))
    assert (cfg.momentum, cfg.weight_decay, cfg.lr_schedule, cfg.epochs) == (0.0, 0.0,
                                                                             "constant", 9)
    old.values["tuner/epochs"] = 3
    assert hypermodel.trial_config(old, old.values.get("tuner/epochs")).epochs == 3


def trial_dirs(out):
    folder = out / "trials"
    return (sorted(n for n in os.listdir(folder) if n.startswith("trial_"))
            if folder.exists() else [])


@pytest.mark.soak
def test_an_interrupted_session_resumes_to_max_trials_and_its_best_flagfile_runs(tmp_path):
    """A 3-trial session killed (kill -9) in its second trial, then rerun: the finished trial
    is kept, the session ends at 3 with the table, the plot and a best.cfg main runs."""
    out = tmp_path / "session"
    args = ["--flagfile=flags/tune_smoke.cfg", "--synthetic_train_size=1024", f"--model_dir={out}"]
    process = subprocess.Popen([sys.executable, "-m", "tfmulti.tune", *args], cwd=ROOT,
                               env=environment(), stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline and process.poll() is None and len(trial_dirs(out)) < 2:
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    assert process.wait(60) == -signal.SIGKILL, "the session ended before it was killed"
    first = json.loads((out / "trials" / "trial_0" / "trial.json").read_text())
    assert first["status"] == "COMPLETED"
    resumed = run(*args)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    with open(out / "trials.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 3 and all(r["status"] == "COMPLETED" for r in rows)
    assert float(rows[0]["val_accuracy"]) == pytest.approx(first["score"])  # kept, not rerun
    for r in rows:  # the rate used is base_lr x rule(global batch / 256)
        factor = float(r["global_batch_size"]) / 256
        factor = factor if r["lr_scaling"] == "linear" else factor ** 0.5
        assert float(r["learning_rate"]) == pytest.approx(float(r["base_lr"]) * factor, rel=1e-5)
    assert (out / "accuracy.png").read_bytes()[:4] == b"\x89PNG"
    best = (out / "best.cfg").read_text()
    assert best.startswith("# python -m tfmulti.main --flagfile=") and "--base_lr=" in best
    main = run(f"--flagfile={out}/best.cfg", "--epochs=1", f"--model_dir={tmp_path}/main",
               module="tfmulti.main")
    assert main.returncode == 0, main.stderr[-2000:]
    assert "test acc: " in main.stdout


class FirstTrialCrashes(search.TrainingHyperModel):
    """The first trial (and its retry) asks for 512 per replica, more than the 256 examples:
    it crashes in its process. keras-tuner's draws differ from run to run even with a seed
    (seen: two runs of one test drew different batches), so the crash is not left to them."""

    first_lr, crashing_runs = None, 0

    def run_trial(self, hp, *args):
        self.first_lr = self.first_lr or hp.get("base_lr")
        if hp.get("base_lr") == self.first_lr:
            hp.values["per_replica_batch_size"] = 512
            self.crashing_runs += 1
        return super().run_trial(hp, *args)


@pytest.mark.soak  # make soak: 30 s (make test keeps under its 8 minutes)
def test_a_crashing_trial_is_retried_then_skipped(tmp_path):
    dataset = sources.load("synthetic", synthetic_train_size=256, synthetic_test_size=64)
    hypermodel = hypermodel_of(dataset, RunConfig(model="lenet", width=2, epochs=1),
                               FirstTrialCrashes, per_replica_batch_size=[8])
    tuner = search.make_tuner("random", hypermodel, str(tmp_path), max_trials=2,
                              max_retries_per_trial=1, seed=0)
    tuner.search(verbose=0)
    rows = session.trial_rows(tuner)
    assert [(r["status"], r["per_replica_batch_size"]) for r in rows] == [
        ("FAILED", 512), ("COMPLETED", 8)], rows
    for r in rows[1:]:  # what the trials' processes reported: the rate of their global batch
        factor = 16 / 256 if r["lr_scaling"] == "linear" else (16 / 256) ** 0.5
        assert r["global_batch_size"] == 16
        assert r["learning_rate"] == pytest.approx(r["base_lr"] * factor, rel=1e-6)
    assert hypermodel.crashing_runs == 2  # run, retried once, then given up
    failed = next(t for t in tuner.oracle.trials.values() if str(t.status) == "FAILED")
    assert "global batch 1024 is larger than the 230 training examples" in failed.message


def test_device_shares_split_gpus_and_cpu_replicas_evenly():
    gpus = devices.device_shares(DevicePlan("gpu", 4), 2, [0, 1, 2, 3], ["4", "5", "6", "7"])
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in gpus] == ["4,5", "6,7"]
    assert all("--num_gpus=2" in s.flags for s in gpus)
    assert [s.cores for s in gpus] == [[0, 1], [2, 3]]
    cpus = devices.device_shares(DevicePlan("cpu", 4), 4, [0, 1])
    assert all("--cpu_replicas=1" in s.flags and not s.env for s in cpus)
    assert [s.cores for s in cpus] == [[0], [1], [0], [1]]  # fewer cores than workers: shared
    with pytest.raises(UsageError,
                       match="cannot split 4 GPUs into equal shares; use one of 1, 2, 4"):
        devices.device_shares(DevicePlan("gpu", 4), 3, [0, 1])


def worker_pid(session_pid, tuner_id):
    """The worker process `tuner_id` of the session (not its trial's child process)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read()
        except OSError:
            continue
        if (f"KERASTUNER_TUNER_ID={tuner_id}".encode() in env and b"tfmulti.tune" in command
                and f"TFMULTI_PARENT_PID={session_pid}".encode() in env):
            return int(pid)
    return None


@pytest.mark.soak  # 38 s: make soak (make test keeps a crashing trial and a stopped session)
def test_parallel_trials_lose_no_trial_when_a_worker_dies(tmp_path):
    """2 workers x 1 CPU replica, 3 trials; worker tuner1 is killed during a trial: its trial
    is retried, the worker started again, and all 3 trials complete."""
    out = tmp_path / "session"
    process = subprocess.Popen(
        [sys.executable, "-m", "tfmulti.tune", "--flagfile=flags/tune_smoke.cfg",
         "--synthetic_train_size=512", "--epochs=1", "--max_trials=3", "--parallel_trials=2",
         f"--model_dir={out}"],
        cwd=ROOT, env=environment(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    killed, deadline = None, time.time() + 300
    while killed is None and time.time() < deadline and process.poll() is None:
        try:
            ongoing = json.loads((out / "trials" / "oracle.json").read_text())["ongoing_trials"]
            trial = ongoing["tuner1"]
            running = json.loads((out / "trials" / f"trial_{trial}" / "trial.json").read_text())
        except (OSError, ValueError, KeyError):
            time.sleep(0.05)
            continue
        pid = worker_pid(process.pid, "tuner1")
        if running["status"] == "RUNNING" and pid:
            os.kill(pid, signal.SIGKILL)
            killed = trial
    output, _ = process.communicate(timeout=300)
    assert killed is not None, output[-3000:]
    assert process.returncode == 0, output[-3000:]
    assert f"tuner1: died (exit code -9) during trial {killed}" in output
    assert "tuner1: started again on 1 CPU replica on core" in output
    with open(out / "trials.csv") as f:
        rows = list(csv.DictReader(f))
    assert sorted(int(r["trial"]) for r in rows) == [0, 1, 2]
    assert all(r["status"] == "COMPLETED" for r in rows), rows
    for tuner_id in ("tuner0", "tuner1"):  # both workers ran trials
        assert " COMPLETED" in (out / "workers" / f"{tuner_id}.log").read_text()
    assert "Trials ran 2 at a time on 1 of the 2 devices" in (out / "best.cfg").read_text()


def test_a_session_at_a_url_is_refused_in_one_line(tool, monkeypatch):
    monkeypatch.chdir(ROOT)
    code, _, err = tool("tune", "--flagfile=flags/tune_smoke.cfg", "--model_dir=gs://bucket/session")
    assert code == 1
    assert err.strip().splitlines() == [
        "tfmulti: error: --model_dir=gs://bucket/session: a tuning session lives on a local or "
        "network file system (a mounted folder), not at a URL"]
    assert not os.path.exists(os.path.join(ROOT, "gs:"))


# kill -9 of the session in make soak (a killed supervisor's children die with it: make test
# keeps that for the launcher, test_launch.py)
@pytest.mark.parametrize("sig", [pytest.param(signal.SIGKILL, marks=pytest.mark.soak),
                                 signal.SIGTERM])
def test_a_stopped_parallel_session_leaves_no_worker_behind(tmp_path, sig):
    """kill -9 or SIGTERM to the tuning chief: its workers (and their trials) end with it."""
    out = tmp_path / "session"
    process = subprocess.Popen(
        [sys.executable, "-m", "tfmulti.tune", "--flagfile=flags/tune_smoke.cfg",
         "--synthetic_train_size=1024", "--max_trials=4", "--parallel_trials=2",
         f"--model_dir={out}"], cwd=ROOT, env=environment(), stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)
    deadline, pids = time.time() + 120, []
    while time.time() < deadline and len(pids) < 2 and process.poll() is None:
        pids = [p for p in (worker_pid(process.pid, t) for t in ("tuner0", "tuner1")) if p]
        time.sleep(0.1)
    assert len(pids) == 2, "the workers did not start"
    process.send_signal(sig)
    process.wait(30)
    deadline = time.time() + 15
    while time.time() < deadline and any(worker_pid(process.pid, t) for t in ("tuner0", "tuner1")):
        time.sleep(0.1)
    assert not any(worker_pid(process.pid, t) for t in ("tuner0", "tuner1"))


@pytest.mark.soak  # about a minute: make soak
def test_sigterm_to_a_parallel_session_mid_trials_saves_them_and_exits_75(tmp_path):
    """SIGTERM to the chief of --parallel_trials=2 once both workers' trials have a
    checkpoint: each worker saves its trial and exits 75, the chief exits 75 (a batch script
    requeues it) in one line; run again, the session ends with each of its trials completed
    once."""
    import glob

    out = tmp_path / "session"
    command = [sys.executable, "-m", "tfmulti.tune", "--flagfile=flags/tune_smoke.cfg",
               "--synthetic_train_size=1024", "--max_trials=3", "--parallel_trials=2",
               "--epochs=3", f"--model_dir={out}"]
    process = subprocess.Popen(command, cwd=ROOT, env=environment(), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    pattern = str(out / "trials" / "trial_*" / "run" / "checkpoints" / "ckpt-*.index")
    deadline = time.time() + 240
    while len({os.path.dirname(p) for p in glob.glob(pattern)}) < 2:
        assert time.time() < deadline and process.poll() is None, "no two trials saved"
        time.sleep(0.1)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 75, stderr[-2000:]
    assert stderr.strip().splitlines()[-1] == (
        "tfmulti: tuning stopped by SIGTERM; finished trials are kept, each worker's trial "
        "saved its checkpoint; run the same command again to go on with the session")
    logs = [(out / "workers" / f"tuner{i}.log").read_text() for i in range(2)]
    assert all("tfmulti: tuning stopped by SIGTERM in trial " in log for log in logs), logs
    again = subprocess.run(command, cwd=ROOT, env=environment(), capture_output=True,
                           text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    with open(out / "trials.csv") as f:
        assert sorted(r["trial"] for r in csv.DictReader(f) if r["status"] == "COMPLETED") == [
            "0", "1", "2"]


@pytest.mark.parametrize("kind", search.TUNERS)
def test_every_tuner_can_be_made(tmp_path, tiny_synthetic, kind):
    """Each --tuner choice constructs with what setup.py installs (bayesian needs scipy)."""
    hypermodel = hypermodel_of(tiny_synthetic, RunConfig(model="lenet", width=2, epochs=3))
    tuner = search.make_tuner(kind, hypermodel, str(tmp_path), max_trials=2)
    assert tuner.oracle.objective.name == ACCURACY.name


def test_a_trial_started_but_not_yet_in_the_oracle_file_runs_again(tmp_path, tiny_synthetic):
    """keras-tuner writes trial.json before oracle.json: a kill in between must not leave the
    trial RUNNING for ever. Simulated: oracle.json as it was before the trial was created."""
    hypermodel = hypermodel_of(tiny_synthetic, RunConfig(model="lenet", width=2))
    tuner = search.make_tuner("random", hypermodel, str(tmp_path), max_trials=2)
    tuner.save()
    oracle_file = tmp_path / "trials" / "oracle.json"
    before = oracle_file.read_text()
    started = tuner.oracle.create_trial("tuner0")
    oracle_file.write_text(before)  # the kill came before the oracle was saved
    resumed = search.make_tuner("random", hypermodel, str(tmp_path), max_trials=2)
    again = resumed.oracle.create_trial("tuner0")
    assert again.trial_id == started.trial_id
    assert again.hyperparameters.values == started.hyperparameters.values


def test_a_session_begun_serially_resumes_as_a_parallel_chief(tmp_path, tiny_synthetic,
                                                              monkeypatch):
    """keras-tuner reloads only if this process's own tuner file exists (chief.json for the
    chief); a serial session has tuner0.json only. It must resume, not start over."""
    hypermodel = hypermodel_of(tiny_synthetic, RunConfig(model="lenet", width=2))
    serial = search.make_tuner("random", hypermodel, str(tmp_path), max_trials=3)
    trial = serial.oracle.create_trial("tuner0")
    serial.oracle.update_trial(trial.trial_id, {ACCURACY.name: 0.5})
    trial.status = "COMPLETED"
    serial.oracle.end_trial(trial)
    serial.save()
    assert not (tmp_path / "trials" / "chief.json").exists()
    monkeypatch.setenv("KERASTUNER_TUNER_ID", "chief")
    monkeypatch.setenv("KERASTUNER_ORACLE_IP", "127.0.0.1")
    monkeypatch.setenv("KERASTUNER_ORACLE_PORT", "1")
    chief = search.make_tuner("random", hypermodel, str(tmp_path), max_trials=3)
    kept = chief.oracle.trials[trial.trial_id]
    assert str(kept.status) == "COMPLETED" and kept.score == 0.5
    assert chief.oracle.create_trial("tuner1").trial_id != trial.trial_id


def test_keras_tuner_state_is_replaced_whole_never_written_in_place(tmp_path, monkeypatch):
    """A kill while oracle.json was written left it empty (seen); now the old file stays
    whole until the new one is complete and renamed over it."""
    from keras_tuner.src import utils
    from keras_tuner.src.engine import stateful

    original = utils.save_json
    monkeypatch.setattr(utils, "save_json", original)  # the patch undone afterwards
    keras_tuner_fixes.apply()
    patched = utils.save_json
    keras_tuner_fixes.apply()  # twice: still one patch
    assert utils.save_json is patched is not original
    path = tmp_path / "oracle.json"
    path.write_text('{"old": 1}')

    def killed(*args):
        raise OSError("killed before the rename")

    with monkeypatch.context() as kill:
        kill.setattr(os, "replace", killed)
        with pytest.raises(OSError, match="killed before the rename"):
            stateful.utils.save_json(str(path), {"new": 2})
    assert json.loads(path.read_text()) == {"old": 1}
    stateful.utils.save_json(str(path), {"new": 2})
    assert json.loads(path.read_text()) == {"new": 2}


FULL_DISK_WRITER = """
import json, os, resource, signal, sys
from keras_tuner.src.engine import stateful
from tfmulti.tune import keras_tuner_fixes
keras_tuner_fixes.apply()
os.umask(0o002)  # a session shared with the group
stateful.utils.save_json(sys.argv[1] + "/small.json", {"fits": 1})
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
try:
    stateful.utils.save_json(sys.argv[1] + "/oracle.json", {"big": "x" * 100000})
except OSError as e:
    print("refused", e.errno)
"""


def test_a_state_file_write_that_fails_leaves_the_old_file_and_no_temporary(tmp_path):
    """A real failed write (the file size limit, as a full disk fails it): the old
    oracle.json stays, no *.tmp is left; files are made with the umask's mode (0664 under
    umask 002), so a group-shared session stays shared."""
    import errno
    import stat

    (tmp_path / "oracle.json").write_text('{"old": 1}')
    out = subprocess.run([sys.executable, "-c", FULL_DISK_WRITER, str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == f"refused {errno.EFBIG}", out.stderr[-2000:]
    assert json.loads((tmp_path / "oracle.json").read_text()) == {"old": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["oracle.json", "small.json"]
    assert stat.S_IMODE((tmp_path / "small.json").stat().st_mode) == 0o664


def test_the_keras_tuner_internals_the_fixes_rely_on_are_still_there(tmp_path):
    """keras_tuner_fixes was checked against keras-tuner 1.4.7 and 1.4.8; a later version
    that writes state another way than through utils.save_json, or retries trials without
    Oracle._retry_queue, fails here instead of silently undoing the fixes."""
    import re

    import keras_tuner
    from keras_tuner.src import utils

    source = os.path.dirname(keras_tuner.__file__)
    calls = []
    for folder, _, names in os.walk(source):
        for name in names:
            if name.endswith(".py") and not name.endswith("_test.py"):
                with open(os.path.join(folder, name)) as f:
                    calls += re.findall(r"[\w.]*save_json\b", f.read())
    assert calls and set(calls) <= {"save_json", "utils.save_json"}, set(calls)
    assert callable(utils.save_json)
    oracle = kt.oracles.RandomSearchOracle(max_trials=3, seed=0)
    oracle._set_project_dir(str(tmp_path), "p")
    oracle.hyperparameters.Float("x", 0.0, 1.0)
    first = oracle.create_trial("tuner0")
    assert isinstance(oracle._retry_queue, list) and first.trial_id not in oracle._retry_queue
    oracle.ongoing_trials.pop("tuner0")  # as after a kill: RUNNING, nobody running it
    keras_tuner_fixes.requeue_running(oracle)
    assert oracle._retry_queue == [first.trial_id]
    assert oracle.create_trial("tuner1").trial_id == first.trial_id  # taken from the queue
    # Fix 5: killed after the trial's trial.json said COMPLETED, before oracle.json did
    oracle.save()
    first.status = "COMPLETED"
    first.metrics.update("score", 0.5)
    oracle._save_trial(first)
    again = kt.oracles.RandomSearchOracle(max_trials=3, seed=0)
    again._set_project_dir(str(tmp_path), "p")
    again.reload()
    assert again._retry_queue == [first.trial_id]  # keras-tuner alone would run it again
    keras_tuner_fixes.requeue_running(again)
    assert again._retry_queue == [] and again.end_order == [first.trial_id]
    assert again.create_trial("tuner0").trial_id != first.trial_id
    # Fix 3: a worker's calls to the chief read the module's TIMEOUT at each call.
    import inspect

    from keras_tuner.src.distribute import oracle_client

    calls = inspect.getsource(oracle_client.OracleClient)
    assert calls.count("timeout=TIMEOUT") == calls.count("wait_for_ready=True") >= 6
    before = oracle_client.TIMEOUT
    try:
        keras_tuner_fixes.bound_oracle_calls(7.0)
        assert oracle_client.TIMEOUT == 7.0
    finally:
        oracle_client.TIMEOUT = before


@pytest.mark.parametrize("argv, line", [
    (["--tune_batch_sizes=64,x"], "--tune_batch_sizes=64,x: give whole numbers, comma separated"),
    (["--tune_batch_sizes=64,0"], "--tune_batch_sizes: --per_replica_batch_size=0: a batch needs "
                                  "at least one example"),
    (["--tune_batch_sizes=6", "--grad_accum_steps=4"], "--tune_batch_sizes: --grad_accum_steps=4: "
     "the 6 examples per replica do not split into 4 equal micro-batches"),
    (["--tune_lr_range=0.5,0.1"], "need 0 < --tune_lr_range low < high (got 0.5,0.1)"),
    (["--tune_lr_range=0,1"], "--tune_lr_range: --base_lr=0: the learning rate must be positive"),
    (["--tune_lr_scalings=linear,cubic"], "--tune_lr_scalings: --lr_scaling=cubic: choose one of "
                                          "linear, sqrt, none"),
    (["--tune_lr_schedules=constant,step"], "--tune_lr_schedules: --lr_schedule=step: choose one "
                                            "of constant, cosine"),
    (["--tune_momentum=0,1.5"], "--tune_momentum: --momentum=1.5: must be below 1"),
    (["--tune_weight_decay=-1"], "--tune_weight_decay: --weight_decay=-1: must be 0 or more"),
    (["--tune_warmup_epochs="], "--tune_warmup_epochs: give at least one value"),
    (["--max_trials=0"], "--max_trials=0: must be at least 1"),
])
def test_a_bad_search_space_is_one_line_with_runconfigs_rules(argv, line):
    """Each value is checked as the RunConfig field it sets (and the plan it makes): the
    field's own one line, after the tune flag that gave it."""
    from tfmulti.run import config, flagdefs

    try:
        flagdefs.FLAGS(["tfmulti.tune", *argv])
        with pytest.raises(UsageError) as refused:
            runner.search_space(config.from_flags(flagdefs.FLAGS), tune.options())
        assert str(refused.value) == line
    finally:
        flagdefs.FLAGS.unparse_flags()
    flagdefs.FLAGS(["tfmulti.tune"])
    try:
        # the defaults are a valid space
        space = runner.search_space(config.from_flags(flagdefs.FLAGS), tune.options())
        assert space["choices"]["momentum"] == [0.0]
        assert space["choices"]["lr_schedule"] == ["constant"]
        assert space["choices"]["per_replica_batch_size"] == [64, 128, 256]
        assert space["lr_range"] == (0.01, 1.0)
    finally:
        flagdefs.FLAGS.unparse_flags()


def test_the_bayesian_tuner_has_scikit_learn_after_tfmultis_start_up():
    """tfmulti keeps scikit-learn out while TensorFlow imports (Keras's wrappers would load it,
    1 s of every start-up); the Bayesian tuner, imported afterwards, still gets it."""
    code = ("import sys; from tfmulti import quiet; quiet.import_tensorflow(); "
            "print('sklearn' in sys.modules, 'keras' in sys.modules); "
            "from keras_tuner.src.tuners import bayesian; print(bayesian.sklearn is not None)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=environment(),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "True", "True"]


def test_make_soaks_memory_probe_builds_the_tuner_a_session_builds(tmp_path):
    """testing/tune_memory.py (make soak's `memory` check) makes its tuner as a session does:
    this catches it falling behind the hypermodel's arguments, which make test never runs
    otherwise (it did once, and make soak failed on its own script)."""
    from testing import tune_memory
    tuner = tune_memory.probe([], str(tmp_path), max_trials=1)
    assert tuner.oracle.objective.name == "val_accuracy"
    assert tuner.hypermodel.base.validation_split == 0.1
