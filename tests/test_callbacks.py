"""Your Keras callbacks (--callbacks=MODULE:FUNCTION) are called as model.fit calls them
(#53): the same hooks in the same order, the logs under fit's names, a rate they set is the
rate that trains (and is in the checkpoint), model.stop_training ends the run as fit's (the
run then complete), and weights they set at the end are the weights saved and reported."""
import json
import os
import signal
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest

from tfmulti.data import sources
from tfmulti.errors import UsageError
from tfmulti.run import callbacks
from tfmulti.run.config import RunConfig
from tfmulti.rundir import names
from tfmulti.training import loop, train

# A small classifier compiled as keras-io compiles one, its data made locally, and the
# callbacks a fit user writes: Keras's own and one that records what it is given.
USERS = textwrap.dedent('''
    import keras
    import numpy as np
    from keras import layers

    rng = np.random.default_rng(0)
    centers = rng.normal(size=(4, 8)).astype("float32") * 2


    def split(n):
        labels = rng.integers(0, 4, n).astype("int64")
        return (centers[labels] + rng.normal(size=(n, 8)).astype("float32")), labels


    (x, y), (tx, ty) = split(256), split(128)


    def data():
        return (x, y), (tx, ty)


    def classifier(input_shape=(8,), num_classes=4):
        keras.utils.set_random_seed(1)
        inputs = keras.Input(shape=input_shape)
        hidden = layers.Dense(16, activation="relu")(inputs)
        model = keras.Model(inputs, layers.Dense(num_classes, activation="softmax")(hidden))
        model.compile(optimizer=keras.optimizers.Adam(0.01),
                      loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        return model


    class Recorder(keras.callbacks.Callback):
        """Every hook fit calls (but the test batches'), with the keys of its logs, and the
        optimizer's rate at each epoch's end."""

        def __init__(self):
            super().__init__()
            self.calls, self.rates = [], []

        def _note(self, hook, *args, logs=None):
            self.calls.append((hook, *args, tuple(sorted(logs or {}))))

        def on_train_begin(self, logs=None):
            self._note("train_begin", logs=logs)

        def on_epoch_begin(self, epoch, logs=None):
            self._note("epoch_begin", epoch, logs=logs)

        def on_train_batch_begin(self, batch, logs=None):
            self._note("batch_begin", batch)

        def on_train_batch_end(self, batch, logs=None):
            self._note("batch_end", batch, logs=logs)

        def on_test_begin(self, logs=None):
            self._note("test_begin", logs=logs)

        def on_test_end(self, logs=None):
            self._note("test_end", logs=logs)

        def on_epoch_end(self, epoch, logs=None):
            self._note("epoch_end", epoch, logs=logs)
            self.rates.append(float(keras.ops.convert_to_numpy(
                self.model.optimizer.learning_rate)))

        def on_train_end(self, logs=None):
            self._note("train_end", logs=logs)


    class StopAfter(keras.callbacks.Callback):
        def __init__(self, epoch):
            super().__init__()
            self.epoch = epoch

        def on_epoch_end(self, epoch, logs=None):
            if epoch == self.epoch:
                self.model.stop_training = True


    made = []


    def callbacks():
        made.append([Recorder(), StopAfter(2),
                     keras.callbacks.LearningRateScheduler(
                         lambda epoch, rate: rate if epoch == 0 else rate * 0.5),
                     keras.callbacks.CSVLogger("log.csv")])
        return made[-1]


    def best_kept():
        # "best" loss is the highest: the first epoch's; no better one in the second
        return [keras.callbacks.EarlyStopping(monitor="loss", mode="max", patience=1,
                                              restore_best_weights=True)]
''')


def config(module, **settings):
    return RunConfig(model=f"{module}:classifier", dataset=f"{module}:data",
                     global_batch_size=32, seed=0, deterministic=True, checkpoint_steps=0,
                     **settings)


def trained(strategy, cfg, model_dir, verbose=1):
    model_dir.mkdir(exist_ok=True)
    dataset = sources.load_for(cfg)
    train.train_and_evaluate(strategy, dataset, cfg, verbose=verbose, model_dir=str(model_dir))
    return json.loads((model_dir / names.METRICS_FILE).read_text())["epochs"]


def test_your_callbacks_are_called_as_fit_calls_them(two_replicas, importable, tmp_path,
                                                     capsys):
    """Side by side with fit on the same model and data: the same hooks in the same order
    (one step per call, as fit's default steps_per_execution), the logs under fit's keys, a
    rate LearningRateScheduler sets is the rate that trains, CSVLogger writes fit's columns,
    and a callback's model.stop_training at epoch 3 of 5 ends the run there, complete: run
    again, it trains nothing and says why."""
    module = importable("yours", USERS)
    cfg = config(module, epochs=5, steps_per_call=1, callbacks=f"{module}:callbacks")
    run = tmp_path / "run"
    epochs = trained(two_replicas, cfg, run)
    users = __import__(module)
    ours = users.made[-1]
    fitted = users.classifier()
    theirs = users.callbacks()
    (tmp_path / "log.csv").rename(tmp_path / "ours.csv")
    fitted.fit(users.x, users.y, batch_size=32, epochs=5, verbose=0, callbacks=theirs,
               shuffle=False)
    assert ours[0].calls == theirs[0].calls  # hooks, batch numbers, the logs' keys
    assert len(ours[0].calls) == 2 + 3 * (2 + 2 * 8)
    assert ("epoch_end", 2, ("accuracy", "loss")) in ours[0].calls
    assert ours[0].rates == pytest.approx(theirs[0].rates) == [0.01, 0.005, 0.0025]
    assert [r["learning_rate"] for r in epochs] == pytest.approx([0.01, 0.005, 0.0025])
    assert (tmp_path / "ours.csv").read_text().splitlines()[0] == (
        tmp_path / "log.csv").read_text().splitlines()[0]
    assert len((tmp_path / "ours.csv").read_text().splitlines()) == 4  # a header, 3 epochs
    assert len(epochs) == 3 and loop.stopped_by_callbacks(epochs)
    said = capsys.readouterr().out
    assert "your callbacks stopped the run (model.stop_training) at step 24: it is complete" in said

    made = len(users.made)
    again = trained(two_replicas, cfg, run)
    assert again == epochs and len(users.made) == made  # nothing trained, no callback made
    assert (f"The run in {run} is complete (24 steps, stopped by your callbacks)"
            in capsys.readouterr().out)


def test_a_stop_mid_epoch_comes_after_the_call_your_callbacks_saw(one_replica, importable,
                                                                  tmp_path, monkeypatch):
    """A SIGTERM (or Ctrl-C) that arrives during epoch 1's third call (steps 5 and 6 of 8):
    your callbacks get that call's on_train_batch_end and no on_epoch_end for the epoch cut
    short; the run stops with its checkpoint at step 6."""
    import contextlib

    import tensorflow as tf

    from tfmulti.rundir import lifecycle

    module = importable("yours", USERS)
    cfg = config(module, epochs=2, steps_per_call=2, callbacks=f"{module}:callbacks")
    engines = []
    build = train.build_engine
    monkeypatch.setattr(train, "build_engine", lambda *a: engines.append(build(*a)) or engines[-1])

    @contextlib.contextmanager
    def sigterm_at_step_5(say=print):
        yield lambda: "SIGTERM" if engines and engines[-1].step >= 5 else ""

    monkeypatch.setattr(train, "stop_on_request", sigterm_at_step_5)
    with pytest.raises(loop.Preempted) as stopped:
        trained(one_replica, cfg, tmp_path / "run", verbose=0)
    calls = [call[:2] for call in __import__(module).made[-1][0].calls]
    assert (stopped.value.step, stopped.value.by) == (6, "SIGTERM")
    assert calls[-2:] == [("batch_begin", 4), ("batch_end", 5)], calls
    assert not any(hook == "epoch_end" for hook, *_ in calls)
    assert tf.train.latest_checkpoint(
        str(tmp_path / "run" / lifecycle.CHECKPOINT_DIR)).endswith("ckpt-6")


@pytest.mark.soak  # make test's time on the slower kind: the hooks are checked above
def test_with_a_validation_part_the_logs_carry_fits_val_figures(one_replica, importable,
                                                                 tmp_path):
    """With --validation_split the validation hooks and the val_ figures come as fit gives
    them with validation_data (fit given as many batches: 191 examples train 5 steps)."""
    module = importable("yours", USERS)
    cfg = config(module, epochs=1, steps_per_call=1, validation_split=0.25,
                 callbacks=f"{module}:callbacks")
    trained(one_replica, cfg, tmp_path / "run")
    users = __import__(module)
    ours, theirs = users.made[-1][0], users.callbacks()[0]
    users.classifier().fit(users.x[:160], users.y[:160], batch_size=32, epochs=1, verbose=0,
                           callbacks=[theirs], validation_data=(users.x[192:], users.y[192:]))
    assert ours.calls == theirs.calls
    assert ("epoch_end", 0, ("accuracy", "loss", "val_accuracy", "val_loss")) in ours.calls


def test_weights_a_callback_sets_at_the_end_are_saved_and_reported(one_replica, importable,
                                                                   tmp_path, capsys):
    """EarlyStopping(restore_best_weights=True) puts the best epoch's weights back at the
    end: the run's last figures are made again on them (the first epoch's, exactly: the same
    weights), and the saved model holds them; fit stops at the same epoch."""
    module = importable("yours", USERS)
    cfg = config(module, epochs=4, callbacks=f"{module}:best_kept")
    epochs = trained(one_replica, cfg, tmp_path / "run")
    assert len(epochs) == 2 and loop.stopped_by_callbacks(epochs)
    assert epochs[-1][loop.WEIGHTS_SET_BY_CALLBACKS]
    assert epochs[-1]["test_acc"] == epochs[0]["test_acc"]
    assert epochs[-1]["test_loss"] == pytest.approx(epochs[0]["test_loss"], rel=1e-6)
    assert "your callbacks set the model's weights at the end of training" in (
        capsys.readouterr().out)
    users = __import__(module)
    saved = keras.saving.load_model(tmp_path / "run" / names.MODEL_FILE)
    saved.compile(loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    figures = saved.evaluate(users.tx, users.ty, verbose=0, return_dict=True)
    assert figures["accuracy"] == pytest.approx(epochs[-1]["test_acc"], abs=1e-6)
    history = users.classifier().fit(users.x, users.y, batch_size=32, epochs=4, verbose=0,
                                     callbacks=users.best_kept())
    assert len(history.epoch) == 2


def test_callbacks_that_cannot_work_are_refused_in_one_line():
    spec = "yours:callbacks"
    assert callbacks.checked(keras.callbacks.History(), spec, True)  # one, not in a list
    for made, said in [
            (None, "returned NoneType; return a list of keras.callbacks.Callback"),
            ([print], "returned builtin_function_or_method in its list; each must be a "
                      "keras.callbacks.Callback"),
            ([keras.callbacks.BackupAndRestore("backup")], "leave BackupAndRestore out: "
             "tfmulti's checkpoints (--model_dir, --checkpoint_steps) already resume the run "
             "exactly, mid-epoch too"),
            ([keras.callbacks.ReduceLROnPlateau()], "ReduceLROnPlateau sets the learning rate, "
             "which a schedule drives in this run")]:
        with pytest.raises(UsageError, match="^--callbacks=yours:callbacks") as refused:
            callbacks.checked(made, spec, settable_rate=False)
        assert said in str(refused.value)
    with pytest.raises(UsageError, match="--callbacks=nope: give MODULE:FUNCTION"):
        RunConfig(callbacks="nope")
    assert np.isfinite(RunConfig(callbacks="a:b", warmup_epochs=0).settable_rate)
    assert not RunConfig(callbacks="a:b", lr_schedule="cosine").settable_rate


# Callbacks that stop or kill the process they run in, for the runs below (real processes).
FAULTS = textwrap.dedent('''
    import os
    import signal
    import sys

    import keras

    from yours import *  # noqa: F401,F403  the model and data above


    def halving():  # a rate of the epoch alone: a resumed epoch sets the same one
        return [keras.callbacks.LearningRateScheduler(lambda epoch, rate: 0.01 * 0.5 ** epoch)]


    class Kill(keras.callbacks.Callback):
        """kill -9 of this process at a moment, once (a file says it happened)."""

        def __init__(self, hook, number):
            super().__init__()
            self.hook, self.number = hook, number

        def _maybe(self, hook, number):
            if (hook, number) == (self.hook, self.number) and not os.path.exists("killed"):
                open("killed", "w").close()
                os.kill(os.getpid(), signal.SIGKILL)

        def on_train_batch_end(self, batch, logs=None):
            self._maybe("batch", batch)

        def on_epoch_end(self, epoch, logs=None):
            self._maybe("epoch_end", epoch)


    def killed_at_batch():
        return [*halving(), Kill("batch", 5)]


    def killed_at_epoch_end():
        return [*halving(), Kill("epoch_end", 1)]


    class StopOnWorkerOne(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if "--task_index=1" in sys.argv and batch == 3:
                self.model.stop_training = True


    def one_worker_stops():
        return [StopOnWorkerOne()]
''')


def main_job(tmp_path, *flags):
    """python -m tfmulti.main with the modules in tmp_path importable; started."""
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CONFIG", "TF_CPP_MIN_LOG_LEVEL")}
    env["PYTHONPATH"] = str(tmp_path)
    return subprocess.Popen(
        [sys.executable, "-m", "tfmulti.main", "--model=faults:classifier",
         "--dataset=faults:data", "--global_batch_size=32", "--seed=0", "--deterministic",
         "--intra_op_threads=1", *flags], cwd=tmp_path, env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def faults_written(tmp_path):
    (tmp_path / "yours.py").write_text(USERS)
    (tmp_path / "faults.py").write_text(FAULTS)


@pytest.mark.soak  # 3 runs of the main job per moment, about 40 s
@pytest.mark.parametrize("moment", ["batch", "epoch_end"])
def test_kill_9_from_a_callback_resumes_to_the_uninterrupted_runs_weights(tmp_path, moment):
    """kill -9 in the middle of an epoch (after step 6, between checkpoints) and in the
    callbacks of an epoch's end (before that epoch's checkpoint), a rate set by
    LearningRateScheduler on the way: resumed, the run ends with the weights of the run never
    killed, bit for bit."""
    faults_written(tmp_path)
    common = ["--epochs=3", "--cpu_replicas=2", "--steps_per_call=2", "--checkpoint_steps=4"]
    whole = main_job(tmp_path, *common, "--callbacks=faults:halving",
                     f"--model_dir={tmp_path}/whole")
    out, err = whole.communicate(timeout=300)
    assert whole.returncode == 0, err[-2000:]
    killed = [*common, f"--callbacks=faults:killed_at_{moment}", f"--model_dir={tmp_path}/run"]
    first = main_job(tmp_path, *killed)
    out, err = first.communicate(timeout=300)
    assert first.returncode == -signal.SIGKILL and (tmp_path / "killed").exists(), err[-2000:]
    again = main_job(tmp_path, *killed)
    out, err = again.communicate(timeout=300)
    assert again.returncode == 0, err[-2000:]
    assert "Resuming the run in" in out
    load = keras.saving.load_model
    for mine, theirs in zip(load(tmp_path / "run" / names.MODEL_FILE).get_weights(),
                            load(tmp_path / "whole" / names.MODEL_FILE).get_weights()):
        np.testing.assert_array_equal(mine, theirs)
    rates = [r["learning_rate"] for r in json.loads(
        (tmp_path / "run" / names.METRICS_FILE).read_text())["epochs"]]
    assert rates == pytest.approx([0.01, 0.005, 0.0025])


@pytest.mark.soak  # two workers, about 30 s
def test_a_stop_one_workers_callback_asks_stops_every_worker_at_the_same_step(tmp_path):
    """Only worker 1's callback sets model.stop_training (after its 4th step): both workers
    stop after that call, the run complete, with the same weights."""
    from tfmulti.processes import launcher

    faults_written(tmp_path)
    hosts = ",".join(f"localhost:{p}" for p in launcher.free_ports(2))
    flags = ["--epochs=2", "--steps_per_call=2", "--callbacks=faults:one_worker_stops",
             f"--worker_hosts={hosts}", f"--model_dir={tmp_path}/run"]
    workers = [main_job(tmp_path, *flags, f"--task_index={i}") for i in range(2)]
    outputs = [p.communicate(timeout=300) for p in workers]
    assert [p.returncode for p in workers] == [0, 0], outputs[1][1][-3000:]
    said = outputs[0][0]
    assert "your callbacks stopped the run (model.stop_training) at step 4: it is complete" in said
    assert "weights: the same on all 2 workers" in said
    epochs = json.loads((tmp_path / "run" / names.METRICS_FILE).read_text())["epochs"]
    assert [r["step"] for r in epochs] == [4] and loop.stopped_by_callbacks(epochs)
