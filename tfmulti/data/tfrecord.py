"""--dataset=tfrecord:TRAIN_FILES,EVAL_FILES --parse=MODULE:FUNCTION: your TFRecord shards,
each record given to FUNCTION(serialized string tensor) -> (features, target), one tensor each
(images uint8 [h, w(, c)], or numbers; a class id, or numbers), read by index (records.py)."""
from __future__ import annotations

import numpy as np
import tensorflow as tf

from tfmulti.data import checks, records
from tfmulti.data.dataset import DataSet, Request
from tfmulti.errors import DataError, UserError, first_line
from tfmulti.run import usercode

FORM = ("FUNCTION(serialized) -> (features, target): one tensor each (a dict of named "
        "inputs is not read from records yet)")


def load(spec: str, request: Request) -> DataSet:
    """--dataset=tfrecord:TRAIN,EVAL --parse=...: read by index from the files, checked as
    they were indexed; as_given: the features as your parse function returns them."""
    as_given = request.as_given
    source, train, test, classes, images = from_tfrecord(spec, request.parse,
                                                         request.image_size, as_given)
    notes = (checks.class_coverage(spec, train[1], test[1], classes, "labels")
             if classes else ())
    return DataSet(spec, source, *train, *test, class_names=classes, notes=notes,
                   images=images and not as_given, images_as_given=images and as_given,
                   reading=records.reading_line(spec, train[0]))


def from_tfrecord(spec: str, parse_spec: str, image_size: tuple[int, int] | None,
                  as_given: bool = False):
    """(source, train, test, class names or (), images) of the two patterns of `spec`;
    as_given: the features as the parse function returns them (images: they look like
    images, but are not made model input)."""
    parse = usercode.load_function(parse_spec, "--parse")
    patterns = [p.strip() for p in spec[len("tfrecord:"):].split(",")]
    paths = [_files(spec, split, pattern) for split, pattern in zip(("train", "eval"), patterns)]
    feature, target = _parsed_form(parse_spec, parse)
    what = f"--dataset={spec} --parse={parse_spec}"
    # the targets are those of your function's file as it is now (a change: read again)
    targets_by = (f"--parse={parse_spec} {usercode.provenance(parse_spec)['sha256']} "
                  f"{target.dtype.name}")
    indexed = []
    for files in paths:
        indexed.append(records.index_files(what, "tfrecord", [(p, 0, None) for p in files],
                                           lambda s: _target(parse(s)[1], target), targets_by))
    images = feature.shape.rank in (2, 3) and (
        feature.dtype == tf.uint8 or (target.shape.rank == 0 and target.dtype.is_integer))
    size = tuple(image_size or ())
    preprocessed = images and not as_given
    if preprocessed and not size:  # the first image's size, for every image
        size = tuple(parse(tf.constant(indexed[0][0].read(np.array([0]))[0]))[0].shape[:2])
    element = _element(what, feature, size if preprocessed else None)

    decode = FeaturesOf(parse_spec, element, preprocessed, parse)
    (train_files, train_targets), (test_files, test_targets) = indexed
    classes = ()
    if target.shape.rank == 0 and target.dtype.is_integer:
        classes = checks.classes_of_labels(spec, train_targets, test_targets)
    count = sum(len(p) for p in paths)
    return (f"{count} TFRecord file{'s' if count > 1 else ''} ({patterns[0]}, {patterns[1]}), "
            "read by index",
            (records.Records(spec, train_files, decode, element), train_targets),
            (records.Records(spec, test_files, decode, element), test_targets), classes,
            bool(images))


class FeaturesOf:
    """serialized record -> its features as `element` (tf.TensorSpec) gives them, by your
    parse function (images given a channel axis and resized); pickled as the function's
    name (a tuning trial's process imports it again)."""

    def __init__(self, parse_spec, element, images, parse):
        self.parse_spec, self.element, self.images, self._parse = (parse_spec, element, images,
                                                                    parse)

    def __getstate__(self):
        return {**self.__dict__, "_parse": None}

    def __setstate__(self, state):  # imported here, not while a tf.function traces
        self.__dict__.update(state, _parse=usercode.load_function(state["parse_spec"],
                                                                  "--parse"))

    def __call__(self, serialized):
        features = tf.cast(self._parse(serialized)[0], self.element.dtype)
        if self.images:
            if features.shape.rank == 2:
                features = features[..., None]
            if tuple(features.shape[:2]) != tuple(self.element.shape[:2]):
                features = checks.resize_one(features, self.element.shape[:2],
                                             self.element.dtype)
        return tf.ensure_shape(features, self.element.shape)


def _files(spec, split, pattern):
    if "://" in pattern:
        raise DataError(f"--dataset={spec}: {pattern} is not on this machine's file system; "
                        "tfmulti reads records by index from files it can open (mount the "
                        "bucket, or copy the shards)")
    found = sorted(tf.io.gfile.glob(pattern))
    if not found:
        raise DataError(f"--dataset={spec}: no file matches the {split} pattern {pattern}")
    return found


def _parsed_form(parse_spec, parse):
    """(features spec, target spec) of what parse returns for one serialized record."""
    try:
        out = tf.function(parse).get_concrete_function(
            tf.TensorSpec([], tf.string)).structured_outputs
    except Exception as e:  # noqa: BLE001 - the user's function: what it raised, in one line
        reason = first_line(e)
        raised = next((name for name in (f"{type(e).__name__}: ", "ValueError: ", "TypeError: ")
                       if reason.startswith(name)), "")  # a traced function's own error
        kind = raised[:-2] or type(e).__name__
        raise UserError(f"--parse={parse_spec} raised {kind} on a serialized record: "
                        f"{reason[len(raised):]}") from None
    if not (isinstance(out, (tuple, list)) and len(out) == 2
            and all(isinstance(part, tf.Tensor) for part in out)):
        raise UserError(f"--parse={parse_spec} returned {_form_text(out)}; give {FORM}")
    return tuple(tf.TensorSpec(part.shape, part.dtype) for part in out)


def _form_text(out):
    return str(tf.nest.map_structure(lambda t: f"{t.dtype.name} {t.shape}", out)
               if isinstance(out, (tuple, list, dict)) else type(out).__name__)


def _element(what, feature, size):
    dtype = feature.dtype if feature.dtype == tf.uint8 else (
        tf.float32 if feature.dtype.is_floating else tf.int32 if feature.dtype.is_integer
        else None)
    if dtype is None:
        raise DataError(f"{what}: the features are {feature.dtype.name}; give numbers (text "
                        "as token ids)")
    if size is not None:
        channels = feature.shape[-1] if feature.shape.rank == 3 else 1
        if channels is None:
            raise DataError(f"{what}: images of {feature.shape}: give their channel count "
                            "(tf.ensure_shape in your parse function)")
        return tf.TensorSpec([*size, channels], dtype)
    if not feature.shape.is_fully_defined():
        raise DataError(f"{what}: features of shape {feature.shape}; give every example the "
                        "same shape (pad token ids; tf.ensure_shape)")
    return tf.TensorSpec(feature.shape, dtype)


def _target(tensor, form):
    return tf.cast(tensor, tf.int32 if form.dtype.is_integer else tf.float32)

