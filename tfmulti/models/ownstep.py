"""A model's own steps: what `model.fit` runs for a model that overrides Keras's.

A `keras.Model` subclass whose `train_step`, `compute_loss` or `compute_metrics` is its own
trains with Keras's `train_step` (the model's, or Keras's calling the model's
`compute_loss`), as `fit` does: on every replica under the strategy, the loss scaled for the
replica count by Keras (`compute_loss`), the gradients summed by the optimizer, the logs the
step returns averaged over the replicas (fit's "mean" reduction). Its `test_step` (or, with
its own `compute_loss` or `compute_metrics`, Keras's) evaluates, on the real examples of each
batch only. tfmulti's fused step is for the models that override none of them.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tfmulti.errors import UsageError
from tfmulti.models.usermodel import (
    TRAINING,
    callable_model,
    compiled_without_loss,
    evaluates_own,
    overridden,
    trains_own,
)

if TYPE_CHECKING:
    import keras
    import tensorflow as tf


def check(model: keras.Model, spec: str, grad_accum_steps: int, allreduce_dtype: str) -> None:
    """UsageError in one line for what a model's own train_step cannot run with."""
    own = ", ".join(n for n in overridden(model) if n in TRAINING)
    if getattr(model, "optimizer", None) is None or not getattr(model, "compiled", False):
        raise UsageError(f"--model={spec} has its own {own}, which trains with the optimizer "
                         "it was compiled with: compile it (model.compile(optimizer=...)) "
                         "before returning it, as model.fit needs")
    if not evaluates_own(model) and getattr(model, "loss", None) is None:
        raise UsageError(f"--model={spec} has its own {own} but no compiled loss and no "
                         "test_step, so it cannot be evaluated (model.evaluate fails the same "
                         "way: 'No loss to compute'): compile it with a loss, or give it a "
                         "test_step")
    if grad_accum_steps > 1:
        raise UsageError(f"--grad_accum_steps={grad_accum_steps}: your model's own {own} "
                         "takes each replica's batch whole (as model.fit does); leave "
                         "--grad_accum_steps out")
    if allreduce_dtype != "float32":
        raise UsageError(f"--allreduce_dtype={allreduce_dtype}: your model's own {own} sums "
                         "its gradients in its optimizer, in their own dtype (as model.fit "
                         "does); leave --allreduce_dtype out")


def check_evaluated(model: keras.Model, spec: str, parts: list[str]) -> None:
    """UsageError in one line when a model without call() (and without a test_step of its
    own) would be evaluated on `parts` ("test", "validation"): Keras's test_step calls it."""
    if parts and not callable_model(model) and "test_step" not in overridden(model):
        raise UsageError(f"--model={spec} has no call(), so it has no outputs to evaluate on "
                         f"the {' and '.join(parts)} part (model.evaluate fails the same way): "
                         "return your data without a test part, ((x, None), None), as "
                         "model.fit(x) trains it, and leave --validation_split out")


def line(model: keras.Model, spec: str) -> str:
    """What the run says of the steps it runs ('' for tfmulti's own)."""
    own = overridden(model)
    if not own and compiled_without_loss(model):
        return (f"--model={spec} is compiled without a loss: its own losses (add_loss) train "
                "it, with Keras's train_step and test_step, as model.fit runs them (on every "
                "replica; the logs they return are the report's)")
    if not own:
        return ""
    kept = kept_optimizers(model)
    optimizers_text = (", ".join(f"{name} ({type(o).__name__}, rate "
                                 f"{float(o.learning_rate.numpy()):g})"
                                 for name, o in kept.items()) + ", as it made them,"
                       if kept else "its optimizer")
    sum_ = "sum" if kept else "sums"
    if not callable_model(model):
        return (f"--model={spec} has its own {', '.join(own)} and no call(): it trains with its "
                f"train_step, as model.fit(x) runs it (on every replica; {optimizers_text} "
                f"{sum_} the gradients; the logs it returns are the report's); without call() it "
                "has no outputs to evaluate or serve")
    does = " and ".join(kind for kind, yes in (("trains", trains_own(model)),
                                               ("evaluates", evaluates_own(model))) if yes)
    return (f"--model={spec} has its own {', '.join(own)}: it {does} with Keras's steps, "
            "as model.fit runs them (on every replica; its optimizer sums the gradients; the "
            "logs its steps return are the report's)")


def train_logs(model: keras.Model, data: tuple, names: dict[str, list[str]]) -> tf.Tensor:
    """One replica's step: the model's own train_step on `data`, its logs as a vector (their
    names kept in names["train"])."""
    names["train"], vector = log_vector(model.train_step(data))
    return vector


def test_logs(model: keras.Model, features: Any, targets: Any, weights: tf.Tensor,
              names: dict[str, list[str]], sample_weights: tf.Tensor | None = None
              ) -> tuple[tf.Tensor, tf.Tensor]:
    """One replica's evaluation: (the logs of the model's test_step (or Keras's, calling its
    own compute_loss) on the real examples of this batch, 1.0), or (zeros, 0.0) when it
    has none (padding). The logs' names are kept in names["test"]. sample_weights: yours,
    given to the step as fit gives them, (x, y, sample_weight)."""
    import tensorflow as tf

    real = weights > 0
    given = (features,) if targets is None else (features, targets)
    data = tf.nest.map_structure(lambda a: tf.boolean_mask(a, real), (
        given if sample_weights is None else (*given, sample_weights)))
    if targets is None:  # features alone, as fit gives a data set of them
        data = data[0]

    def run():
        names["test"], vector = log_vector(model.test_step(data))
        return vector, tf.constant(1.0)

    def padding():  # traced after run(): the names are known
        return tf.zeros([len(names["test"])]), tf.constant(0.0)

    return tf.cond(tf.reduce_any(real), run, padding)


def build_state(model: keras.Model, element_spec: Any) -> None:
    """Creates the variables Keras makes at a model's first step (the compiled loss's and
    metrics'), as fit does before its first step: a traced step cannot create them."""
    import tensorflow as tf

    if not callable_model(model):  # nothing to build by calling it: its layers are built
        for optimizer in optimizers(model):  # (fit on one device builds its optimizers at
            if not optimizer.built:  # their first step; a traced step cannot): each for all
                optimizer.build(model.trainable_variables)  # it may train
        return
    specs = tf.nest.map_structure(_per_replica_spec, element_spec)
    features, targets = (specs[0], specs[1]) if isinstance(specs, tuple) else (specs, None)
    model._symbolic_build(data_batch=(features, targets))  # fit's own build


def optimizers(model: keras.Model) -> list:
    """The model's optimizers: the compiled one and those its own compile keeps."""
    compiled = [model.optimizer] if getattr(model, "optimizer", None) is not None else []
    return [*compiled, *kept_optimizers(model).values()]


def kept_optimizers(model: keras.Model) -> dict:
    """{attribute: optimizer} of the optimizers the model's own compile keeps besides the
    compiled one (a GAN's d_optimizer and g_optimizer), in attribute order: they train as
    the model made them (tfmulti's rate flags are for the compiled one)."""
    import keras

    return {name: value for name, value in vars(model).items()
            if isinstance(value, keras.optimizers.Optimizer) and name != "optimizer"}


def _per_replica_spec(spec):
    # a distributed iterator's spec holds one spec per replica: the first stands for all
    return getattr(spec, "_value_specs", (spec,))[0]


def flat_logs(logs: Any) -> dict[str, tf.Tensor]:
    """The logs a step returned as {name: value}, the compiled metrics' dict flattened into
    their names (as fit's logs show them)."""
    if not isinstance(logs, dict):
        raise UsageError(f"your model's step returned {type(logs).__name__}; Keras's steps "
                         "return a dict of logs ({name: value})")
    flat = {}
    for name, value in logs.items():
        if isinstance(value, dict):
            flat.update(value)
        else:
            flat[name] = value
    return flat


def log_vector(logs: Any) -> tuple[list[str], tf.Tensor]:
    """(names, a float32 vector of their values: a value of several numbers as their mean)."""
    import tensorflow as tf

    flat = flat_logs(logs)
    values = [tf.reduce_mean(tf.cast(v, tf.float32)) for v in flat.values()]
    return list(flat), tf.stack(values) if values else tf.zeros([0], tf.float32)
