"""A data set as every source gives it and the pipelines read it: its images (in memory, or
a folder's files), labels, class names and what to say of it."""
import dataclasses

import numpy as np

from tfmulti.data import synthetic

FASHION_MNIST_CLASSES = synthetic.CLASS_NAMES  # the same ten names, in the same order


@dataclasses.dataclass(frozen=True, eq=False)
class DataSet:
    name: str  # --dataset: one of DATASETS or your own (sources.py)
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
