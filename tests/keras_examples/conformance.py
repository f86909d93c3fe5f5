"""What the tests and the benchmark of the Keras examples share: the examples' names, model.fit
on one device as each example calls it, and the tfmulti command that trains it on 2 CPU
replicas. `python conformance.py fit NAME SEED` prints fit's figures as JSON (a process of
its own, as a user runs the example)."""
import importlib
import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
NAMES = ("augment", "vit", "text", "structured", "timeseries", "trainer", "distill",
         "endpoint", "imbalanced", "vae", "cgan")
REPLICAS = 2


def example(name, fresh=False):
    """The example's module (this folder on the path, as tfmulti finds a user's module);
    fresh: imported again (what it made at import, its random layers' state among them, as a
    new process has it)."""
    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    if fresh:
        sys.modules.pop(name, None)
    return importlib.import_module(name)


def fitted(name, seed=0):
    """The example trained by model.fit on one device and evaluated on its test part, as
    the example calls them (its batch size, its fit arguments, fewer epochs): the model and
    evaluate's figures (an example without a test part: its last epoch's training logs)."""
    import keras
    import tensorflow as tf

    keras.utils.set_random_seed(seed)  # before the import: what it makes there is seeded,
    module = example(name, fresh=True)  # as tfmulti --deterministic seeds before importing
    model = module.model(None, None)
    train, test = module.data()[:2]
    more = module.FIT() if hasattr(module, "FIT") else {}
    with tf.device("/CPU:0"):
        if test is None:  # fit(x) and nothing to evaluate
            history = model.fit(*train, batch_size=module.BATCH_SIZE, epochs=module.EPOCHS,
                                verbose=0, **more)
            figures = {name: values[-1] for name, values in history.history.items()}
        elif isinstance(train, tf.data.Dataset):
            model.fit(train.batch(module.BATCH_SIZE), epochs=module.EPOCHS, verbose=0, **more)
            figures = model.evaluate(test.batch(module.BATCH_SIZE), verbose=0,
                                     return_dict=True)
        else:
            model.fit(*train, batch_size=module.BATCH_SIZE, epochs=module.EPOCHS, verbose=0,
                      **more)
            figures = model.evaluate(*test, batch_size=module.BATCH_SIZE, verbose=0,
                                     return_dict=True)
    return model, {k: float(v) for k, v in figures.items()}


def command(name, model_dir, seed=0, replicas=REPLICAS):
    """tfmulti's command line for the example: the same batch, epochs and seed, and the fit
    arguments tfmulti takes as flags."""
    module = example(name)
    return [sys.executable, "-m", "tfmulti.main", f"--model={name}:model",
            f"--dataset={name}:data", f"--cpu_replicas={replicas}",
            f"--global_batch_size={module.BATCH_SIZE}", f"--epochs={module.EPOCHS}",
            f"--seed={seed}", "--deterministic", f"--model_dir={model_dir}",
            *getattr(module, "FLAGS", [])]


def comparable(name, figure, replicas=REPLICAS):
    """tfmulti's figure as one device's: times the replica count for an example whose logs
    Keras divides by it under tf.distribute (cgan.py), else as it is."""
    return figure * replicas if getattr(example(name), "LOGS_DIVIDED_BY_REPLICAS", False) \
        else figure


def environment():
    """The environment of a tfmulti process that imports the examples."""
    paths = [HERE, os.path.dirname(os.path.dirname(HERE))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "TF_CPP_MIN_LOG_LEVEL": "2"}


def test_figure(record, metric):
    """The run's test figure of the example's metric in a metrics.json epoch record (its
    training figure when it has no test part)."""
    if f"test_{metric}" in record:
        return record[f"test_{metric}"]
    if "test_loss" in record:  # an accuracy (Keras's "acc" or "accuracy"): tfmulti's test_acc
        return record["test_acc"]
    return record["loss"] if metric == "loss" else record[f"train_{metric}"]


def test_part(name):
    """The example's test features and targets as numpy (a tf.data set read once)."""
    import tensorflow as tf

    test = example(name).data()[1]
    if not isinstance(test, tf.data.Dataset):
        return test[0], test[1]
    rows = list(test.as_numpy_iterator())
    features = ({key: np.stack([r[0][key] for r in rows]) for key in rows[0][0]}
                if isinstance(rows[0][0], dict) else np.stack([r[0] for r in rows]))
    return features, np.stack([r[1] for r in rows])


def score(outputs, targets, metric):
    """The example's metric from what its model outputs for the test part (a class by argmax
    of several scores, or a score above 0.5: Keras's BinaryAccuracy and Recall thresholds; or
    the loss of one logit), and how many examples it counts (what one example moves it by)."""
    scores = next(outputs[k] for k in ("probabilities", "logits", "outputs") if k in outputs)
    if metric == "loss":  # the binary cross-entropy of one logit (the example's from_logits)
        z, y = scores[:, 0].astype("float64"), np.asarray(targets).reshape(len(scores))
        return float(np.mean(np.logaddexp(0, z) - y * z)), len(y)
    predicted = scores.argmax(-1) if scores.shape[-1] > 1 else scores[:, 0] > 0.5
    targets = np.asarray(targets).reshape(len(predicted))
    if metric == "recall":
        positives = int(np.sum(targets == 1))
        return float(np.sum(predicted & (targets == 1)) / positives), positives
    return float(np.mean(predicted == targets)), len(targets)


def served(name, model_dir, scratch):
    """The example's metric on its test part as the run's SavedModel serves it to a process
    without tfmulti (serve.py), how many examples it counts (None, 0 for an example that
    serves no figure), and whether that process imported tfmulti."""
    import subprocess

    features, targets = test_part(name)
    given = os.path.join(scratch, f"{name}_features.npz")
    np.savez(given, **(features if isinstance(features, dict) else {"features": features}))
    out = os.path.join(scratch, f"{name}_served.npz")
    done = subprocess.run([sys.executable, os.path.join(HERE, "serve.py"),
                           os.path.join(model_dir, "saved_model"), given, out], cwd=scratch,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    imported = json.loads(done.stdout.strip().splitlines()[-1])["tfmulti_imported"]
    if not getattr(example(name), "SERVES_ITS_FIGURE", True):
        return None, 0, imported  # what it serves carries no figure (endpoint.py)
    outputs = dict(np.load(out, allow_pickle=True))  # its class names are bytes objects
    return (*score(outputs, targets, example(name).METRIC), imported)


if __name__ == "__main__":
    _, what, name, seed = sys.argv
    assert what == "fit", what
    print(json.dumps(fitted(name, int(seed))[1]))
