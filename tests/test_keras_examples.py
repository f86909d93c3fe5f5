"""Keras examples as their authors wrote them (tests/keras_examples: keras.io's model code, the
data made small and offline) train through tfmulti on 2 replicas to figures within the noise
of model.fit on one device (#53): an image classifier with augmentation, a vision
transformer, a text transformer, structured data (tf.data sets, named inputs, one sigmoid),
a time-series transformer, the trainer pattern (its own train_step), knowledge distillation
(its own compile and compute_loss), an endpoint layer (add_loss, no compiled loss), and
imbalanced classification (class weights and a ModelCheckpoint callback), a variational
autoencoder and a conditional GAN (no call(), no test part: their training logs are compared,
their weights saved; the GAN's two optimizers kept by its own compile).

The noise is measured (benchmarks/keras_examples.py: several seeds of each side, in
benchmarks/results/keras_examples.json); tfmulti's seed-0 figure must be within it of fit's.
make test runs the endpoint-layer example in this process (its figure fit's exactly) and
serves its SavedModel here; make soak runs
all eleven in processes of their own, each also killed with kill -9 mid-epoch and run again to
the uninterrupted run's weights, its SavedModel serving the reported figure to a process
that never imports tfmulti."""
import json
import pathlib
import subprocess

import numpy as np
import pytest

from tfmulti.data import sources
from tfmulti.run.config import RunConfig
from tfmulti.rundir import names
from tfmulti.training import train

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "tests" / "keras_examples"
NOISE = json.loads((ROOT / "benchmarks" / "results" / "keras_examples.json").read_text())
LIGHT = ("endpoint",)


@pytest.fixture
def conformance(monkeypatch, tmp_path):
    """tests/keras_examples/conformance.py, the examples importable as a user's modules, in a
    scratch working directory (callbacks write there)."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    monkeypatch.chdir(tmp_path)
    import conformance

    return conformance


def within_noise(name, ours, fits):
    noise = NOISE["examples"][name]["noise"]
    assert abs(ours - fits) <= noise + 1e-6, (
        f"{name}: tfmulti {ours:.4f}, fit {fits:.4f}, apart by more than the noise {noise} "
        f"measured over {NOISE['examples'][name]['seeds']} seeds")


def last_record(model_dir):
    return json.loads((pathlib.Path(model_dir) / names.METRICS_FILE).read_text())["epochs"][-1]


@pytest.mark.parametrize("name", LIGHT)  # the others in make soak, below
def test_an_example_as_written_trains_on_two_replicas_as_fit_does(name, conformance,
                                                                   two_replicas, tmp_path):
    import keras
    import serve

    fits = conformance.fitted(name)[1]  # first, then tfmulti imports the example afresh,
    keras.utils.set_random_seed(0)  # seeded first as tfmulti.main --deterministic does
    module = conformance.example(name, fresh=True)
    cfg = RunConfig(model=f"{name}:model", dataset=f"{name}:data", seed=0,
                    global_batch_size=module.BATCH_SIZE, epochs=module.EPOCHS,
                    deterministic=True, checkpoint_steps=0)
    (tmp_path / "run").mkdir()
    train.train_and_evaluate(two_replicas, sources.load_for(cfg), cfg,
                             model_dir=str(tmp_path / "run"))
    ours = conformance.test_figure(last_record(tmp_path / "run"), module.METRIC)
    within_noise(name, ours, fits[module.METRIC])
    features, targets = conformance.test_part(name)
    outputs = serve.call(str(tmp_path / "run" / names.SAVED_MODEL_DIR),
                         features if isinstance(features, dict) else {"features": features})
    if not getattr(module, "SERVES_ITS_FIGURE", True):  # what it serves carries no figure:
        assert set(outputs) == {"outputs"}  # its outputs (a softmax of one logit, 1.0)
        return
    figure, count = conformance.score(outputs, targets, module.METRIC)
    assert figure == pytest.approx(ours, abs=1.01 / count)  # one example's call at 0.5


def steps_of_an_epoch(model_dir):
    return json.loads((pathlib.Path(model_dir) / names.METRICS_FILE).read_text()
                      )["epochs"][0]["step"]


@pytest.mark.soak  # make soak: 11 examples, 3 processes each (about 12 minutes)
@pytest.mark.parametrize("name", ("augment", "vit", "text", "structured", "timeseries",
                                  "trainer", "distill", "endpoint", "imbalanced", "vae", "cgan"))
def test_an_example_as_written_trains_resumes_and_serves(name, conformance, tmp_path):
    from test_resume import killed_when_saved

    module = conformance.example(name)
    env = conformance.environment()

    def finished(model_dir):
        done = subprocess.run([*conformance.command(name, model_dir), "--checkpoint_steps=4"],
                              cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=900)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        return done.stdout

    finished(tmp_path / "whole")
    whole = json.loads((tmp_path / "whole" / names.METRICS_FILE).read_text())
    ours = conformance.test_figure(whole["epochs"][-1], module.METRIC)
    within_noise(name, conformance.comparable(name, ours),
                 conformance.fitted(name)[1][module.METRIC])

    spe = steps_of_an_epoch(tmp_path / "whole")
    step = killed_when_saved([*conformance.command(name, tmp_path / "killed"),
                              "--checkpoint_steps=4"], env, tmp_path / "killed",
                             (lambda s: s % spe != 0) if spe > 4 else (lambda s: s >= 1),
                             cwd=tmp_path)
    assert f"at step {step + 1}" in finished(tmp_path / "killed")
    resumed = json.loads((tmp_path / "killed" / names.METRICS_FILE).read_text())
    assert resumed["weights_fingerprints"] == whole["weights_fingerprints"], step
    assert conformance.test_figure(resumed["epochs"][-1], module.METRIC) == ours

    if module.data()[1] is None:  # no test part (the VAE): nothing to serve, its weights
        fresh = module.model(None, None)  # load into the model its function returns
        fresh.built = True
        fresh.load_weights(tmp_path / "whole" / names.WEIGHTS_FILE)
        assert not (tmp_path / "whole" / names.SAVED_MODEL_DIR).exists()
        return
    figure, count, imported = conformance.served(name, str(tmp_path / "whole"), str(tmp_path))
    assert not imported
    if module.METRIC == "loss":
        assert figure == pytest.approx(ours, rel=1e-4)
    elif getattr(module, "SERVES_ITS_FIGURE", True):
        assert figure == pytest.approx(ours, abs=1.01 / count)
    else:  # it served (the endpoint example's softmax of one logit: 1.0, no figure)
        assert figure is None


@pytest.mark.soak  # make soak: each on 2 workers and in one 2-replica process (about 3 min)
@pytest.mark.parametrize("name", ("vae", "cgan"))
def test_a_model_without_call_trains_on_two_workers_as_on_two_replicas(name, conformance,
                                                                       tmp_path):
    """keras.io's VAE (its own train_step, one optimizer) and conditional GAN (two kept
    optimizers) on two workers (tfmulti.launch, one replica each) end where one process on
    2 replicas ends: the same global steps, their gradients summed across the workers by
    each optimizer; both workers hold the same weights, and the logs are the same figures."""
    module = conformance.example(name)
    env = conformance.environment()
    single = subprocess.run(conformance.command(name, tmp_path / "single"), cwd=tmp_path,
                            env=env, capture_output=True, text=True, timeout=900)
    assert single.returncode == 0, single.stderr[-3000:]
    main = conformance.command(name, tmp_path / "two", replicas=1)
    launched = subprocess.run([main[0], "-m", "tfmulti.launch", "--workers=2", "--",
                               *main[3:]], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=900)
    assert launched.returncode == 0, launched.stdout[-3000:] + launched.stderr[-2000:]
    assert "weights: the same on all 2 workers" in launched.stdout
    one, two = last_record(tmp_path / "single"), last_record(tmp_path / "two")
    assert two["step"] == one["step"]
    for log in [key for key in one if key.startswith("train_") or key == "loss"]:
        assert two[log] == pytest.approx(one[log], rel=1e-3, nan_ok=True), log  # a GAN: no loss
    weights = []
    for run in ("single", "two"):
        fresh = module.model(None, None)
        fresh.built = True
        fresh.load_weights(tmp_path / run / names.WEIGHTS_FILE)
        weights.append(fresh.get_weights())
    for a, b in zip(*weights):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4)


def test_a_model_without_call_trains_on_data_without_a_test_part(conformance, two_replicas,
                                                                 tmp_path, capsys):
    """keras.io's VAE (its own train_step, no call()) on `((x, None), None)`, as
    vae.fit(x) takes it: it trains on 2 replicas (it was "does not have a call() method"),
    reports its train_step's logs, writes its weights (nothing to serve); a part to evaluate
    it on is refused in one line (Keras's test_step would call it)."""
    from tfmulti.errors import UsageError

    cfg = RunConfig(model="vae:model", dataset="vae:data", global_batch_size=128, epochs=1,
                    seed=0, deterministic=True, checkpoint_steps=0)
    dataset = sources.load_for(cfg)
    assert dataset.test_size == 0 and dataset.train_targets is None
    (tmp_path / "run").mkdir()
    line, history = train.train_and_evaluate(two_replicas, dataset, cfg,
                                             model_dir=str(tmp_path / "run"))
    said = capsys.readouterr().out
    assert "--model=vae:model has its own train_step and no call(): it trains" in said, said
    assert "no model.keras or saved_model/: VAE has no call()" in said
    assert line.startswith("train loss: ") and "test_loss" not in history[-1]
    assert history[-1]["train_kl_loss"] > 0 and history[-1]["loss"] > 0
    assert (tmp_path / "run" / names.WEIGHTS_FILE).exists()
    assert not (tmp_path / "run" / names.SAVED_MODEL_DIR).exists()
    from tfmulti.evaluate import evaluation

    with pytest.raises(UsageError, match="its model has no call\\(\\) \\(a VAE, a GAN: it only "
                       "trains\\), so there is nothing to evaluate; its weights are in "
                       "model.weights.h5"):
        evaluation.evaluate_run(str(tmp_path / "run"), {})
    held = RunConfig(model="vae:model", dataset="vae:data", global_batch_size=128, epochs=1,
                     validation_split=0.1)
    with pytest.raises(UsageError, match=r"--model=vae:model has no call\(\), so it has no "
                       "outputs to evaluate on the validation part"):
        train.train_and_evaluate(two_replicas, sources.load_for(held), held)
