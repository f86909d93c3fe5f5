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

import tensorflow as tf

from tfmulti.data.checks import materialized
from tfmulti.errors import DataError, UsageError
from tfmulti.run import usercode

FUNCTION_FORMS = ("((x_train, y_train), (x_test, y_test)) numpy arrays (and optionally the "
                  "class names), or (train_dataset, test_dataset) tf.data sets (and "
                  "optionally the class names or count)")


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
