"""The CPU kernels TensorFlow runs (tfmulti/kernels.py): TensorFlow's default, or your
TF_ENABLE_ONEDNN_OPTS; said in the run's first lines and run.json (test_main.py's smoke run
shows them in a real run), with a warning where oneDNN's AVX2 code computes wrong gradients."""
import os
import subprocess
import sys

import numpy as np
import pytest

from tfmulti import kernels
from tfmulti.run.config import RunConfig
from tfmulti.rundir import lifecycle

# A 1x1 convolution of stride 2 on 4 channels, its weight gradient saved to argv[1]
GRADIENT = """
import sys
import numpy as np
import tensorflow as tf
tf.config.threading.set_intra_op_parallelism_threads(2)
rng = np.random.default_rng(0)
x = tf.constant(rng.normal(size=(32, 28, 28, 4)).astype("float32"))
w = tf.Variable(rng.normal(size=(1, 1, 4, 8)).astype("float32"))
with tf.GradientTape() as tape:
    loss = tf.reduce_sum(tf.nn.conv2d(x, w, 2, "VALID") ** 2)
np.save(sys.argv[1], tape.gradient(loss, w).numpy())
"""


def test_who_chose_the_kernels():
    assert kernels.chosen_by({}) == "TensorFlow"
    assert kernels.chosen_by({kernels.VARIABLE: "0"}) == "you"
    assert kernels.chosen_by({kernels.VARIABLE: "1"}) == "you"


def test_a_run_resumes_with_other_kernels():
    """run.json's record of the kernels is not part of what must match to resume (another
    machine, or TF_ENABLE_ONEDNN_OPTS changed), as its replicas are not."""
    run = {"config": RunConfig().record(), "global_batch_size": 64,
           "cpu_kernels": kernels.described(True, "TensorFlow", 1, 4, True)}
    other = dict(run, cpu_kernels=kernels.described(False, "you", 0, 0, False))
    assert lifecycle.identity(run) == lifecycle.identity(other)
    assert lifecycle.identity(run) != lifecycle.identity(dict(other, global_batch_size=32))


def test_the_first_lines_say_the_kernels_and_threads_and_warn_of_avx2s_gradients():
    assert kernels.line(kernels.described(True, "TensorFlow", 1, 4, True)) == (
        "CPU kernels: oneDNN's (TensorFlow's default on this CPU); 1 intra-op thread, "
        "4 inter-op threads")
    assert kernels.line(kernels.described(False, "you", 0, 0, False)) == (
        "CPU kernels: Eigen's (your TF_ENABLE_ONEDNN_OPTS); TensorFlow's intra-op threads, "
        "TensorFlow's inter-op threads")
    assert kernels.line(kernels.described(True, "you", 2, 2, False)).endswith(
        "; warning: without AVX-512 oneDNN's 1x1 strided convolutions on fewer than 8 "
        f"channels compute wrong gradients ({kernels.ISSUE})")


@pytest.mark.soak  # two TensorFlow processes: make test keeps under its 8 minutes on the
# slower CPU kind (its lines and the run's record of its kernels stay in make test)
def test_why_onednn_is_not_turned_on_without_avx512(tmp_path):
    """The ground of keeping TensorFlow's default: oneDNN's AVX2 code (what a CPU without
    AVX-512 runs; here held to it by ONEDNN_MAX_CPU_ISA) gets a 1x1 strided convolution's
    weight gradient on 4 channels wrong, where Eigen's and oneDNN's AVX-512 code agree.
    When this fails, oneDNN got it right: turning it on there can be weighed again."""
    def gradient(name, **env):
        subprocess.run([sys.executable, "-c", GRADIENT, str(tmp_path / name)], check=True,
                       env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **env}, timeout=300)
        return np.load(tmp_path / name)

    eigen = gradient("eigen.npy", TF_ENABLE_ONEDNN_OPTS="0")
    avx2 = gradient("avx2.npy", TF_ENABLE_ONEDNN_OPTS="1", ONEDNN_MAX_CPU_ISA="AVX2")
    assert np.abs(avx2 - eigen).max() > 0.1 * np.abs(eigen).max()
