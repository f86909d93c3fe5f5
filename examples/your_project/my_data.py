"""Your data: each function takes no arguments and returns
((x_train, y_train), (x_test, y_test)) numpy arrays, as keras.datasets loaders do, and
optionally the class names. Your model takes the features as returned, as model.fit gives
them: here float32 images in [0, 1], as tfmulti's own sets (synthetic, fashion_mnist) give
them, so my_models.py's models take either."""
import numpy as np

SHAPES = ("circle", "square", "triangle")


def shapes(train_size=3000, test_size=600, side=32, seed=0):
    """Colored circles, squares and triangles of random size and place on a noisy
    background: made here, so the example runs offline."""
    rng = np.random.default_rng(seed)

    def draw(n):
        labels = rng.integers(0, len(SHAPES), n)
        rows, cols = np.mgrid[:side, :side]
        images = rng.integers(0, 60, (n, side, side, 3))
        for image, label in zip(images, labels):
            r = rng.integers(side // 6, side // 3)
            cy, cx = rng.integers(r, side - r, 2)
            if SHAPES[label] == "circle":
                mask = (rows - cy) ** 2 + (cols - cx) ** 2 <= r * r
            elif SHAPES[label] == "square":
                mask = (abs(rows - cy) <= r * 0.8) & (abs(cols - cx) <= r * 0.8)
            else:
                mask = (rows <= cy + r) & (rows - (cy - r) >= 2 * abs(cols - cx))
            image[mask] = rng.integers(120, 256, 3)
        return (images / 255).astype(np.float32), labels

    return draw(train_size), draw(test_size), list(SHAPES)


def cifar10():
    """CIFAR-10 through keras.datasets (downloads 170 MB on first use: needs a network)."""
    import keras

    names = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship",
             "truck"]
    (x, y), (tx, ty) = keras.datasets.cifar10.load_data()  # uint8: scaled here, as in fit
    return (x.astype(np.float32) / 255, y), (tx.astype(np.float32) / 255, ty), names
