"""Your own Keras model: `--model=MODULE:FUNCTION`.

MODULE is imported the way Python imports it, from the command's working directory and
PYTHONPATH. FUNCTION(input_shape, num_classes) returns an uncompiled Keras model whose output
is one logit per class. tfmulti calls it inside the strategy's scope after seeding, so
--seed and --deterministic hold for it as for the built-in models. What would train wrongly
is refused in one line before the first step: not a Keras model, outputs of another shape, or
a softmax at the end (the loss takes logits).
"""
import inspect
import json

from tfmulti.errors import UsageError
from tfmulti.run.config import MODEL_SPEC
from tfmulti.training import usercode


def is_spec(name):
    """True for MODULE:FUNCTION (the built-in models have plain names)."""
    return bool(MODEL_SPEC.match(name))


def load_function(spec):
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
        hp.values.update(given)
    args = (tuple(input_shape), num_classes)
    kwargs = {"hp": YourHyperParameters(hp, spec)} if wants_hp else {}
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
    unknown = sorted(set(given) - {h.name for h in hp.space}) if wants_hp else []
    if unknown:
        asked = ", ".join(h.name for h in hp.space) or "none"
        raise UsageError(f"--model_hparams: {name} asks for no {unknown[0]!r} (it asks for: "
                         f"{asked})")
    if not isinstance(model, keras.Model):
        raise UsageError(f"--model={spec} returned {type(model).__name__}, not a Keras model")
    try:
        shape = tuple(model.output_shape)
    except (AttributeError, ValueError):  # a subclassed model: one example through it
        import numpy as np

        shape = (None, *model(np.zeros((1, *input_shape), "float32"), training=False).shape[1:])
    if tuple(shape[1:]) != (num_classes,):
        raise UsageError(f"--model={spec}: outputs shape {shape}; tfmulti needs one logit per "
                         f"class, (None, {num_classes}), for the data set's {num_classes} classes")
    if ends_in_softmax(model):
        raise UsageError(f"--model={spec} ends in a softmax; tfmulti's loss takes logits "
                         "(from_logits=True): remove the softmax from the last layer")
    if sync_batchnorm:  # your BatchNormalization layers take statistics over the global batch
        for layer in model._flatten_layers(include_self=False):
            if isinstance(layer, keras.layers.BatchNormalization):
                layer.synchronized = True
    return model


class YourHyperParameters:
    """keras-tuner's HyperParameters as your function sees them: a hyperparameter named like
    one of tfmulti's own settings (base_lr, momentum, ...) is refused, since in a tuning
    session both would be one value, silently."""
    DEFINING = ("Int", "Float", "Choice", "Boolean", "Fixed")

    def __init__(self, hp, spec):
        self._hp, self._spec = hp, spec

    def __getattr__(self, name):
        attribute = getattr(self._hp, name)
        if name not in self.DEFINING:
            return attribute

        def define(hp_name, *args, **kwargs):
            from tfmulti.run.config import FIELDS

            if hp_name in FIELDS:
                raise UsageError(f"--model={self._spec}: your hyperparameter {hp_name!r} has "
                                 f"the name of tfmulti's setting --{hp_name}; give it another "
                                 "name")
            return attribute(hp_name, *args, **kwargs)

        return define


def ends_in_softmax(model):
    """Whether the model's last layer turns logits into probabilities."""
    import keras

    last = model.layers[-1] if model.layers else None
    if isinstance(last, keras.layers.Softmax):
        return True
    activation = getattr(last, "activation", None)
    return activation is not None and getattr(activation, "__name__", "") == "softmax"
