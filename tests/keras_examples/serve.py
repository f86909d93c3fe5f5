"""A process that never imports tfmulti, as the person a run's SavedModel is handed to:
`python serve.py SAVED_MODEL FEATURES.npz OUT.npz` calls the serving_default signature on the
features (by the signature's input names; one array for a signature of one input; integers
and floats cast to the signature's, as a caller of an int32 or float32 signature does) and
writes its outputs to OUT.npz; prints whether tfmulti got imported."""
import json
import sys

import numpy as np
import tensorflow as tf


def call(saved_model, given):
    """The serving_default signature's outputs (numpy, by name) for `given` (a dict of numpy
    arrays by input name; one array under any name for a signature of one input)."""
    serve = tf.saved_model.load(saved_model).signatures["serving_default"]
    wanted = serve.structured_input_signature[1]
    if len(wanted) == 1 and len(given) == 1:
        given = {next(iter(wanted)): next(iter(given.values()))}
    inputs = {name: tf.constant(_as(given[name], spec.dtype)) for name, spec in wanted.items()}
    return {name: value.numpy() for name, value in serve(**inputs).items()}


def _as(array, dtype):
    """Integers as the signature's integers, floats as its floats (int64 and float64 columns
    are served as int32 and float32, as the run read them)."""
    same_kind = ((array.dtype.kind in "iu" and dtype.is_integer) or
                 (array.dtype.kind == "f" and dtype.is_floating))
    return array.astype(dtype.as_numpy_dtype) if same_kind else array


def main():
    saved_model, features_file, out = sys.argv[1:]
    np.savez(out, **call(saved_model, dict(np.load(features_file))))
    print(json.dumps({"tfmulti_imported": any(m.startswith("tfmulti") for m in sys.modules)}))


if __name__ == "__main__":
    main()
