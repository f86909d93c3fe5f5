"""What a finished run hands on, in its model_dir, for people who do not have tfmulti:

- model.keras: the trained model in plain Keras layers (tfmulti's fused-kernel batch norm is
  written as Keras's BatchNormalization: the same variables and inference), so
  `keras.saving.load_model` loads it in any Keras 3 process;
- saved_model/: a SavedModel for TensorFlow Serving (`tf.saved_model.load`), whose
  serving_default signature takes a batch of any size of images in the run's format
  (`images`: [None, height, width, channels], uint8 0-255 or float32 as the data set holds
  them) and returns `logits` (a model that ends in a softmax or sigmoid has none),
  `probabilities`, `class_ids` and `classes` (the names); a classifier of your own on your
  function's images takes them as `features`, as the data holds them, and returns the same;
- class_names.txt: one class name per line, in label order.

A model of another task (named inputs, token ids, a regression, several outputs) is served
with its own inputs (the data's names, dtypes and shapes, any batch size: `features` for one
unnamed array) and returns its outputs by name (`outputs` for one), as the model computes
them; class_names.txt only when its data has classes.
"""
from __future__ import annotations

import dataclasses
import os
import tempfile
from typing import TYPE_CHECKING

import keras
import tensorflow as tf

from tfmulti.data import pipeline
from tfmulti.distribution import storage
from tfmulti.errors import first_line
from tfmulti.models import usermodel, zoo
from tfmulti.rundir.names import CLASS_NAMES_FILE, MODEL_FILE, SAVED_MODEL_DIR, WEIGHTS_FILE

if TYPE_CHECKING:
    from collections.abc import Sequence

    import numpy as np

    from tfmulti.data.dataset import DataSet

SIGNATURE = "serving_default"


def plain_keras(model):
    """model with tfmulti's BatchNorm layers as keras.layers.BatchNormalization (itself when
    it has none): the same weights, loadable without tfmulti."""
    if not any(isinstance(layer, zoo.BatchNorm) for layer in model._flatten_layers()):
        return model

    def clone(layer):
        if isinstance(layer, zoo.BatchNorm):
            return keras.layers.BatchNormalization.from_config(layer.get_config())
        return layer.__class__.from_config(layer.get_config())

    plain = keras.models.clone_model(model, clone_function=clone)
    plain.set_weights(model.get_weights())
    return plain


@dataclasses.dataclass(frozen=True)
class AsGiven:
    """A classifier's features as the data holds them (your model on your function's data):
    served under a classifier's outputs, without tfmulti's preprocessing of images."""
    spec: tf.TensorSpec


def serving_function(model, class_names, image_shape, image_dtype, given=None):
    """The serving signature's function: images in the run's format (given: an AsGiven's
    features, as they are) to the model's outputs; its input signature; the variable it
    divides uint8 images by (to be saved with it)."""
    names = tf.constant(list(class_names))
    probabilities_out = bool(usermodel.ends_in_probabilities(model))
    scale = tf.Variable(pipeline.UINT8_SCALE, trainable=False, name="uint8_scale")

    def serve(images):  # the pipeline's own preprocessing: serving sees what training saw
        fed = images if given else pipeline.to_model_input(images, scale)
        outputs = tf.cast(model(fed, training=False), tf.float32)
        ids = tf.argmax(outputs, axis=-1, output_type=tf.int32)
        if probabilities_out:
            return {"probabilities": outputs, "class_ids": ids, "classes": tf.gather(names, ids)}
        return {"logits": outputs, "probabilities": tf.nn.softmax(outputs), "class_ids": ids,
                "classes": tf.gather(names, ids)}

    return serve, [given.spec if given else
                   tf.TensorSpec([None, *image_shape], image_dtype, name="images")], scale


def task_function(model, signature, output_names):
    """The serving function of a model that is not an image classifier: its features as the
    data holds them (images through the pipeline's preprocessing), its outputs by name; its
    input signature; the variable it divides uint8 images by (to be saved with it)."""
    scale = tf.Variable(pipeline.UINT8_SCALE, trainable=False, name="uint8_scale")
    images = isinstance(signature, tf.TensorSpec) and signature.name == "images"

    def serve(*given):
        features = given if isinstance(signature, tuple) else given[0]
        if images:
            features = pipeline.to_model_input(features, scale)
        outputs = model(features, training=False)
        if isinstance(outputs, dict):
            return {name: tf.cast(outputs[name], tf.float32) for name in output_names}
        values = outputs if isinstance(outputs, (list, tuple)) else [outputs]
        names = output_names if len(values) > 1 else ["outputs"]
        return {name: tf.cast(v, tf.float32) for name, v in zip(names, values)}

    return serve, list(signature) if isinstance(signature, tuple) else [signature], scale


def serving_inputs(dataset: DataSet, classifier: bool
                   ) -> tf.TensorSpec | dict[str, tf.TensorSpec] | AsGiven | None:
    """What the serving signature takes for a model on `dataset`: None for an image
    classifier (its own signature: images to logits, probabilities, class ids and names); a
    classifier of images taken as given (your model on your function's data): AsGiven (the
    same outputs); any other model's inputs as the data holds them (input_signature)."""
    if dataset.images and classifier:
        return None
    signature = input_signature(dataset.train_features, dataset.images)
    if classifier and dataset.images_as_given:
        return AsGiven(signature)
    return signature


def input_signature(features: np.ndarray | dict, images: bool = True
                    ) -> tf.TensorSpec | dict[str, tf.TensorSpec]:
    """The serving signature's input of a data set's features (their arrays): images as
    today's `images`; one other array as `features`; a dict by its names; a tuple (inputs in
    the model's order) as features_0, features_1, ..."""
    if isinstance(features, dict):
        return {name: tf.TensorSpec([None, *a.shape[1:]], a.dtype, name=name)
                for name, a in features.items()}
    if isinstance(features, (tuple, list)):
        return tuple(tf.TensorSpec([None, *a.shape[1:]], a.dtype, name=f"features_{i}")
                     for i, a in enumerate(features))
    return tf.TensorSpec([None, *features.shape[1:]], features.dtype,
                         name="images" if images else "features")


def weights_only(model: keras.Model, model_dir: str) -> str:
    """model.weights.h5 in model_dir for a model without call(); the line that says so."""
    with tempfile.TemporaryDirectory() as scratch:  # Keras writes local files: then copied
        local = os.path.join(scratch, WEIGHTS_FILE)
        model.built = True  # its layers are, by its train_step (Keras asks it of the model)
        model.save_weights(local)
        with open(local, "rb") as f:
            storage.write_bytes(storage.join(model_dir, WEIGHTS_FILE), f.read())
    return (f"no {MODEL_FILE} or {SAVED_MODEL_DIR}/: {type(model).__name__} has no call(), "
            f"so there are no outputs to save or serve; its weights are in {WEIGHTS_FILE} "
            "(model.load_weights() of the model your --model function returns reads them) "
            "and in the checkpoints")


def write(model: keras.Model, model_dir: str, class_names: Sequence[str],
          image_shape: Sequence[int] | None, image_dtype: str | None,
          features: tf.TensorSpec | dict | None = None,
          output_names: Sequence[str] = ()) -> str:
    """model.keras, saved_model/ and class_names.txt in model_dir (any file system TensorFlow
    knows, see storage.py). Returns what could not be written, in one line ('' when all
    was): a subclassed model whose get_config Keras cannot make has no model.keras (its
    weights are in the checkpoints and saved_model/). An image classifier gives image_shape
    and image_dtype; any other model gives features (input_signature()) and its
    output_names. A model without call() (a VAE, a GAN: it only trains) has no outputs to
    save or serve: its weights are written to model.weights.h5 instead."""
    if not usermodel.callable_model(model):
        return weights_only(model, model_dir)
    plain = plain_keras(model)
    skipped = ""
    try:
        plain.save(storage.join(model_dir, MODEL_FILE))
    except NotImplementedError as e:  # Keras: "... created by passing non-serializable ..."
        if storage.exists(storage.join(model_dir, MODEL_FILE)):
            storage.remove(storage.join(model_dir, MODEL_FILE))
        skipped = (f"no {MODEL_FILE}: Keras cannot save {type(model).__name__} "
                   f"({first_line(e, 120)}); give it a get_config() to have one. Its weights "
                   f"are in the checkpoints and {SAVED_MODEL_DIR}/")
    archive = keras.export.ExportArchive()
    archive.track(plain)
    if features is None or isinstance(features, AsGiven):
        fn, signature, scale = serving_function(plain, class_names, image_shape, image_dtype,
                                                features)
    else:
        fn, signature, scale = task_function(plain, features, list(output_names))
    archive.track(scale)
    archive.add_endpoint(SIGNATURE, tf.function(fn), input_signature=signature)
    target = storage.join(model_dir, SAVED_MODEL_DIR)
    if storage.exists(target):
        storage.remove(target)
    archive.write_out(target, verbose=False)
    if class_names:
        storage.write_bytes(storage.join(model_dir, CLASS_NAMES_FILE),
                            "".join(f"{name}\n" for name in class_names).encode())
    return skipped
