"""Tuning sessions that are honest and keep their folders apart, through real processes on a
user's model and data function: trials are chosen on a part of the training data held out
for validation (the test set is never read, so a test set of noise changes nothing); the
table carries the user's own hyperparameters; best.cfg trains on all the training data and
reports the test set; a folder holds one kind of run and one session."""
import csv
import json
import os
import signal
import statistics
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import tensorflow as tf

from tfmulti.data import sources
from tfmulti.decoded import dataonce
from tfmulti.errors import UsageError
from tfmulti.run.config import RunConfig
from tfmulti.rundir import kinds, lifecycle
from tfmulti.tune import runner

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
        return keras.Sequential([keras.Input(input_shape), layers.Rescaling(1 / 255),
                                 layers.Flatten(),
                                 layers.Dense(units, activation="relu"),
                                 layers.Dense(num_classes)])
''')

# 4 trials of 2 epochs, pruned by the median from the fourth (3 completed before it), over a
# range of rates with hopeless ones in it
SESSION = ["--model=mine:tunable", "--cpu_replicas=2", "--epochs=2", "--max_trials=4",
           "--tune_batch_sizes=16,32", "--tune_lr_range=0.001,3", "--prune=median",
           "--objective=val_loss", "--deterministic"]


def run(folder, module, *args):
    """`python -m module args` in folder (module "-c": args[0] is the program)."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{folder}", "PYTHONUNBUFFERED": "1"}
    command = ([sys.executable, "-c", *args] if module == "-c"
               else [sys.executable, "-m", module, *args])
    return subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True,
                          timeout=600)


def rows(session):
    with open(session / "trials.csv") as f:
        return [{k: v for k, v in r.items() if k != "seconds"} for r in csv.DictReader(f)]


def printed_table(output):
    """The session's printed table (format_table): a dict per trial, by its header's
    names."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:2] == ["trial", "status"])
    names = lines[start].replace("time s", "time_s").split()
    table = []
    for line in lines[start + 1:]:
        if line.startswith("best: "):
            break
        table.append(dict(zip(names, line.split(), strict=True)))
    return table


def trials_in_this_process(patched, strategy):
    """A session's trials trained in this process on the suite's `strategy` instead of each
    in a spawned process that starts its own devices (child.run called inline): make test
    checks what the session makes of its trials here; the real processes are make soak's
    (the sessions below) and test_tune's."""
    from conftest import started_on

    from tfmulti.distribution import startup
    from tfmulti.processes import child

    def inline(target, args, timeout=None, what="", started=None):
        sent = []

        class Send:
            def send(self, payload):
                sent.append(payload)

        target(Send(), *args)
        if not sent:
            raise child.Died(f"{what} sent nothing")
        return sent[0]

    patched.setattr(child, "run", inline)
    patched.setattr(startup.Startup, "start", started_on(strategy))


@pytest.fixture(scope="module")
def project(tmp_path_factory, two_replicas):
    """The user's folder with a session on data(), run once for the tests below (its output
    in session.txt): the command in this process, as cli.main runs it, its trials too
    (trials_in_this_process)."""
    import contextlib
    import io

    from conftest import in_this_process

    folder = tmp_path_factory.mktemp("sessions")
    (folder / "mine.py").write_text(USER_CODE)
    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as patched, contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(err):
        patched.chdir(folder)
        patched.syspath_prepend(str(folder))
        trials_in_this_process(patched, two_replicas)
        code = in_this_process("tune", *SESSION, "--dataset=mine:data", "--model_dir=session")
    assert code == 0, (code, err.getvalue()[-3000:])
    (folder / "session.txt").write_text(out.getvalue())
    return folder


@pytest.mark.soak  # make soak: two real sessions, 40 s (make test keeps under its 8 minutes)
def test_a_session_chooses_on_validation_data_and_never_reads_the_test_set(project):
    """Two trials of the session, as real processes, on data() and with the test set replaced
    by noise: the same trials with the same figures (keras-tuner draws them from the seed
    alone), so the same choice among them."""
    for name, data in (("clean", "mine:data"), ("noisy", "mine:noisy_test")):
        done = run(project, "tfmulti.tune", *SESSION, f"--dataset={data}", "--max_trials=2",
                   f"--model_dir={name}")
        assert done.returncode == 0, done.stderr[-3000:]
    assert rows(project / "noisy") == rows(project / "clean") and len(rows(project / "clean")) == 2


def test_the_sessions_table_carries_your_hyperparameters_and_the_rate_it_trained_with(project):
    table = rows(project / "session")
    assert len(table) == 4
    assert {"model/units", "model/learning_rate", "learning_rate", "val_loss"} <= set(table[0])
    # the user's hyperparameters carry the values drawn for them; tfmulti's learning_rate is
    # the rate it trained with (base_lr x rule(global batch / 256)), not the user's own
    printed = printed_table((project / "session.txt").read_text())
    assert [p["trial"] for p in printed] == [r["trial"] for r in table]
    for row, shown in zip(table, printed):
        assert int(row["model/units"]) in range(4, 33, 4)
        assert float(row["model/learning_rate"]) in (0.01, 0.1)
        factor = float(row["global_batch_size"]) / 256
        factor = {"linear": factor, "sqrt": factor ** 0.5, "none": 1.0}[row["lr_scaling"]]
        assert float(row["learning_rate"]) == pytest.approx(float(row["base_lr"]) * factor)
        assert shown["model/units"] == row["model/units"]
        assert shown["model/learning_rate"] == f"{float(row['model/learning_rate']):.4g}"
        assert shown["lr"] == f"{float(row['learning_rate']):.4f}"
        assert shown["base_lr"] == f"{float(row['base_lr']):.4f}"
        assert shown["val_loss"] == f"{float(row['val_loss']):.4f}"
    differ = [r for r in table if float(r["learning_rate"]) != float(r["model/learning_rate"])]
    assert differ, table  # two columns of two rates, not one copied into the other


@pytest.fixture(scope="module")
def best(project):
    """The main job run from the session's best.cfg: what it printed."""
    main = run(project, "tfmulti.main", "--flagfile=session/best.cfg", "--model_dir=best")
    assert main.returncode == 0, main.stderr[-3000:]
    return main.stdout


@pytest.mark.soak  # make soak: a main job from best.cfg, 20 s (make test keeps the session itself)
def test_best_cfg_trains_on_all_the_training_data_and_reports_the_test_set(project, best):
    cfg = (project / "session" / "best.cfg").read_text()
    assert "--validation_split=0.0" in cfg and "--model_hparams={" in cfg
    assert "--synthetic" not in cfg and "--width" not in cfg  # what does not apply
    assert "(600 images, 3 classes)" in best and "test acc: " in best


@pytest.mark.soak  # make soak: needs best.cfg's run (make test keeps the session itself)
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


def test_overwrite_replaces_a_session_with_another_that_starts_over(project, monkeypatch):
    """The session's folder (a copy) opened as tfmulti.tune opens it (runner.session_in_use)
    for a session of another identity: refused and left whole without --overwrite; with it,
    the old session's trials, table, plot, best.cfg and HParams experiment are gone,
    session.json is the new session's, and keras-tuner's tuner made there starts at trial 0
    with the new session's space."""
    import shutil

    from tfmulti.distribution.devices import DevicePlan
    from tfmulti.tune import search
    from tfmulti.tune.objective import SessionObjective

    replaced = project / "replaced"
    shutil.copytree(project / "session", replaced)
    identity = {**json.loads((replaced / "session.json").read_text()),
                "--model_hparams": '{"units":8}'}
    before = sorted(p.name for p in replaced.iterdir())
    with pytest.raises(UsageError, match="holds a different tuning session \\(--model_hparams "
                                         "'' there, '\\{\"units\":8\\}' now\\)"):
        with runner.session_in_use(str(replaced), False, identity):
            pass
    assert sorted(p.name for p in replaced.iterdir()) == before
    assert {"trials", "trials.csv", "best.cfg", "accuracy.png", "tensorboard"} <= set(before)
    monkeypatch.syspath_prepend(str(project))
    base = RunConfig(model="mine:tunable", dataset="mine:data", validation_split=0.1,
                     epochs=2, model_hparams='{"units":8}')
    with runner.session_in_use(str(replaced), True, identity):
        assert sorted(p.name for p in replaced.iterdir()
                      if not p.name.startswith(".tfmulti-")) == [kinds.SESSION_FILE]
        assert json.loads((replaced / kinds.SESSION_FILE).read_text()) == identity
        hypermodel = search.TrainingHyperModel(
            DevicePlan("cpu", 2), sources.load_for(base), base,
            {"per_replica_batch_size": [16, 32]}, (0.001, 3.0),
            SessionObjective("val_loss", "min", "val_loss"))
        tuner = search.make_tuner("random", hypermodel, str(replaced), max_trials=4, seed=0)
        assert tuner.oracle.trials == {}
        first = tuner.oracle.create_trial("tuner0")
        assert first.trial_id == "0" and first.hyperparameters.values["model/units"] == 8


def test_trials_of_an_unknown_session_are_refused_and_the_workers_start_is_not(tmp_path):
    """A session's trials (its oracle's state) without session.json: refused, nothing
    written. trials/ and workers/ as srun's worker tasks make them before the chief opens the
    folder (seen under a real srun): a new session."""
    identity = {"--model": "lenet", "data set": "synthetic"}
    started = tmp_path / "started"
    (started / "trials").mkdir(parents=True)
    (started / "workers").mkdir()
    (started / "workers" / "tuner1.beat").write_text("7.0.0 1 running\n")
    assert kinds.open_session(str(started), identity) is False
    assert json.loads((started / kinds.SESSION_FILE).read_text()) == identity
    assert kinds.open_session(str(started), identity) is True  # the same one: go on
    old = tmp_path / "old"
    (old / "trials").mkdir(parents=True)
    (old / "trials" / "oracle.json").write_text("{}")
    with pytest.raises(UsageError, match="holds trials but no session.json"):
        kinds.open_session(str(old), identity)
    assert sorted(p.name for p in old.iterdir()) == ["trials"]


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


def write_images(root, n, seed):
    """USER_CODE's _images(n, seed) as PNG files in root/<class>/."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 3, n).astype(np.int32)
    images = rng.integers(0, 90, (n, 8, 9)).astype(np.uint8)
    for i, label in enumerate(labels):
        images[i, :, 3 * label:3 * label + 3] += 25
        os.makedirs(root / f"c{label}", exist_ok=True)
        tf.io.write_file(str(root / f"c{label}" / f"{i:04d}.png"),
                         tf.io.encode_png(images[i][..., None]))


@pytest.mark.soak  # two sessions, about a minute: make soak (the suite checks the decoding
# and the memory rule in process, below)
def test_a_folders_images_are_decoded_once_and_train_the_trials_as_its_files_do(project):
    """--dataset=folder:DIR: the session decodes the training images once and its trials
    read them from memory; with --nodecode_once every trial reads the files each epoch; where
    memory is too small for them (made so in the session's process), the session decodes
    them once onto disk and every trial maps that file. The same trials with the same
    figures in each mode."""
    write_images(project / "imgs" / "train", 600, 1)
    write_images(project / "imgs" / "test", 150, 2)
    common = (*SESSION, "--dataset=folder:imgs", "--max_trials=2", "--epochs=1")
    once = run(project, "tfmulti.tune", *common, "--model_dir=once")
    files = run(project, "tfmulti.tune", *common, "--nodecode_once", "--model_dir=files")
    small = ("import sys\nfrom tfmulti.decoded import dataonce\n"
             "dataonce.MEMORY_SHARE = 1e-12\nfrom tfmulti import cli\ncli.main('tune')")
    disk = run(project, "-c", small, *common, "--model_dir=disk")
    assert once.returncode == 0 and files.returncode == 0, once.stderr[-3000:]
    assert disk.returncode == 0, disk.stderr[-3000:]
    assert ": 600 training images decoded once; every trial reads them from memory (" in once.stdout
    assert ": images read from their files by every trial (--nodecode_once)" in files.stdout
    assert ": 600 training images decoded once into " in disk.stdout
    assert "; every trial reads them from there (mapped into memory)" in disk.stdout
    assert rows(project / "once") == rows(project / "files") == rows(project / "disk")
    assert len(rows(project / "once")) == 2


def test_images_that_would_take_too_much_memory_stay_files(project, monkeypatch):
    """A folder whose decoded images (once here, twice in each trial process) would pass
    the memory share is read from its files, said in one line; decoded, they are the pixels
    the files give."""
    if not (project / "imgs").exists():
        write_images(project / "imgs" / "train", 600, 1)
        write_images(project / "imgs" / "test", 150, 2)
    dataset = sources.load_for(RunConfig(dataset=f"folder:{project / 'imgs'}"))
    assert dataonce.decode_once(dataset, True, 3)[0]
    size = 600 * 8 * 9
    monkeypatch.setattr(dataonce, "MEMORY_SHARE", size * 7 / dataonce.memory_bytes())
    assert dataonce.decode_once(dataset, True, 7)[0]  # 7 copies: just fits
    decode, said = dataonce.decode_once(dataset, True, 9)
    assert not decode and said.startswith(
        "images read from their files by every trial: decoded, they would take 0.4 MB with "
        "every trial's copies, more than ")
    images = dataonce.decoded(dataset, "")
    assert images.shape == (600, 8, 9, 1) and images.dtype == np.uint8
    files = dataset.train_features
    assert np.array_equal(images, np.concatenate([files[i:i + 100] for i in range(0, 600, 100)]))


def check_the_median_rule(session, epochs=2):
    """Trial k (serial: the trials before it are the ones that could have completed) was
    pruned at the first epoch before its last at which 3 or more earlier trials had
    completed and its val_loss was above the median of theirs there. Returns the pruned
    trials' ids."""
    table = {int(r["trial"]): r for r in rows(session)}
    figures = {}
    for k in table:
        with open(session / "trials" / f"trial_{k}" / "run" / "metrics.json") as f:
            figures[k] = [r["val_loss"] for r in json.load(f)["epochs"]]
    pruned = []
    for k, row in sorted(table.items()):
        done = [j for j in table if j < k and table[j]["status"] == "COMPLETED"]
        at = next((e for e in range(1, epochs) if len(done) >= 3 and figures[k][e - 1]
                   > statistics.median(figures[j][e - 1] for j in done)), None)
        assert row["status"] == (f"PRUNED@{at}" if at else "COMPLETED"), (k, row, figures)
        assert len(figures[k]) == (at or epochs)
        pruned += [k] if at else []
    return pruned


def test_median_pruning_stops_hopeless_trials_and_tensorboard_shows_every_trial(
        project, tool, monkeypatch):
    """The median rule's decisions, and every trial's hyperparameters and figures in
    TensorBoard; the same command again (in this process, as cli.main runs it: the session
    itself ran as a real process) finds the session complete and keeps its decisions."""
    session = project / "session"
    pruned = check_the_median_rule(session)
    assert pruned, rows(session)  # the search space holds hopeless rates: some are stopped
    for k in pruned:  # a pruned trial stopped: one epoch trained, no checkpoint left
        run_folder = session / "trials" / f"trial_{k}" / "run"
        assert len(json.loads((run_folder / "metrics.json").read_text())["epochs"]) == 1
        assert not (run_folder / "checkpoints").exists()
    best = [line for line in (project / "session.txt").read_text().splitlines()
            if line.startswith("best: ")][0]
    completed = [r for r in rows(session) if r["status"] == "COMPLETED"]
    assert f"val_loss {min(float(r['val_loss']) for r in completed):.4f}" in best
    # TensorBoard's own reader: the experiment, each trial's hyperparameters and figures
    from tensorboard.backend.event_processing import plugin_event_multiplexer
    from tensorboard.plugins.hparams import metadata

    runs = plugin_event_multiplexer.EventMultiplexer()
    runs.AddRunsFromDirectory(str(session))
    runs.Reload()
    content = runs.PluginRunToTagToContent(metadata.PLUGIN_NAME)
    experiment = metadata.parse_experiment_plugin_data(
        content["tensorboard"][metadata.EXPERIMENT_TAG])
    assert {"base_lr", "per_replica_batch_size", "model/units", "model/learning_rate"} <= {
        h.name for h in experiment.hparam_infos}
    assert [(m.name.group, m.name.tag) for m in experiment.metric_infos] == [("val", "epoch_loss")]
    for k, row in {int(r["trial"]): r for r in rows(session)}.items():
        name = f"trials/trial_{k}/run/tensorboard"
        started = metadata.parse_session_start_info_plugin_data(
            content[name][metadata.SESSION_START_INFO_TAG])
        assert started.hparams["model/units"].number_value == float(row["model/units"])
        assert started.hparams["base_lr"].number_value == pytest.approx(float(row["base_lr"]))
        figures = runs.Tensors(f"{name}/val", "epoch_loss")
        assert len(figures) == (1 if k in pruned else 2)
        assert float(tf.make_ndarray(figures[-1].tensor_proto)) == pytest.approx(
            float(row["val_loss"]))
    # run again: the session is complete, its decisions kept
    before = rows(session)
    monkeypatch.chdir(project)
    monkeypatch.syspath_prepend(str(project))
    code, _, err = tool("tune", *SESSION, "--dataset=mine:data", "--model_dir=session")
    assert code == 0 and rows(session) == before, err[-2000:]


def test_the_session_plot_draws_every_trial_by_epoch_with_the_pruned_marked(project):
    """accuracy.png as the session draws it (session.draw_trials), read from the figure: on
    the right, one curve per trial through its val_loss at each epoch it trained (the
    figures of its metrics.json), a pruned trial's dashed and ending in a cross of its
    colour; on the left, each trial's last figure against the learning rate it used, the
    pruned ones as crosses."""
    import types

    import matplotlib.image
    import matplotlib.pyplot as plt

    from tfmulti.tune import session as results
    from tfmulti.tune.objective import SessionObjective

    folder = project / "session"
    with open(folder / "trials.csv") as f:
        table = [{k: v if k in ("trial", "status", "lr_scaling", "lr_schedule")
                  else float(v) if v else None for k, v in r.items()}
                 for r in csv.DictReader(f)]
    figures = {}
    for r in table:
        with open(folder / "trials" / f"trial_{r['trial']}" / "run" / "metrics.json") as f:
            figures[r["trial"]] = [(e["epoch"], e["val_loss"]) for e in json.load(f)["epochs"]]
    tuner = types.SimpleNamespace(  # what trial_curves reads of keras-tuner's tuner
        oracle=types.SimpleNamespace(trials={r["trial"]: None for r in table}),
        get_trial_dir=lambda trial_id: str(folder / "trials" / f"trial_{trial_id}"))
    curves = results.trial_curves(tuner, SessionObjective("val_loss", "min", "val_loss"))
    assert curves == figures
    pruned = {r["trial"] for r in table if r["status"].startswith("PRUNED")}
    assert pruned and len(pruned) < len(table), table
    fig = results.draw_trials(table, "mine:tunable on mine:data", "val_loss", curves)
    try:
        by_rate, by_epoch = fig.axes
        lines = by_epoch.get_lines()
        curve = {line.get_label(): line for line in lines if not line.get_label().startswith("_")}
        assert sorted(curve) == sorted(f"trial {r['trial']}" for r in table)
        for r in table:
            line, points = curve[f"trial {r['trial']}"], figures[r["trial"]]
            assert list(zip(line.get_xdata(), line.get_ydata())) == points
            crosses = [c for c in lines if c.get_marker() == "x"
                       and c.get_color() == line.get_color()]
            if r["trial"] in pruned:
                assert (line.get_linestyle(), line.get_marker()) == ("--", "None")
                assert [(c.get_xdata()[0], c.get_ydata()[0]) for c in crosses] == [points[-1]]
                assert len(points) == int(r["status"][len("PRUNED@"):])
            else:
                assert (line.get_linestyle(), line.get_marker()) == ("-", "o") and not crosses
                assert len(points) == 2
        drawn = {}
        for points in by_rate.collections:
            label = points.get_label()
            for x, y in points.get_offsets():
                drawn[(float(x), float(y))] = label
        assert drawn == {(r["learning_rate"], r["val_loss"]):
                         f"batch {r['global_batch_size']:.0f}"
                         + (", pruned" if r["trial"] in pruned else "") for r in table}
        legend = [t.get_text() for t in by_rate.get_legend().get_texts()]
        assert sorted(legend) == sorted(set(drawn.values()))
        # the session's accuracy.png is this picture
        results.plot_trials(table, str(project / "again.png"), "mine:tunable on mine:data",
                            "val_loss", curves)
        assert (matplotlib.image.imread(folder / "accuracy.png")
                == matplotlib.image.imread(project / "again.png")).all()
    finally:
        plt.close(fig)


@pytest.mark.soak
def test_a_session_killed_mid_trial_resumes_that_trial_and_ends_as_the_uninterrupted_one(
        project):
    """kill -9 of the session after trial 1's first epoch (its checkpoint saved): run again,
    trial 1 goes on from its checkpoint (its first epoch is not trained again), and the
    session ends with the trials, figures and pruning decisions of the session never
    stopped."""
    args = [*SESSION, "--dataset=mine:data", "--epochs=3", "--max_trials=5"]
    whole = run(project, "tfmulti.tune", *args, "--model_dir=whole")
    assert whole.returncode == 0, whole.stderr[-3000:]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{project}"}
    process = subprocess.Popen([sys.executable, "-m", "tfmulti.tune", *args,
                                "--model_dir=killed"], cwd=project, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    trial_1 = project / "killed" / "trials" / "trial_1" / "run"
    deadline = time.time() + 300
    while time.time() < deadline and not list((trial_1 / "checkpoints").glob("ckpt-*.index")):
        time.sleep(0.05)
    process.kill()
    assert process.wait(60) == -signal.SIGKILL, "the session ended before it was killed"
    first = json.loads((trial_1 / "metrics.json").read_text())["epochs"]
    assert len(first) == 1
    again = run(project, "tfmulti.tune", *args, "--model_dir=killed")
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads((trial_1 / "metrics.json").read_text())["epochs"][0] == first[0]
    assert rows(project / "killed") == rows(project / "whole")
    assert check_the_median_rule(project / "killed", epochs=3)


@pytest.mark.soak
def test_a_session_killed_after_a_trial_was_pruned_keeps_that_decision(project):
    """kill -9 of the session once its first pruned trial is recorded (its trial.json and
    the oracle's end order say so), as the next trial starts: run again, the pruned trial is
    not run again (its files as they were) and stays pruned, and the session ends with the
    trials, figures and decisions of the session never stopped (whole/, test above)."""
    args = [*SESSION, "--dataset=mine:data", "--epochs=3", "--max_trials=5"]
    if not (project / "whole" / "trials.csv").exists():
        assert run(project, "tfmulti.tune", *args, "--model_dir=whole").returncode == 0
    whole = rows(project / "whole")
    pruned = next(r["trial"] for r in whole if r["status"].startswith("PRUNED"))
    assert int(pruned) < len(whole) - 1, whole  # a trial follows it
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{project}"}
    process = subprocess.Popen([sys.executable, "-m", "tfmulti.tune", *args,
                                "--model_dir=killed_pruned"], cwd=project, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    trials = project / "killed_pruned" / "trials"

    def recorded():
        try:
            ended = json.loads((trials / "oracle.json").read_text())["end_order"]
            trial = json.loads((trials / f"trial_{pruned}" / "trial.json").read_text())
        except (OSError, ValueError, KeyError):
            return False
        return pruned in ended and trial["status"] == "COMPLETED" and trial["metrics"][
            "metrics"]["pruned"]["observations"][-1]["value"] == [1.0]

    deadline = time.time() + 300
    while time.time() < deadline and process.poll() is None and not recorded():
        time.sleep(0.02)
    process.kill()
    assert process.wait(60) == -signal.SIGKILL, "the session ended before it was killed"
    assert recorded()
    folder = trials / f"trial_{pruned}"
    kept = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in folder.rglob("*") if p.is_file()}
    assert len(json.loads((folder / "run" / "metrics.json").read_text())["epochs"]) == 1
    again = run(project, "tfmulti.tune", *args, "--model_dir=killed_pruned")
    assert again.returncode == 0, again.stderr[-3000:]
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in folder.rglob("*")
            if p.is_file()} == kept  # not run again
    assert rows(project / "killed_pruned") == whole
    assert int(pruned) in check_the_median_rule(project / "killed_pruned", epochs=3)


def stop_when(process, ready, sig=signal.SIGTERM, seconds=300):
    """Sends sig to the session once ready() holds; returns (exit code, its last line)."""
    deadline = time.time() + seconds
    while time.time() < deadline and process.poll() is None and not ready():
        time.sleep(0.05)
    process.send_signal(sig)
    _, err = process.communicate(timeout=120)
    return process.returncode, err.strip().splitlines()[-1] if err.strip() else ""


@pytest.mark.soak
def test_sigterm_stops_a_session_with_exit_75_and_it_goes_on_as_if_never_stopped(project):
    """A real SIGTERM mid-trial (after trial 1's first checkpoint) and as trial 2's process
    starts: each time the session exits 75 in one line; run again to the end, it has the
    trials, figures and decisions of the session never stopped (test above: whole/)."""
    args = [*SESSION, "--dataset=mine:data", "--epochs=3", "--max_trials=5",
            "--model_dir=stopped"]
    if not (project / "whole" / "trials.csv").exists():
        assert run(project, "tfmulti.tune", *args[:-1], "--model_dir=whole").returncode == 0
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{project}"}
    trials = project / "stopped" / "trials"

    def start():
        return subprocess.Popen([sys.executable, "-m", "tfmulti.tune", *args], cwd=project,
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True)

    code, line = stop_when(start(), lambda: list(
        (trials / "trial_1" / "run" / "checkpoints").glob("ckpt-*.index")))
    assert code == 75 and line.startswith("tfmulti: tuning stopped by SIGTERM in trial 1 at "
                                          "its step "), line
    code, line = stop_when(start(), lambda: (trials / "trial_2").is_dir())
    assert code == 75 and "tfmulti: tuning stopped by SIGTERM" in line, line
    again = run(project, "tfmulti.tune", *args)
    assert again.returncode == 0, again.stderr[-3000:]
    assert rows(project / "stopped") == rows(project / "whole")


ADAM = textwrap.dedent('''
    import keras
    from keras import layers

    from mine import data  # noqa: F401 - the same images


    def adam(input_shape, num_classes, hp):
        units = hp.Int("units", 4, 16, step=4)
        model = keras.Sequential([keras.Input(input_shape), layers.Rescaling(1 / 255),
                                  layers.Flatten(), layers.Dense(units, activation="relu"),
                                  layers.Dense(num_classes)])
        model.compile(optimizer=keras.optimizers.Adam(0.003),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
        return model
''')


@pytest.mark.parametrize("searched", [  # make test: the model's own rate kept
    [], pytest.param(["--tune_lr_range=0.01,0.1"], marks=pytest.mark.soak)])
def test_a_model_compiled_with_its_own_optimizer_trains_its_trials_at_its_own_rate(
        tmp_path, two_replicas, searched):
    """Adam compiled at 0.003: a session's trials train at that rate, as fit would (tfmulti's
    SGD range, base_lr 0.01-1 per 256, once replaced it: trials at 0.08-0.1, one stalled);
    best.cfg leaves the rate to the model. --tune_lr_range searches tfmulti's rate instead."""
    import contextlib
    import io

    from conftest import in_this_process

    (tmp_path / "mine.py").write_text(USER_CODE)
    (tmp_path / "compiled.py").write_text(ADAM)
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as patched, contextlib.redirect_stdout(out):
        patched.chdir(tmp_path)
        patched.syspath_prepend(str(tmp_path))
        trials_in_this_process(patched, two_replicas)
        code = in_this_process("tune", "--model=compiled:adam", "--dataset=mine:data",
                               "--cpu_replicas=2", "--epochs=1", "--max_trials=2",
                               "--tune_batch_sizes=16", *searched, "--model_dir=session")
    said = out.getvalue()
    assert code == 0, said[-3000:]
    table = rows(tmp_path / "session")
    assert len(table) == 2
    kept = ("--model=compiled:adam is compiled with Adam: its trials train at its own learning "
            "rate 0.003, as model.fit trains it") in said
    best = (tmp_path / "session" / "best.cfg").read_text()
    if searched:
        assert not kept and all(0.01 <= float(r["base_lr"]) <= 0.1 for r in table), table
        assert "--base_lr=" in best
    else:
        assert kept, said
        assert {(r["base_lr"], r["lr_scaling"], round(float(r["learning_rate"]), 6))
                for r in table} == {("", "", 0.003)}, table
        assert "--base_lr" not in best and "--lr_scaling" not in best and "units" in best
