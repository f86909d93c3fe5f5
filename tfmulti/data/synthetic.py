"""The embedded, offline data set shaped like Fashion-MNIST.

Garment-like silhouettes drawn from signed distance functions, each image with its own shape
proportions, position, scale, slant, stroke (outline), texture and noise. Seeded: the same
seed gives the same images on every machine. It is *not* Fashion-MNIST, and every report that
uses it says so (see `data.DataSet.display_name`).

Some classes are near neighbours on purpose, as in the real data set (T-shirt / shirt /
pullover / coat; sneaker / sandal / ankle boot), so that it is learnable but not trivial.
"""
import numpy as np

CLASS_NAMES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
               "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot")
IMAGE_SIZE = 28
_CHUNK = 4096  # images drawn at once; bounds the float32 scratch memory to ~40 MB


def _box(x, y, cx, cy, hw, hh):
    """Signed distance (approximate outside the corners) to an axis-aligned box."""
    return np.maximum(np.abs(x - cx) - hw, np.abs(y - cy) - hh)


def _union(*sds):
    return np.minimum.reduce(sds)


def _torso(x, y, p, bottom):
    return _box(x, y, 0.0, (bottom - 0.62) / 2, 0.36 * p["w"], (bottom + 0.62) / 2)


def _sleeves(x, y, p, length):
    """Two slanted sleeves hanging from the shoulders; length in [0, 1]."""
    reach = 0.36 * p["w"] + 0.5 * length
    dy = y + 0.55 - 0.55 * length * (np.abs(x) - 0.3 * p["w"]).clip(0) / reach
    return np.maximum(np.abs(x) - reach, np.abs(dy) - 0.16 * p["sleeve"])


def _neck(x, y, depth):
    return _box(x, y, 0.0, -0.62, 0.14, depth)


def _tshirt(x, y, p):
    return np.maximum(_union(_torso(x, y, p, 0.75 * p["h"]), _sleeves(x, y, p, 0.45)),
                      -_neck(x, y, 0.12))


def _trouser(x, y, p):
    gap = 0.05 + 0.05 * p["w"]
    legs = _box(np.abs(x), y, gap + 0.17 * p["w"], 0.05, 0.17 * p["w"], 0.82 * p["h"])
    return _union(legs, _box(x, y, 0.0, -0.7 * p["h"], gap + 0.34 * p["w"], 0.12))


def _pullover(x, y, p):
    return _union(_torso(x, y, p, 0.7 * p["h"]), _sleeves(x, y, p, 0.95))


def _dress(x, y, p):
    top, bottom = -0.8 * p["h"], 0.85 * p["h"]
    half_width = 0.16 * p["w"] + 0.3 * p["flare"] * (y - top) / (bottom - top)
    return np.maximum(np.abs(x) - half_width, np.abs(y - (top + bottom) / 2) - (bottom - top) / 2)


def _coat(x, y, p):
    body = _union(_torso(x, y, p, 0.85 * p["h"]), _sleeves(x, y, p, 1.0))
    opening = _box(x, y, 0.0, 0.1, 0.025, 0.75)  # the front opening: a dark line down the middle
    return np.maximum(body, -opening)


def _sandal(x, y, p):
    sole = _box(x, y, 0.0, 0.48, 0.85 * p["w"], 0.06)
    straps = np.abs(np.sin((x + p["phase"]) * 9.0)) - 0.45  # thin straps over the foot
    upper = np.maximum(_box(x, y, 0.05, 0.22, 0.7 * p["w"], 0.22), straps * 0.2)
    return _union(sole, upper)


def _shirt(x, y, p):
    body = _union(_torso(x, y, p, 0.75 * p["h"]), _sleeves(x, y, p, 0.9))
    collar = _box(np.abs(x), y, 0.12, -0.6, 0.07, 0.1)
    buttons = _box(x, np.mod(y + 0.6, 0.3) - 0.15, 0.0, 0.0, 0.03, 0.03)
    return np.maximum(_union(body, collar), -buttons)


def _sneaker(x, y, p):
    slope = 0.25 * p["flare"] * (x + 0.85) / 1.7  # lower towards the toe
    upper = np.maximum(_box(x, y, 0.0, 0.3, 0.82 * p["w"], 0.2), -(y - (0.05 + slope)))
    return _union(upper, _box(x, y, 0.0, 0.5, 0.88 * p["w"], 0.06))


def _bag(x, y, p):
    body = _box(x, y, 0.0, 0.25, 0.68 * p["w"], 0.45 * p["h"])
    radius = np.hypot(x, (y + 0.2) * 1.3)
    handle = np.maximum(np.abs(radius - 0.35 * p["w"]) - 0.06, y - 0.2 + 0.45 * p["h"] - 0.45)
    return _union(body, handle)


def _ankle_boot(x, y, p):
    shaft = _box(x, y, -0.3, -0.05, 0.3 * p["w"], 0.55 * p["h"])
    foot = _box(x, y, 0.1, 0.33, 0.7 * p["w"], 0.2)
    return _union(shaft, foot, _box(x, y, 0.1, 0.55, 0.75 * p["w"], 0.05))


_SHAPES = (_tshirt, _trouser, _pullover, _dress, _coat, _sandal, _shirt, _sneaker, _bag,
           _ankle_boot)


def _draw(labels, rng):
    """Draws one chunk of images (float32 in [0, 1]) for the given labels."""
    n = len(labels)
    grid = (np.arange(IMAGE_SIZE, dtype=np.float32) + 0.5) / IMAGE_SIZE * 2 - 1

    def per_image(low, high):
        return rng.uniform(low, high, size=(n, 1, 1)).astype(np.float32)

    scale, angle = per_image(0.8, 1.1), per_image(-0.18, 0.18)
    shift_x, shift_y = per_image(-0.12, 0.12), per_image(-0.1, 0.1)
    gx, gy = grid[None, None, :] - shift_x, grid[None, :, None] - shift_y
    cos, sin = np.cos(angle), np.sin(angle)
    x, y = (cos * gx + sin * gy) / scale, (-sin * gx + cos * gy) / scale
    params = {"w": per_image(0.8, 1.2), "h": per_image(0.85, 1.1), "sleeve": per_image(0.7, 1.3),
              "flare": per_image(0.6, 1.4), "phase": per_image(0.0, 3.0)}
    sd = np.empty((n, IMAGE_SIZE, IMAGE_SIZE), np.float32)
    for label, shape in enumerate(_SHAPES):
        rows = labels == label
        if rows.any():
            sd[rows] = shape(x[rows], y[rows], {k: v[rows] for k, v in params.items()})
    softness = 0.03 * per_image(0.7, 1.5)
    fill = 1 / (1 + np.exp(np.clip(sd / softness, -30, 30)))
    # Texture: brightness, a slow gradient and stripes of random frequency, then the stroke.
    brightness = per_image(0.35, 1.0)
    stripes = 1 - per_image(0.0, 0.35) * (
        0.5 + 0.5 * np.sin(y * per_image(4, 20) + per_image(0, 6)))
    gradient = 1 + per_image(-0.3, 0.3) * y
    stroke = per_image(0.0, 0.6) * np.exp(-(sd / (0.04 * per_image(0.6, 1.6))) ** 2)
    image = fill * brightness * stripes * gradient + stroke
    image += rng.normal(0, 1, image.shape).astype(np.float32) * per_image(0.02, 0.12)
    return np.clip(image, 0, 1)


def make_split(num_examples, seed):
    """Returns (images uint8 [n, 28, 28], labels int32 [n]), classes balanced and shuffled."""
    if num_examples < 1:
        raise ValueError(f"a synthetic split needs at least one example, got {num_examples}")
    rng = np.random.default_rng(seed)
    labels = rng.permutation(np.arange(num_examples) % len(CLASS_NAMES)).astype(np.int32)
    images = np.empty((num_examples, IMAGE_SIZE, IMAGE_SIZE), np.uint8)
    for start in range(0, num_examples, _CHUNK):
        chunk = labels[start:start + _CHUNK]
        images[start:start + len(chunk)] = np.rint(_draw(chunk, rng) * 255).astype(np.uint8)
    return images, labels


def make_dataset(train_size=60000, test_size=10000, seed=0):
    """Train and test splits from independent streams of one seed."""
    train_seed, test_seed = np.random.SeedSequence(seed).spawn(2)
    return make_split(train_size, train_seed), make_split(test_size, test_seed)
