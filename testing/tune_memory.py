"""The tuner's memory over trials (make soak's "memory" check): prints its RSS in MB after each
of 4 trials, as JSON. In one process trials grew the tuner by about 35 MB each (measured);
with a process per trial it stays flat."""
import json
import os
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def rss_mb():
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS")).split()[1]) // 1024


def probe(marks, directory, max_trials=4):
    """A random search whose tuner appends its RSS to `marks` after each trial, on the
    hypermodel a session makes (its objective, a validation part held out)."""
    from tfmulti.data import sources
    from tfmulti.distribution.devices import DevicePlan
    from tfmulti.run.config import RunConfig
    from tfmulti.tune import search
    from tfmulti.tune.objective import SessionObjective

    dataset = sources.load("synthetic", synthetic_train_size=512, synthetic_test_size=64)

    class Probe(search.RandomSearch):
        def on_trial_end(self, trial):
            super().on_trial_end(trial)
            marks.append(rss_mb())

    objective = SessionObjective("val_accuracy", "max", "val_acc")  # as a session chooses
    hypermodel = search.TrainingHyperModel(
        DevicePlan("cpu", 1), dataset,
        RunConfig(model="resnet18", width=8, epochs=1, validation_split=0.1),
        {"per_replica_batch_size": [16, 32]}, (0.01, 1.0), objective)
    return Probe(hypermodel, objective=objective.kt(), max_trials=max_trials,
                 directory=directory, project_name="p")


def main():
    marks = []
    probe(marks, tempfile.mkdtemp(prefix="tfmulti-soak-memory-")).search(verbose=0)
    print(json.dumps(marks))


if __name__ == "__main__":
    main()
