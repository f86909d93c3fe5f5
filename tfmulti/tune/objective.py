"""What a tuning session maximizes or minimizes (--objective): a figure its trials report on
their validation part, named as Keras names it, with its direction."""
import dataclasses

import keras_tuner as kt
from keras_tuner.src.engine import metrics_tracking

from tfmulti.errors import UsageError
from tfmulti.models import usermodel, zoo
from tfmulti.models.task import ACCURACY, Task, record_key

DIRECTIONS = ("min", "max")
# Suffixes of metric names whose direction is known beyond keras-tuner's list (which knows
# "accuracy" and "mae", not "kind_accuracy" or "val_auc_1")
RISING = ("accuracy", "acc", "auc", "precision", "recall", "iou", "f1_score", "fbeta_score")


@dataclasses.dataclass(frozen=True)
class SessionObjective:
    """What a session maximizes or minimizes: a figure of the validation part at the last
    epoch of each trial, named as Keras names it (val_loss, val_accuracy, val_mae)."""
    name: str
    direction: str  # "min" or "max"
    key: str  # its key in an epoch record (val_acc for val_accuracy)

    def kt(self):
        return kt.Objective(self.name, self.direction)

    @property
    def tag(self):
        """Its TensorBoard tag in a run's tensorboard/val/ (epoch_accuracy, epoch_loss)."""
        return "epoch_" + self.name[len("val_"):]

    def better(self, a, b):
        return a > b if self.direction == "max" else a < b

    @property
    def worst(self):
        """What a diverged trial scores: the worst there is (0 for a rising figure, which
        are all 0 or more)."""
        return 0.0 if self.direction == "max" else float("inf")


def session_objective(cfg, dataset, text=""):
    """The SessionObjective of --objective=NAME[:min|max] (default: val_accuracy for a
    classifier, else val_loss): a validation figure the model reports. UsageError, before
    the first trial, for a name it does not report, a test figure, or a direction that
    cannot be told. Your model is built once here, on the CPU, to see what it reports."""
    if usermodel.is_spec(cfg.model):
        model = zoo.build(cfg.model, cfg.width, dataset.input_shape, dataset.num_classes,
                          hp=kt.HyperParameters(), hparams=cfg.model_hparams)
        task = Task(model, dataset, cfg.model)
        names, classifier = task.metric_names, task.classifier
    else:
        names, classifier = [ACCURACY], True  # tfmulti's models are classifiers
    name, _, direction = (text or ("val_accuracy" if ACCURACY in names else "val_loss")
                          ).partition(":")
    offered = ["val_loss", *(f"val_{n}" for n in names)]
    metric = "accuracy" if name == "val_acc" and ACCURACY in names else name[len("val_"):]
    if name.startswith("test_") or name in ("loss", "accuracy", *names):
        raise UsageError(f"--objective={text}: a session chooses its trials on the validation "
                         f"part (--validation_split), never on the test set or the training "
                         f"figures; choose one of {', '.join(offered)}")
    if f"val_{metric}" not in offered:
        raise UsageError(f"--objective={text}: --model={cfg.model} reports "
                         f"{', '.join(offered)} on the validation part"
                         + ("" if classifier else " (it is not a classifier: no accuracy)"))
    if direction and direction not in DIRECTIONS:
        raise UsageError(f"--objective={text}: the direction after ':' is min or max")
    direction = direction or _direction(f"val_{metric}")
    if direction is None:
        raise UsageError(f"--objective={text}: say whether higher or lower is better: "
                         f"--objective={name}:max or {name}:min")
    return SessionObjective(f"val_{metric}", direction,
                            "val_loss" if metric == "loss" else record_key("val", metric))


def _direction(name):
    """"min" or "max" for a metric name keras-tuner knows or whose last words are one of
    RISING (max) or a loss or error (min); None otherwise."""
    words = name.split("_")
    for i in range(len(words)):
        tail = "_".join(words[i:])
        known = metrics_tracking.infer_metric_direction(tail)
        if known is not None:
            return known
        if tail in RISING:
            return "max"
        if tail in ("loss", "error") or tail.endswith(("_loss", "_error")):
            return "min"
    return None
