"""Seeding Keras inside the test process, where earlier tests' input pipelines may still run.

`keras.utils.set_random_seed` also calls `tf.random.set_seed`, which clears the eager
context's kernel cache: with another test's tf.data iterator still prefetching on a background
thread, that crashed the pytest worker (a segmentation fault inside `_set_global_seed`). Keras's
own draws (initializers, random layers' seed generators) come from Python's `random` and its
global seed generator alone, so this seeds them the same way without touching TensorFlow's
context. (tfmulti itself seeds once at start-up, before anything runs.)
"""
import random

import numpy as np
from keras.src.backend.common import global_state
from keras.src.random import seed_generator
from keras.src.utils import rng_utils


def seed_keras(seed):
    """keras.utils.set_random_seed(seed) without tf.random.set_seed."""
    global_state.set_global_attribute(rng_utils.GLOBAL_RANDOM_SEED, seed)
    global_state.set_global_attribute(seed_generator.GLOBAL_SEED_GENERATOR, None)
    random.seed(seed)
    np.random.seed(seed)
