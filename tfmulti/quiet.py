"""TensorFlow's C++ start-up lines, kept off the console unless they explain a failure.

TensorFlow 2.21 writes several lines to stderr on import and on device discovery ("All log
messages before absl::InitializeLog()...", oneDNN, cuInit) that TF_CPP_MIN_LOG_LEVEL does not
silence; they would bury the one line a bad flag deserves. `captured_stderr` holds them at the
file-descriptor level and gives them back: replayed if the block fails, and readable (to quote
CUDA's reason when no GPU is found). Set TF_CPP_MIN_LOG_LEVEL=0 to see everything as is.
"""
from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterator


class Captured:
    text = ""

    def lines(self, marker):
        return [line for line in self.text.splitlines() if marker in line]


@contextlib.contextmanager
def captured_stderr() -> Iterator[Captured]:
    captured = Captured()
    if os.environ.get("TF_CPP_MIN_LOG_LEVEL", "0") in ("0", "1"):
        yield captured  # the user asked for TensorFlow's logs
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield captured
        except BaseException:
            _restore(saved, sink, captured)
            sys.stderr.write(captured.text)
            raise
        _restore(saved, sink, captured)


def _restore(saved, sink, captured):
    sys.stderr.flush()
    os.dup2(saved, 2)
    os.close(saved)
    sink.seek(0)
    captured.text = sink.read().decode("utf-8", "replace")


def import_tensorflow() -> Captured:
    """Imports TensorFlow and looks for GPUs with the start-up lines held; returns them.

    The GPU look-up belongs here: CUDA's start-up lines come with it, or else later at an
    unpredictable point (absl's app.run flushes them). It does not start the runtime, so
    logical devices can still be configured afterwards.

    GPUs are numbered in PCI bus order, as nvidia-smi numbers them (CUDA's own default puts
    the fastest first), unless CUDA_DEVICE_ORDER says otherwise: --gpus, CUDA_VISIBLE_DEVICES
    and the doctor's table then mean the GPUs nvidia-smi shows under those numbers.
    """
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    if "tensorflow" in sys.modules:  # imported already: what it said then is kept
        return STARTUP
    with captured_stderr() as captured, _kept_out(UNUSED_AT_IMPORT):
        import tensorflow as tf

        tf.config.list_physical_devices("GPU")
    STARTUP.text = captured.text
    return captured


# `import tensorflow` imports all of Keras, and Keras's scikit-learn wrappers import
# scikit-learn (and SciPy's statistics) when it is installed, as keras-tuner's Bayesian tuner
# needs it to be: about 1 s of a 5 s start-up, in every process tfmulti starts. tfmulti does
# not use the wrappers (Keras leaves them out when scikit-learn is missing), so scikit-learn
# is kept out while TensorFlow imports; a later `import sklearn` (the Bayesian tuner's) works.
UNUSED_AT_IMPORT = ("sklearn",)


@contextlib.contextmanager
def _kept_out(names):
    """Within the block, `import name` raises ImportError for each of names not yet loaded."""
    kept = [name for name in names if name not in sys.modules]
    for name in kept:
        sys.modules[name] = None
    try:
        yield
    finally:
        for name in kept:
            if sys.modules.get(name, 0) is None:
                del sys.modules[name]


# What TensorFlow said at start-up in this process (empty unless import_tensorflow ran): the
# tools quote CUDA's reason from it when no GPU is found.
STARTUP = Captured()
