"""--dataset=MODULE:FUNCTION: FUNCTION() returns ((x_train, y_train), (x_test, y_test)) numpy
arrays, as keras.datasets loaders do (each part may add its sample weights, (x, y, weights),
as fit takes them), optionally with the class names (or count) as a third element; the test
part None for none (a model that trains itself, as fit(x) takes it with no validation); or
(train, test) or (train, test, classes): finite, unbatched tf.data.Datasets of (features,
target), as fit takes them (the classes counted from integer targets, as for arrays).
Features are images, or any numbers (rows, token ids) or a dict of them by input name;
targets are class ids, or any numbers (floats, multi-hot rows, masks) or one per output (a
dict by output name, or a tuple in the model's output order); classes is None for targets
that are not class ids."""
import inspect

import numpy as np
import tensorflow as tf

from tfmulti.data import checks
from tfmulti.data.checks import materialized
from tfmulti.data.dataset import DataSet, Request, structure_text
from tfmulti.errors import DataError, UsageError
from tfmulti.run import usercode

FUNCTION_FORMS = ("((x_train, y_train), (x_test, y_test)) numpy arrays (and optionally the "
                  "class names), or (train_dataset, test_dataset) tf.data sets (and "
                  "optionally the class names or count)")


def load(spec: str, request: Request) -> DataSet:
    """--dataset=MODULE:FUNCTION: what your function returns, checked as fit would take it
    (sample weights apart); images resized to request.image_size unless request.as_given."""
    image_size, as_given = request.image_size, request.as_given
    source, train, test, given = from_function(spec, request.data_dir, image_size, as_given)
    train, weights = checks.weights_apart(spec, "train", train)
    test, test_weights = (None, None) if test is None else checks.weights_apart(spec, "test",
                                                                               test)
    train, test, classes, images = checks.checked(spec, train, test, given, image_size, as_given)
    notes = (checks.class_coverage(spec, train[1], test[1], classes,
                                   "labels" if given is None else "given")
             if test is not None and checks.is_class_ids(train[1]) else ())
    if test is None:  # no test part: an empty one of the train part's form (nothing to test)
        test = (checks.none_of(train[0]), None)
    image_like = as_given and checks.looks_like_images(*train)
    return DataSet(spec, source, *train, *test, class_names=classes, notes=notes, images=images,
                   images_as_given=image_like,
                   reading=as_given_note(spec, train[0]) if image_like else "",
                   train_weights=weights, test_weights=test_weights)


def as_given_note(spec: str, features: np.ndarray) -> str:
    """The line a run says first of images your model takes as your function returns them."""
    scale = (" (0-255: scale them in your model, keras.layers.Rescaling(1 / 255), if it "
             "expects [0, 1])" if features.dtype == np.uint8 else "")
    return (f"--dataset={spec}: your model takes its features as your function returns them, "
            f"as model.fit gives them: {structure_text(features)}{scale}")


def from_function(spec, data_dir, image_size, as_given=False):
    function = usercode.load_function(spec, "--dataset")
    try:
        inspect.signature(function).bind()
    except TypeError:
        raise UsageError(f"--dataset={spec}: tfmulti calls {spec.split(':')[1]}() without "
                         f"arguments; yours takes {inspect.signature(function)}") from None
    except ValueError:  # no signature to read (a builtin): just call it
        pass
    result = usercode.call(spec, "--dataset", function)
    if isinstance(result, (tuple, list)) and len(result) in (2, 3):
        first, second = result[0], result[1]
        classes = result[2] if len(result) == 3 else None
        if isinstance(first, tf.data.Dataset) and isinstance(second, tf.data.Dataset):
            train = materialized(spec, "train", first, image_size, as_given)
            if as_given:
                return (f"{spec}() (tf.data)", train,
                        materialized(spec, "test", second, None, as_given), classes)
            if not image_size and getattr(train[0], "ndim", 0) in (3, 4):
                image_size = train[0].shape[1:3]  # test images of another size: resized
            return (f"{spec}() (tf.data)", train, materialized(spec, "test", second, image_size),
                    classes)
        if all(isinstance(p, (tuple, list)) and len(p) in (2, 3) for p in (first, second)
               ) or (second is None and isinstance(first, (tuple, list)) and len(first) == 2):
            return f"{spec}() (arrays)", first, second, classes
    raise DataError(f"--dataset={spec} returned {_describe(result)}; tfmulti takes "
                    f"{FUNCTION_FORMS}")


def _describe(value):
    if isinstance(value, (tuple, list)):
        return (f"a {type(value).__name__} of {len(value)} "
                f"({', '.join(type(v).__name__ for v in value[:4])})")
    return f"a {type(value).__name__}"
