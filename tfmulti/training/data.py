"""The data sets and the per-replica tf.data pipeline.

The built-in sources behind `load()`: Fashion-MNIST from tensorflow-datasets or a directory of
the four canonical IDX files, and the embedded synthetic set; your own come from userdata.py.
Each gives a `DataSet` of images held in memory (Fashion-MNIST is 55 MB), from which the
pipelines gather batches.

The training stream is a pure function of (seed, epoch, step): each epoch is a stateless
permutation of all examples, cut into global batches; input pipeline p (one per worker) takes
its contiguous slice of each global batch and deals it to its replicas as consecutive
per-replica batches. So replicas see distinct examples, an epoch covers the data set (less the
remainder of a global batch), and a run can restart at any step by rebuilding the stream
there: that, not the tf.data iterator (tf.distribute's iterators cannot be checkpointed), is
what a checkpoint needs to hold for the data.
"""
import contextlib
import dataclasses
import gzip
import math
import os
import socket
import struct
import urllib.parse
import zlib

import numpy as np
import tensorflow as tf

from tfmulti.training import synthetic
from tfmulti.run.config import DATASETS, image_size
from tfmulti.run.plan import eval_steps, steps_per_epoch
from tfmulti.errors import DataError

FASHION_MNIST_CLASSES = synthetic.CLASS_NAMES  # the same ten names, in the same order
IDX_FILES = {
    "train_images": "train-images-idx3-ubyte.gz",
    "train_labels": "train-labels-idx1-ubyte.gz",
    "test_images": "t10k-images-idx3-ubyte.gz",
    "test_labels": "t10k-labels-idx1-ubyte.gz",
}
_IMAGES_MAGIC, _LABELS_MAGIC = 0x00000803, 0x00000801  # unsigned bytes, 3 or 1 dimensions


@dataclasses.dataclass(frozen=True, eq=False)
class DataSet:
    name: str  # --dataset: one of DATASETS or your own (userdata.py)
    source: str  # where the examples came from, for reports
    train_images: np.ndarray  # [n, height, width(, channels)]: uint8 0-255, or float32
    train_labels: np.ndarray  # int32 [n], class indices
    test_images: np.ndarray
    test_labels: np.ndarray
    class_names: tuple = FASHION_MNIST_CLASSES
    notes: tuple = ()  # lines to say before the first step (classes training cannot learn)

    @property
    def input_shape(self):
        """What the model sees of one image: (height, width, channels)."""
        shape = self.train_images.shape
        return (*shape[1:3], shape[3] if len(shape) == 4 else 1)

    @property
    def image_dtype(self):
        """uint8 (0-255, scaled to [0, 1] for the model) or float32 (taken as it is)."""
        return self.train_images.dtype.name

    @property
    def num_classes(self):
        return len(self.class_names)

    @property
    def display_name(self):
        """The name every report shows; synthetic figures must never pass for Fashion-MNIST."""
        if self.name == "synthetic":
            return "synthetic Fashion-like data (not Fashion-MNIST)"
        if self.name == "fashion_mnist":
            return "Fashion-MNIST"
        return self.name


# ----------------------------------------------------------------------------- sources

def load(name, data_dir=None, synthetic_train_size=60000, synthetic_test_size=10000, seed=0,
         image_size=None, share=(0, 1), smallest=None):
    """The data set `name` (--dataset); fashion_mnist reads IDX files from data_dir if it
    holds them; your own (MODULE:FUNCTION, folder:DIR, tfds:NAME) comes from userdata.py.
    image_size (height, width): every image resized to it. share and smallest: this worker's
    part of checking a folder's files (userdata.load)."""
    if name not in DATASETS:
        from tfmulti.training import userdata

        return userdata.load(name, data_dir, image_size, share, smallest)
    if image_size:
        from tfmulti.training import userdata

        built_in = load(name, data_dir, synthetic_train_size, synthetic_test_size, seed)
        return dataclasses.replace(
            built_in, train_images=userdata.resized(built_in.train_images, image_size),
            test_images=userdata.resized(built_in.test_images, image_size))
    if name == "synthetic":
        (x, y), (tx, ty) = synthetic.make_dataset(synthetic_train_size, synthetic_test_size, seed)
        return DataSet("synthetic", f"embedded synthetic generator (seed {seed})", x, y, tx, ty)
    if name != "fashion_mnist":
        raise DataError(f"unknown data set {name!r}; choose one of {', '.join(DATASETS)}")
    if data_dir is not None and not os.path.isdir(data_dir):
        raise DataError(f"--data_dir={data_dir} is not a directory")
    if data_dir is not None and has_idx_files(data_dir):
        return load_idx_dir(data_dir)
    return load_tfds(data_dir)


def load_for(cfg, share=(0, 1), smallest=None):
    """The data set RunConfig cfg names (--dataset, --data_dir, the synthetic sizes); with
    several workers, share and smallest split the check of a folder's files among them."""
    return load(cfg.dataset, cfg.data_dir, cfg.synthetic_train_size, cfg.synthetic_test_size,
                cfg.seed, image_size(cfg.image_size), share, smallest)


def _idx_path(data_dir, filename):
    """The canonical .gz name, or the same file uncompressed."""
    path = os.path.join(data_dir, filename)
    if not os.path.exists(path) and os.path.exists(path[:-3]):
        return path[:-3]
    return path


def has_idx_files(data_dir):
    return any(os.path.exists(_idx_path(data_dir, f)) for f in IDX_FILES.values())


def read_idx(path, magic):
    """The array in one IDX file, checked: magic number, dimensions and payload size."""
    try:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise DataError(f"{path}: missing (expected the four files {', '.join(IDX_FILES.values())})")
    except (OSError, EOFError, zlib.error) as e:
        raise DataError(f"{path}: cannot be read, truncated or corrupt ({e})")
    if len(raw) < 4:
        raise DataError(f"{path}: truncated: {len(raw)} bytes, not even an IDX header")
    (found,) = struct.unpack(">I", raw[:4])
    if found != magic:
        raise DataError(f"{path}: not an IDX {'image' if magic == _IMAGES_MAGIC else 'label'} "
                        f"file (magic number 0x{found:08x}, expected 0x{magic:08x})")
    ndim = magic & 0xFF
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DataError(f"{path}: truncated inside the header")
    dims = struct.unpack(f">{ndim}I", raw[4:header])
    expected = math.prod(dims)
    if len(raw) - header != expected:
        state = "truncated" if len(raw) - header < expected else "longer than its header says"
        raise DataError(f"{path}: {state}: header says {'x'.join(map(str, dims))} "
                        f"({expected} bytes of data), the file holds {len(raw) - header}")
    return np.frombuffer(raw, np.uint8, offset=header).reshape(dims)


def _checked_split(data_dir, images_key, labels_key):
    images_path = _idx_path(data_dir, IDX_FILES[images_key])
    labels_path = _idx_path(data_dir, IDX_FILES[labels_key])
    images = read_idx(images_path, _IMAGES_MAGIC)
    labels = read_idx(labels_path, _LABELS_MAGIC)
    if images.shape[1:] != (28, 28):
        raise DataError(f"{images_path}: images are {images.shape[1]}x{images.shape[2]}, "
                        "Fashion-MNIST's are 28x28")
    if len(images) != len(labels):
        raise DataError(f"{labels_path}: {len(labels)} labels for the {len(images)} images "
                        f"in {images_path}")
    if len(labels) and labels.max() >= len(FASHION_MNIST_CLASSES):
        raise DataError(f"{labels_path}: label {labels.max()} out of range 0-9")
    return images, labels.astype(np.int32)


def load_idx_dir(data_dir):
    """Fashion-MNIST from the four canonical IDX files (gzipped or not) in data_dir."""
    train = _checked_split(data_dir, "train_images", "train_labels")
    test = _checked_split(data_dir, "test_images", "test_labels")
    return DataSet("fashion_mnist", f"IDX files in {data_dir}", *train, *test)


def check_download_host(url, timeout=5.0):
    """Fails fast when the download host is unreachable (offline, TFDS retries for minutes)."""
    parts = urllib.parse.urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname, port), timeout=timeout).close()
    except OSError as e:
        raise OSError(f"{parts.hostname} is unreachable: {e}") from e


def _split_arrays(dataset):
    images, labels = [], []
    for x, y in dataset.batch(10000).as_numpy_iterator():
        images.append(x.reshape(-1, 28, 28))
        labels.append(y.astype(np.int32))
    return np.concatenate(images), np.concatenate(labels)


def download_url(builder):
    """Where tensorflow-datasets fetches Fashion-MNIST from."""
    return getattr(builder, "URL", "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/")


@contextlib.contextmanager
def quiet_absl():
    from absl import logging

    before = logging.get_verbosity()
    logging.set_verbosity(logging.ERROR)
    try:
        yield
    finally:
        logging.set_verbosity(before)


def load_tfds(data_dir=None, check_network=check_download_host):
    """Fashion-MNIST through tensorflow-datasets, downloading it into data_dir if needed."""
    import tensorflow_datasets as tfds  # slow to import; only this path needs it

    with quiet_absl():  # "Variant folder ... has no dataset_info.json" before a download
        builder = tfds.builder("fashion_mnist", data_dir=data_dir)
        prepared = builder.is_prepared()
    if not prepared:
        try:
            check_network(download_url(builder))
            builder.download_and_prepare()
        except Exception as e:  # TFDS and requests raise many kinds; all mean "no data"
            reason = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
            raise DataError(
                f"cannot download Fashion-MNIST with tensorflow-datasets (no network? {reason}); "
                f"pass --data_dir=DIR holding the four IDX files ({', '.join(IDX_FILES.values())})"
                ", or use --dataset=synthetic for the offline stand-in") from e
    train, test = (builder.as_dataset(split=s, as_supervised=True) for s in ("train", "test"))
    return DataSet("fashion_mnist", f"tensorflow-datasets ({builder.data_dir})",
                   *_split_arrays(train), *_split_arrays(test))


# ----------------------------------------------------------------------------- pipelines

def _to_model_input(images):
    """A gathered batch as the model takes it: float32 [b, h, w, c], uint8 scaled to [0, 1]."""
    x = tf.cast(images, tf.float32)
    if images.dtype == tf.uint8:
        x = x / 255.0
    return x[..., None] if images.shape.rank == 3 else x


def _gatherer(images):
    """idx -> the images at idx: gathered from memory, or, for a folder's images
    (userdata.ImageFiles), read from their files, so a pipeline reads only the files of its
    own batches."""
    if hasattr(images, "read_batch"):
        paths = tf.constant(images.paths)
        return lambda idx: images.read_batch(tf.gather(paths, idx))
    images_t = tf.constant(images)
    return lambda idx: tf.gather(images_t, idx)


def _pipeline_layout(input_context, per_replica_batch_size):
    """(global batch, replicas this pipeline feeds, this pipeline's index, pipeline count)."""
    replicas = input_context.num_replicas_in_sync // input_context.num_input_pipelines
    return (per_replica_batch_size * input_context.num_replicas_in_sync, replicas,
            input_context.input_pipeline_id, input_context.num_input_pipelines)


def _my_batches(global_order, steps, layout, per_replica_batch_size):
    """This pipeline's per-replica index batches, [steps * replicas, per_replica_batch]."""
    _, replicas, pipeline_id, pipelines = layout
    order = tf.reshape(global_order, [steps, pipelines, replicas * per_replica_batch_size])
    return tf.reshape(order[:, pipeline_id], [steps * replicas, per_replica_batch_size])


def _finish(dataset):
    options = tf.data.Options()
    options.deterministic = True
    return dataset.prefetch(tf.data.AUTOTUNE).with_options(options)


def train_input_fn(images, labels, per_replica_batch_size, seed, start_step=0):
    """dataset_fn for distribute_datasets_from_function: endless (images, labels) batches.

    Starts at global step `start_step` (counted from the start of training), so a resumed run
    continues exactly where the checkpoint was taken.
    """
    num_examples = len(images)

    def dataset_fn(input_context):
        layout = _pipeline_layout(input_context, per_replica_batch_size)
        global_batch, replicas = layout[0], layout[1]
        steps = steps_per_epoch(num_examples, global_batch)
        if steps < 1:
            raise DataError(f"global batch {global_batch} is larger than the {num_examples} "
                            "training examples")
        take, labels_t = _gatherer(images), tf.constant(labels)

        def epoch_batches(epoch):
            order = tf.random.experimental.stateless_shuffle(
                tf.range(num_examples), seed=tf.stack([tf.constant(seed, tf.int64), epoch]))
            batches = _my_batches(order[:steps * global_batch], steps, layout,
                                  per_replica_batch_size)
            return tf.data.Dataset.from_tensor_slices(batches)

        dataset = (tf.data.Dataset.counter(start_step // steps)
                   .flat_map(epoch_batches)
                   .skip((start_step % steps) * replicas)
                   .map(lambda idx: (_to_model_input(take(idx)), tf.gather(labels_t, idx)),
                        num_parallel_calls=tf.data.AUTOTUNE)
                   # Endless, and said so: tf.distribute cannot see it through flat_map, and
                   # across workers it would then agree on "does every worker still have a
                   # batch?" with an all-reduce before every step.
                   .apply(tf.data.experimental.assert_cardinality(tf.data.INFINITE_CARDINALITY)))
        return _finish(dataset)

    return dataset_fn


def eval_input_fn(images, labels, per_replica_batch_size):
    """dataset_fn giving every test example exactly once, as (images, labels, weights).

    The set is padded to whole global batches; padding has weight 0, so weighted metrics
    count each real example once whatever the batch and replica counts.
    """
    num_examples = len(images)

    def dataset_fn(input_context):
        layout = _pipeline_layout(input_context, per_replica_batch_size)
        steps = eval_steps(num_examples, layout[0])
        take, labels_t = _gatherer(images), tf.constant(labels)
        batches = _my_batches(tf.range(steps * layout[0]), steps, layout, per_replica_batch_size)

        def gather(idx):
            real = tf.minimum(idx, num_examples - 1)
            return (_to_model_input(take(real)), tf.gather(labels_t, real),
                    tf.cast(idx < num_examples, tf.float32))

        return _finish(tf.data.Dataset.from_tensor_slices(batches).map(gather))

    return dataset_fn
