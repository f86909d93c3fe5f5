"""Your own Keras model: `--model=MODULE:FUNCTION`.

MODULE is imported the way Python imports it, from the command's working directory and
PYTHONPATH. FUNCTION(input_shape, num_classes) returns an uncompiled Keras model whose output
is one logit per class. tfmulti calls it inside the strategy's scope after seeding, so
--seed and --deterministic hold for it as for the built-in models. What would train wrongly
is refused in one line before the first step: not a Keras model, outputs of another shape, or
a softmax at the end (the loss takes logits).
"""
from __future__ import annotations

import contextlib
import inspect
import json
from typing import TYPE_CHECKING, Any

from tfmulti.errors import UsageError, UserError, first_line
from tfmulti.run import usercode
from tfmulti.run.config import MODEL_SPEC

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Mapping

    import keras


def is_compiled(model: keras.Model) -> bool:
    """Whether the model was compiled with a loss of its own (model.compile(loss=...))."""
    return bool(getattr(model, "compiled", False)) and getattr(model, "loss", None) is not None


# Keras's methods that change what a training step does
TRAINING = ("train_step", "compute_loss", "compute_metrics")
# ... and what an evaluation step does
EVALUATION = ("test_step", "compute_loss", "compute_metrics")


def overridden(model: keras.Model) -> tuple[str, ...]:
    """The step methods of TRAINING and EVALUATION that the model's class defines itself."""
    import keras

    return tuple(name for name in dict.fromkeys(TRAINING + EVALUATION)
                 if getattr(type(model), name, None) is not getattr(keras.Model, name))


def callable_model(model: keras.Model) -> bool:
    """Whether the model computes outputs: a Keras Model subclass without call() (keras-io's
    VAE and GANs) only trains, with its own train_step, as model.fit(x) trains it."""
    import keras

    return getattr(type(model), "call", None) is not keras.Model.call


def compiled_without_loss(model: keras.Model) -> bool:
    """Compiled with an optimizer and no loss: its losses are its own (an endpoint layer's
    add_loss), and Keras's steps train and evaluate it, as fit does."""
    return bool(getattr(model, "compiled", False)) and getattr(model, "loss", None) is None


def trains_own(model: keras.Model) -> bool:
    """Whether Keras's steps train the model, as fit runs them (ownstep.py): it overrides
    one of TRAINING, or it is compiled without a loss."""
    return any(name in TRAINING for name in overridden(model)) or compiled_without_loss(model)


def evaluates_own(model: keras.Model) -> bool:
    return any(name in EVALUATION for name in overridden(model)) or compiled_without_loss(model)


@contextlib.contextmanager
def failure_said(step: str) -> Iterator[None]:
    """The model's own error while its `step` step ("training", "evaluation") is traced (a
    layer that works eagerly, as the checks before a run call it, and fails in a
    tf.function) as one line with its cause, a UserError; any other error as it is, with its
    traceback."""
    try:
        yield
    except (ValueError, TypeError) as e:
        if "Exception encountered when calling" not in str(e):
            raise  # not the model's own call: tfmulti's, with its traceback
        raise UserError(f"the model failed in the {step} step, traced as a graph "
                        f"(tf.function): {first_line(e)}") from None


def is_spec(name: str) -> bool:
    """True for MODULE:FUNCTION (the built-in models have plain names)."""
    return bool(MODEL_SPEC.match(name))


def load_function(spec: str) -> Callable[..., Any]:
    """The function `spec` names, imported (UsageError in one line when it is not there)."""
    return usercode.load_function(spec, "--model")


def build(spec, input_shape, num_classes, dtype="float32", sync_batchnorm=False, hp=None,
          hparams=""):
    """The user's model for images of input_shape (height, width, channels) and num_classes
    classes, checked. dtype (--dtype) is Keras's global dtype policy while the function
    builds the model, so its layers compute in it (the engine takes the logits in float32,
    as the mixed-precision guide's float32 output layer does).

    A function with an `hp` parameter gets keras-tuner HyperParameters: `hp` (a tuning
    session's, where its hyperparameters join the search space), with the values of
    `hparams` (--model_hparams, JSON) in place."""
    import keras

    function = load_function(spec)
    signature, name = inspect.signature(function), spec.split(":")[1]
    wants_hp = "hp" in signature.parameters
    given = json.loads(hparams) if hparams else {}
    if given and not wants_hp:
        raise UsageError(f"--model_hparams: {name}{signature} takes no hp, so it has no "
                         "hyperparameters to set")
    if wants_hp and hp is None:
        import keras_tuner as kt

        hp = kt.HyperParameters()
    if wants_hp:
        hp.values.update({scoped(k): v for k, v in given.items()})
    args = (input_shape if isinstance(input_shape, dict) else tuple(input_shape), num_classes)
    kwargs = {"hp": YourHyperParameters(hp, spec, given)} if wants_hp else {}
    try:
        signature.bind(*args, **kwargs)
    except TypeError:
        raise UsageError(f"--model={spec}: tfmulti calls {name}(input_shape, num_classes"
                         f"{', hp' if wants_hp else ''}); yours takes {signature}") from None
    policy = keras.config.dtype_policy()
    keras.config.set_dtype_policy(dtype)
    try:
        model = usercode.call(spec, "--model", function, *args, **kwargs)
    finally:
        keras.config.set_dtype_policy(policy)
    declared = [h.name[len(SCOPE) + 1:] for h in hp.space
                if h.name.startswith(SCOPE + "/")] if wants_hp else []
    unknown = sorted(set(given) - set(declared))
    if unknown:
        asked = ", ".join(declared) or "none"
        raise UsageError(f"--model_hparams: {name} asks for no {unknown[0]!r} (it asks for: "
                         f"{asked})")
    if not isinstance(model, keras.Model):
        raise UsageError(f"--model={spec} returned {type(model).__name__}, not a Keras model")
    shape = output_shape(model, input_shape) if num_classes else ()
    binary = num_classes == 2 and tuple(shape[1:]) == (1,) and is_compiled(model)  # one
    # score of the second class (a sigmoid and binary_crossentropy), as Keras's examples have
    if num_classes and len(model.outputs if _functional(model) else [0]) == 1 and tuple(
            shape[1:]) != (num_classes,) and not binary:
        each = "score" if is_compiled(model) else "logit"
        raise UsageError(f"--model={spec}: outputs shape {shape}; tfmulti needs one {each} per "
                         f"class, (None, {num_classes}), for the data set's {num_classes} classes")

    ending = ends_in_probabilities(model)
    if ending and not is_compiled(model) and not trains_own(model):
        raise UsageError(f"--model={spec} ends in a {ending}; tfmulti's loss takes logits "
                         f"(from_logits=True): remove the {ending} from the last layer, or "
                         "compile the model with the loss that fits it")
    _check_trained_under_the_strategy(model, spec)
    if sync_batchnorm:  # your BatchNormalization layers take statistics over the global batch
        for layer in model._flatten_layers(include_self=False):
            if isinstance(layer, keras.layers.BatchNormalization):
                layer.synchronized = True
    return model


def _check_trained_under_the_strategy(model, spec):
    """A trainable variable made outside the strategy's scope (a layer built when your module
    was imported) has one copy, which several replicas cannot train: one line, before any
    step. A variable only read (a Normalization layer adapted at import, as Keras's examples
    do) works: every replica reads the one copy."""
    import tensorflow as tf

    if not tf.distribute.has_strategy():
        return
    strategy = tf.distribute.get_strategy()
    outside = [v.path for v in model.trainable_weights
               if not strategy.extended.variable_created_in_scope(v.value)]
    if outside and strategy.num_replicas_in_sync > 1:
        name = spec.split(":")[1]
        raise UsageError(
            f"--model={spec}: trainable variable {outside[0]} ({len(outside)} of "
            f"{len(model.trainable_weights)}) was made outside the strategy's scope (when your "
            f"module was imported?), so its one copy cannot be trained on "
            f"{strategy.num_replicas_in_sync} replicas: make the layers you train inside "
            f"{name}() (a layer only adapted at import, such as Normalization, can stay there)")


# Your hyperparameters live in keras-tuner's HyperParameters under this name scope
# ("model/units"), apart from tfmulti's own search names (base_lr, momentum, width, ...), so
# any name is yours; --model_hparams and best.cfg carry your names as you wrote them.
SCOPE = "model"


def scoped(name: str) -> str:
    return f"{SCOPE}/{name}"


def yours(values: Mapping[str, Any]) -> dict[str, Any]:
    """{your name: value} of a HyperParameters' values (keras-tuner's, scoped names)."""
    return {k[len(SCOPE) + 1:]: v for k, v in values.items() if k.startswith(SCOPE + "/")}


class YourHyperParameters:
    """keras-tuner's HyperParameters as your function sees them: every call (Int, Float,
    Choice, Boolean, Fixed, get, conditional_scope, ...) runs in the SCOPE name scope, and a
    value --model_hparams gives is checked against its declaration before your function
    uses it."""
    DEFINING = ("Int", "Float", "Choice", "Boolean", "Fixed")

    def __init__(self, hp, spec, given=None):
        self._hp, self._spec, self._given = hp, spec, given or {}

    @property
    def values(self):
        return yours(self._hp.values)

    def __getattr__(self, name):
        attribute = getattr(self._hp, name)
        if not callable(attribute):
            return attribute

        def in_scope(*args, **kwargs):
            with self._hp.name_scope(SCOPE):
                result = attribute(*args, **kwargs)
            hp_name = args[0] if args else kwargs.get("name")
            if name in self.DEFINING and hp_name in self._given:
                wrong = out_of_range(self._hp, {scoped(hp_name): self._given[hp_name]})
                if wrong:
                    raise UsageError(f"--model_hparams: {wrong}")
            return result

        if name == "conditional_scope":  # a context manager: the scope must stay open
            @contextlib.contextmanager
            def conditional(parent_name, parent_values):
                with self._hp.name_scope(SCOPE):
                    parent = self._hp._get_name(parent_name)
                with self._hp.conditional_scope(parent, parent_values):
                    yield

            return conditional
        return in_scope


def output_shape(model: keras.Model,
                 input_shape: tuple[int, int, int]) -> tuple[int | None, ...]:
    """The model's output shape, (None, ...); a subclassed model, which has none until it
    is called, is called on one example of input_shape."""
    try:
        return tuple(model.output_shape)
    except (AttributeError, ValueError):
        import numpy as np

        return (None, *model(np.zeros((1, *input_shape), "float32"), training=False).shape[1:])


def _functional(model):
    return getattr(model, "_inputs_struct", None) is not None and hasattr(model, "outputs")


PROBABILITIES = ("softmax", "sigmoid")


def ends_in_probabilities(model: keras.Model) -> str:
    """"softmax" or "sigmoid" when the model's last layer turns logits into probabilities,
    else ""."""
    import keras

    last = model.layers[-1] if model.layers else None
    if isinstance(last, keras.layers.Softmax):
        return "softmax"
    name = getattr(getattr(last, "activation", None), "__name__", "")
    return name if name in PROBABILITIES else ""


def out_of_range(hp, given):
    """'units=1000 is outside ...' for the first value of `given` (--model_hparams) that the
    hyperparameter of its name does not allow, else ''."""
    import keras_tuner as kt

    for h in hp.space:
        if h.name not in given:
            continue
        name = h.name.split("/", 1)[1] if h.name.startswith(SCOPE + "/") else h.name
        value, where = given[h.name], f"{name}={given[h.name]!r}"
        if isinstance(h, kt.engine.hyperparameters.Boolean):
            if not isinstance(value, bool):
                return f"{where}: your function declares {name} a Boolean (true or false)"
        elif isinstance(h, kt.engine.hyperparameters.Choice):
            if value not in h.values:
                return (f"{where} is not among the values your function declares for it "
                        f"({', '.join(map(repr, h.values))})")
        elif isinstance(h, kt.engine.hyperparameters.Fixed):
            if value != h.value:
                return f"{where}: your function fixes {name} at {h.value!r}"
        elif isinstance(h, (kt.engine.hyperparameters.Int, kt.engine.hyperparameters.Float)):
            integer = isinstance(h, kt.engine.hyperparameters.Int)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or (
                    integer and value != int(value)):
                return (f"{where}: your function declares {name} "
                        f"{'an integer' if integer else 'a number'}")
            if not h.min_value <= value <= h.max_value:
                return (f"{where} is outside the range your function declares for it "
                        f"({h.min_value:g} to {h.max_value:g})")
    return ""
