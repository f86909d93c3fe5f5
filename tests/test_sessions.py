"""Tuning sessions that are honest and keep their folders apart, through real processes on a
user's model and data function: trials are chosen on a part of the training data held out
for validation (the test set is never read, so a test set of noise changes nothing); the
table carries the user's own hyperparameters; best.cfg trains on all the training data and
reports the test set; a folder holds one kind of run and one session."""
import csv
import os
import subprocess
import sys
import textwrap

import pytest

from tfmulti.data import sources
from tfmulti.errors import UsageError
from tfmulti.run.config import RunConfig
from tfmulti.rundir import kinds, lifecycle
from tfmulti.tuning import runner

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

USER_CODE = textwrap.dedent('''
    import keras
    import numpy as np
    from keras import layers


    def _images(n, seed):
        """8x9 images whose class (0-2) is a slightly brighter third of the picture."""
        rng = np.random.default_rng(seed)
        labels = rng.integers(0, 3, n).astype(np.int32)
        images = rng.integers(0, 90, (n, 8, 9)).astype(np.uint8)
        for i, label in enumerate(labels):
            images[i, :, 3 * label:3 * label + 3] += 25
        return images, labels


    def data():
        return _images(600, 1), _images(150, 2)


    def noisy_test():
        """data()'s training set; its test set replaced by noise with random labels."""
        rng = np.random.default_rng(3)
        return _images(600, 1), (rng.integers(0, 256, (150, 8, 9)).astype(np.uint8),
                                 rng.integers(0, 3, 150).astype(np.int32))


    def tunable(input_shape, num_classes, hp):
        units = hp.Int("units", 4, 32, step=4)
        hp.Choice("learning_rate", [0.01, 0.1])  # yours, beside tfmulti's rate
        return keras.Sequential([keras.Input(input_shape), layers.Flatten(),
                                 layers.Dense(units, activation="relu"),
                                 layers.Dense(num_classes)])
''')

SESSION = ["--model=mine:tunable", "--cpu_replicas=2", "--epochs=1", "--max_trials=2",
           "--tune_batch_sizes=16,32", "--objective=val_loss", "--deterministic"]


def run(folder, module, *args):
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{folder}", "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=600)


def rows(session):
    with open(session / "trials.csv") as f:
        return [{k: v for k, v in r.items() if k != "seconds"} for r in csv.DictReader(f)]


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """The user's folder with a session on data(), run once for the tests below."""
    folder = tmp_path_factory.mktemp("sessions")
    (folder / "mine.py").write_text(USER_CODE)
    said = run(folder, "tfmulti.tune", *SESSION, "--dataset=mine:data", "--model_dir=session")
    assert said.returncode == 0, said.stderr[-3000:]
    return folder


def test_a_session_chooses_on_validation_data_and_never_reads_the_test_set(project):
    """The same session with the test set replaced by noise: the same trials, the same
    figures, the same best.cfg (but the data set's name)."""
    noisy = run(project, "tfmulti.tune", *SESSION, "--dataset=mine:noisy_test",
                "--model_dir=noisy")
    assert noisy.returncode == 0, noisy.stderr[-3000:]
    table = rows(project / "session")
    assert table == rows(project / "noisy") and len(table) == 2
    assert {"model/units", "model/learning_rate", "learning_rate", "val_loss"} <= set(table[0])
    best = [line for line in (project / "session" / "best.cfg").read_text().splitlines()
            if not line.startswith("#")]
    noisy_best = (project / "noisy" / "best.cfg").read_text().replace("noisy_test", "data")
    assert best == [line for line in noisy_best.splitlines() if not line.startswith("#")]


@pytest.fixture(scope="module")
def best(project):
    """The main job run from the session's best.cfg: what it printed."""
    main = run(project, "tfmulti.main", "--flagfile=session/best.cfg", "--model_dir=best")
    assert main.returncode == 0, main.stderr[-3000:]
    return main.stdout


def test_best_cfg_trains_on_all_the_training_data_and_reports_the_test_set(project, best):
    cfg = (project / "session" / "best.cfg").read_text()
    assert "--validation_split=0.0" in cfg and "--model_hparams={" in cfg
    assert "--synthetic" not in cfg and "--width" not in cfg  # what does not apply
    assert "(600 images, 3 classes)" in best and "test acc: " in best


def test_a_folder_holds_one_kind_of_run_and_one_session(project, best):
    """A session rerun with another model is refused, and the folder is left as it was;
    a training run and a session refuse each other's folders, --overwrite or not."""
    session = project / "session"
    before = {p.name: p.read_bytes() for p in session.iterdir() if p.is_file()
              and p.name != ".tfmulti-lock"}  # who last held the folder
    other = run(project, "tfmulti.tune", *SESSION, "--dataset=mine:data", "--model_dir=session",
                "--model_hparams={\"units\":8}")
    assert other.returncode == 1
    assert other.stderr.strip().splitlines()[-1] == (
        "tfmulti: error: --model_dir=session holds a different tuning session (--model_hparams "
        "'' there, '{\"units\":8}' now); pass --overwrite to replace it or choose another "
        "--model_dir")
    for overwrite in (False, True):
        with pytest.raises(UsageError, match="holds a tuning session \\(python -m "
                                             "tfmulti.tune's\\), not a training run"):
            with lifecycle.in_use(str(session), overwrite):  # as tfmulti.main opens it
                pass
    with pytest.raises(UsageError, match="holds a training run \\(python -m tfmulti.main's\\), "
                                         "not a tuning session"):
        with lifecycle.in_use(str(project / "best"), True, marks=kinds.SESSION_MARKS,
                              kind="session"):  # as tfmulti.tune opens it
            pass
    assert {p.name: p.read_bytes() for p in session.iterdir() if p.is_file()
            and p.name != ".tfmulti-lock"} == before
    assert (project / "best" / "accuracy.png").exists()


def test_a_batch_no_trial_can_train_is_refused_before_the_first_trial(project, monkeypatch):
    """What tfmulti.tune checks before its first trial (and before it makes the session's
    folder): --tune_batch_sizes=16,400 on 2 replicas, 600 examples less a tenth."""
    monkeypatch.syspath_prepend(str(project))
    base = RunConfig(model="mine:tunable", dataset="mine:data", validation_split=0.1)
    with pytest.raises(UsageError) as refused:
        runner.check_batches(base, {"per_replica_batch_size": [16, 400]},
                             sources.load_for(base), 2)
    assert str(refused.value) == (
        "--tune_batch_sizes=400: global batch 800 is larger than the 540 training examples a "
        "trial trains on (2 replicas, the 0.1 validation part held out)")
