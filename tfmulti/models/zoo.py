"""The book's models as factory functions with a width argument (tests build tiny ones).

Call them inside `strategy.scope()` so the variables are mirrored on every replica.
"""
from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf
from keras import layers

from tfmulti.errors import UsageError
from tfmulti.models import usermodel
from tfmulti.run.config import BOOK_WIDTH, MODELS  # noqa: F401 (the names models are built by)

# The book initialises every weight from Normal(0, 0.01) (MXNet init.Normal(sigma=0.01)). On a
# small data set a LeNet started so stayed at chance for 100 steps where Keras's own start
# (Glorot uniform) learned at once: init="keras" is the default, init="book" the book's.
_INIT_STDDEV = 0.01
# MXNet's and PyTorch's batch-norm momentum (Keras' 0.99 leaves the moving statistics near
# their start for the first few hundred steps, and a short run evaluates as chance).
_BN_MOMENTUM = 0.9


@keras.saving.register_keras_serializable("tfmulti")
class BatchNorm(layers.BatchNormalization):
    """Keras batch norm, trained with TensorFlow's fused kernel (FusedBatchNormV3).

    Keras 3 computes batch norm from separate moments, normalise, scale and shift ops; the
    fused kernel (tf.keras's) does it in one pass each way, which makes the whole training
    step faster, the more so in bfloat16 (benchmarks/throughput.py measures the step). Same
    variables and inference path as Keras; the moving variance is updated with the unbiased
    batch variance, as tf.keras does. The synchronized (cross-replica) variant stays Keras's
    own.
    """

    def call(self, inputs, training=None, mask=None):
        fusable = (training and not self.synchronized and self.center and self.scale
                   and len(inputs.shape) == 4 and self.axis in (-1, 3))
        if not fusable:
            return super().call(inputs, training=training, mask=mask)
        outputs, mean, variance = tf.compat.v1.nn.fused_batch_norm(
            inputs, self.gamma.value, self.beta.value, mean=self.moving_mean.value,
            variance=self.moving_variance.value, epsilon=self.epsilon, is_training=True,
            data_format="NHWC", exponential_avg_factor=1 - self.momentum)
        self.moving_mean.assign(mean)  # already the new moving averages
        self.moving_variance.assign(variance)
        return outputs


def initializer(init, seed=None):
    """The kernels' initialiser: "keras" (Glorot uniform, Keras's default) or "book"."""
    if init == "book":
        return keras.initializers.RandomNormal(stddev=_INIT_STDDEV, seed=seed)
    if init == "keras":
        return keras.initializers.GlorotUniform(seed=seed)
    raise ValueError(f"unknown init {init!r}")


class _Layers:
    """Makes layers with the chosen initialiser, one distinct seed each, and the dtype policy."""

    def __init__(self, dtype, seed, init):
        self.dtype, self.seed, self.init, self.count = dtype, seed, init, 0

    def _next_init(self):
        self.count += 1
        return initializer(self.init, None if self.seed is None else self.seed + self.count)

    def conv(self, channels, kernel, strides=1, padding="same"):
        return layers.Conv2D(channels, kernel, strides, padding=padding,
                             kernel_initializer=self._next_init(), dtype=self.dtype)

    def dense(self, units, final=False):
        # Logits in float32 under mixed precision, so the loss and softmax stay exact.
        return layers.Dense(units, kernel_initializer=self._next_init(),
                            dtype="float32" if final else self.dtype)


def _residual(make, bn, x, channels, strides=1, use_1x1conv=False):
    """d2l.Residual: conv-BN-ReLU-conv-BN, plus the input (1x1 conv when the shape changes)."""
    y = layers.ReLU(dtype=make.dtype)(bn()(make.conv(channels, 3, strides)(x)))
    y = bn()(make.conv(channels, 3)(y))
    if use_1x1conv:
        x = make.conv(channels, 1, strides)(x)
    return layers.ReLU(dtype=make.dtype)(layers.Add(dtype=make.dtype)([y, x]))


def resnet18(num_classes=10, width=64, input_shape=(28, 28, 1), dtype="float32",
             sync_batchnorm=False, seed=None, init="keras"):
    """The book's ResNet-18 variant: 3x3 stem conv, stride 1, no max-pool.

    Stages of width, 2*width, 4*width and 8*width channels (64-128-256-512 in the book), two
    residual blocks each, global average pooling, dense. `sync_batchnorm` computes batch
    statistics over the global batch across replicas instead of each replica's own slice.
    """
    make = _Layers(dtype, seed, init)

    def bn():
        return BatchNorm(momentum=_BN_MOMENTUM, synchronized=sync_batchnorm, dtype=dtype)

    inputs = keras.Input(input_shape)
    x = layers.ReLU(dtype=dtype)(bn()(make.conv(width, 3)(inputs)))
    for stage in range(4):
        for block in range(2):
            first = block == 0 and stage > 0
            x = _residual(make, bn, x, width * 2 ** stage, strides=2 if first else 1,
                          use_1x1conv=first)
    x = layers.GlobalAveragePooling2D(dtype=dtype)(x)
    return keras.Model(inputs, make.dense(num_classes, final=True)(x), name="resnet18")


def lenet(num_classes: int = 10, width: int = 20,
          input_shape: tuple[int, int, int] = (28, 28, 1), dtype: str = "float32",
          seed: int | None = None, sync_batchnorm: bool = False,
          init: str = "keras") -> keras.Model:
    """The book's LeNet: conv 20 3x3, avg-pool 2, conv 50 5x5, avg-pool 2, dense 128, dense 10.

    `width` is the first conv's channels; the others keep the book's proportions (50/20,
    128/20). No padding, as in the book, so 28x28 inputs give 50x4x4 = 800 features.
    `sync_batchnorm` is accepted for a uniform factory signature; LeNet has no batch norm.
    """
    del sync_batchnorm
    make = _Layers(dtype, seed, init)
    relu = "relu"
    inputs = keras.Input(input_shape)
    x = layers.Activation(relu, dtype=dtype)(make.conv(width, 3, padding="valid")(inputs))
    x = layers.AveragePooling2D(2, dtype=dtype)(x)
    x = layers.Activation(relu, dtype=dtype)(
        make.conv(round(width * 2.5), 5, padding="valid")(x))
    x = layers.AveragePooling2D(2, dtype=dtype)(x)
    x = layers.Flatten(dtype=dtype)(x)
    x = layers.Activation(relu, dtype=dtype)(make.dense(round(width * 6.4))(x))
    return keras.Model(inputs, make.dense(num_classes, final=True)(x), name="lenet")


MIN_IMAGE_SIDE = {"resnet18": 1, "lenet": 14}  # LeNet's unpadded convs and pools shrink it


def check_input(name: str, input_shape: tuple[int, int, int], num_classes: int = 1,
                images: bool = True, tested: bool = True) -> None:
    """UsageError when the built-in model `name` cannot take images of input_shape (or
    features that are not images, or targets that are not class ids: num_classes 0), or
    the data set has no test part (tested False) to judge it on."""
    if usermodel.is_spec(name):
        return
    if not tested:  # ((x, y), None): what fit(x, y) takes, but nothing to test a classifier on
        raise UsageError(f"--model={name} is judged on the data set's test part, and it has "
                         "none: return ((x_train, y_train), (x_test, y_test)), or give a model "
                         "of your own (--model=MODULE:FUNCTION)")
    images = images and isinstance(input_shape, tuple) and len(input_shape) == 3
    if not images or num_classes < 1:
        what = "features are not images" if not images else "targets are not class ids"
        raise UsageError(f"--model={name} classifies images; the data set's {what}: give a "
                         "model of your own (--model=MODULE:FUNCTION)")
    side = MIN_IMAGE_SIDE.get(name, 1)
    if min(input_shape[:2]) < side:
        raise UsageError(f"--model={name} needs images of at least {side}x{side}; the data "
                         f"set's are {input_shape[0]}x{input_shape[1]}: give --image_size, "
                         f"e.g. --image_size={max(side, 28)}")


def build(name: str, width: int | None = None,
          input_shape: tuple[int, int, int] = (28, 28, 1), num_classes: int = 10,
          **kwargs: Any) -> keras.Model:
    """The model `name` at `width` (None or 0: the book's width) for images of input_shape
    and num_classes classes; `name` may also be MODULE:FUNCTION, your own (usermodel.py),
    which takes neither width nor the built-ins' settings (dtype: the global policy)."""
    if usermodel.is_spec(name):
        return usermodel.build(name, input_shape, num_classes, kwargs.get("dtype", "float32"),
                               kwargs.get("sync_batchnorm", False), kwargs.get("hp"),
                               kwargs.get("hparams", ""))
    kwargs = {k: v for k, v in kwargs.items() if k not in ("hp", "hparams")}
    check_input(name, input_shape, num_classes)
    factory = {"resnet18": resnet18, "lenet": lenet}[name]
    return factory(width=width or BOOK_WIDTH[name], input_shape=input_shape,
                   num_classes=num_classes, **kwargs)
