import numpy as np

from tfmulti.data import synthetic


def test_shaped_like_fashion_mnist():
    (x, y), (tx, ty) = synthetic.make_dataset(600, 200, seed=0)
    assert x.shape == (600, 28, 28) and x.dtype == np.uint8
    assert tx.shape == (200, 28, 28) and ty.dtype == np.int32
    assert np.bincount(y).tolist() == [60] * 10  # balanced
    assert len(synthetic.CLASS_NAMES) == 10 and synthetic.CLASS_NAMES[9] == "Ankle boot"
    assert 0 < x.mean() < 128 and x.max() > 200  # light garments on a dark ground


def test_seeded():
    a, b, c = (synthetic.make_split(100, seed) for seed in (1, 1, 2))
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    assert not np.array_equal(a[0], c[0])


def test_train_and_test_differ():
    (x, _), (tx, _) = synthetic.make_dataset(100, 100, seed=0)
    assert not np.array_equal(x, tx)


def test_learnable_but_not_trivial():
    """A nearest-class-mean classifier beats chance by far but is far from perfect."""
    (x, y), (tx, ty) = synthetic.make_dataset(3000, 1000, seed=0)
    x, tx = x.reshape(len(x), -1) / 255.0, tx.reshape(len(tx), -1) / 255.0
    centroids = np.stack([x[y == k].mean(0) for k in range(10)])
    predicted = np.argmin(((tx[:, None, :] - centroids[None]) ** 2).sum(-1), axis=1)
    accuracy = (predicted == ty).mean()
    assert 0.4 < accuracy < 0.9, accuracy
    # and the images of one class vary: position, scale, texture
    same_class = x[y == 0][:50]
    assert same_class.std(axis=0).mean() > 0.1
