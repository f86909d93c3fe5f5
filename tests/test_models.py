import keras
import numpy as np
import pytest

from tfmulti.models import zoo


def conv(k, cin, cout):
    return k * k * cin * cout + cout


def bn(c):
    return 4 * c  # gamma, beta, moving mean, moving variance


def book_resnet18_params(w, classes=10):
    """Counted from the book's architecture, independently of Keras."""
    total = conv(3, 1, w) + bn(w)
    cin = w
    for stage in range(4):
        c = w * 2 ** stage
        for block in range(2):
            first = block == 0 and stage > 0
            total += conv(3, cin, c) + bn(c) + conv(3, c, c) + bn(c)
            if first:
                total += conv(1, cin, c)
            cin = c
    return total + 8 * w * classes + classes


@pytest.mark.parametrize("width", [4, 64])
def test_resnet18_is_the_books(width):
    model = zoo.resnet18(width=width)
    assert model.count_params() == book_resnet18_params(width)
    convs = [layer for layer in model.layers if isinstance(layer, keras.layers.Conv2D)]
    stem = convs[0]
    assert stem.kernel_size == (3, 3) and stem.strides == (1, 1) and stem.padding == "same"
    assert len(convs) == 1 + 16 + 3  # stem, 8 blocks of two, 3 projections
    assert not any(isinstance(layer, keras.layers.MaxPooling2D) for layer in model.layers)
    assert sum(isinstance(layer, keras.layers.BatchNormalization) for layer in model.layers) == 17
    assert model.output_shape == (None, 10)
    last_block = [layer for layer in model.layers if isinstance(layer, keras.layers.Add)][-1]
    assert last_block.output.shape[1:] == (4, 4, 8 * width)  # 28 -> 14 -> 7 -> 4, no pooling


def test_build_defaults_to_the_books_width():
    assert zoo.build("resnet18").count_params() == book_resnet18_params(64)
    assert zoo.build("lenet", 0).layers[1].filters == 20


def test_lenet_is_the_books():
    model = zoo.lenet()
    expected = conv(3, 1, 20) + conv(5, 20, 50) + 800 * 128 + 128 + 128 * 10 + 10
    assert model.count_params() == expected
    flatten = [layer for layer in model.layers if isinstance(layer, keras.layers.Flatten)][0]
    assert flatten.output.shape[1] == 800  # 50 x 4 x 4
    pools = [layer for layer in model.layers if isinstance(layer, keras.layers.AveragePooling2D)]
    assert len(pools) == 2


def test_seeded_weights():
    a, b, c = zoo.lenet(width=4, seed=1), zoo.lenet(width=4, seed=1), zoo.lenet(width=4, seed=2)
    for x, y in zip(a.get_weights(), b.get_weights()):
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(a.get_weights()[0], c.get_weights()[0])
    book = zoo.lenet(width=4, seed=1, init="book").get_weights()[0]
    assert abs(book.std() - 0.01) < 0.005  # the book's Normal(0, 0.01)
    limit = np.sqrt(6 / (9 * 1 + 9 * 4))  # Glorot uniform for a 3x3 conv, 1 -> 4 channels
    assert abs(a.get_weights()[0]).max() <= limit and a.get_weights()[0].std() > 0.1


def test_mixed_precision_keeps_float32_logits():
    model = zoo.resnet18(width=4, dtype="mixed_bfloat16")
    convs = [layer for layer in model.layers if isinstance(layer, keras.layers.Conv2D)]
    assert convs[0].compute_dtype == "bfloat16" and convs[0].variable_dtype == "float32"
    out = model(np.zeros((2, 28, 28, 1), np.float32))
    assert str(out.dtype) in ("float32", "<dtype: 'float32'>")


def test_sync_batchnorm_is_passed_on():
    model = zoo.resnet18(width=4, sync_batchnorm=True)
    norms = [layer for layer in model.layers if isinstance(layer, keras.layers.BatchNormalization)]
    assert all(layer.synchronized for layer in norms)


def test_fused_batch_norm_matches_keras():
    x = np.random.default_rng(0).normal(2.0, 3.0, (8, 5, 5, 3)).astype(np.float32)
    ours, reference = zoo.BatchNorm(momentum=0.9), keras.layers.BatchNormalization(momentum=0.9)
    ours.build(x.shape)
    reference.build(x.shape)
    np.testing.assert_allclose(ours(x, training=True), reference(x, training=True), atol=2e-5)
    np.testing.assert_allclose(ours.moving_mean.numpy(), reference.moving_mean.numpy(), atol=1e-5)
    n = 8 * 5 * 5  # the fused kernel updates with the unbiased variance
    batch_var = x.reshape(-1, 3).var(axis=0)
    np.testing.assert_allclose(ours.moving_variance.numpy(), 0.9 + 0.1 * batch_var * n / (n - 1),
                               rtol=1e-4)
    assert type(zoo.resnet18(width=2).layers[2]) is zoo.BatchNorm
