"""Why a CUDA build of TensorFlow finds no GPU, and which cuDNN a process loaded.

No TensorFlow import at the top: the checks are plain dlopen calls (ctypes), and the tests
run them in fresh processes with loader paths of their own.
"""
from __future__ import annotations

import ctypes
import glob
import os
import site
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Mapping

    from tfmulti.quiet import Captured


def _build_info():
    import tensorflow as tf

    return tf.sysconfig.get_build_info()


def _tensorflow_site():
    """The site directory TensorFlow is installed in (its RUNPATH looks in nvidia/*/lib)."""
    import tensorflow as tf

    return os.path.dirname(os.path.dirname(tf.__file__))


# What a CUDA build of TensorFlow dlopens before it registers GPUs ("Cannot dlopen some GPU
# libraries ... Skipping registering GPU devices..." when one fails; a warning that
# TF_CPP_MIN_LOG_LEVEL=2 hides). {cuda} and {cudnn}: the major versions it was built with.
CUDA_LIBRARIES = ("libcudart.so.{cuda}", "libcublas.so.{cuda}", "libcublasLt.so.{cuda}",
                  "libcufft.so.11", "libcusparse.so.{cuda}", "libcusolver.so.11",
                  "libcudnn.so.{cudnn}")


def why_no_gpu(startup: Captured) -> str:
    """TensorFlow's own lines on finding no GPU (cuInit's error, the libraries it could not
    dlopen) in its start-up text (quiet.Captured), and what loading those libraries tells."""
    said = [line.split("] ", 1)[-1] for marker in ("cuInit", "dlopen", "Could not load dynamic")
            for line in startup.lines(marker)]
    return "; ".join(said + [gpu_libraries_problem() or ""]).strip("; ")


def wheel_library_folders(site_dirs):
    """The lib folders of NVIDIA's CUDA wheels (nvidia/*/lib) under each site directory."""
    return sorted({d for s in site_dirs for d in glob.glob(os.path.join(s, "nvidia", "*", "lib"))})


def gpu_libraries_problem(build=None, tf_site=None, site_dirs=None, load=ctypes.CDLL):
    """Why a CUDA build of TensorFlow registers no GPU, as loading its libraries tells: the
    driver, or the first CUDA library it cannot load and the fix; None when all load (the
    driver then found no GPU) or TensorFlow is not a CUDA build.

    TensorFlow looks for the CUDA wheels' libraries next to itself (its RUNPATH:
    site-packages/nvidia/*/lib), then on the loader's path (LD_LIBRARY_PATH, ldconfig)."""
    build = _build_info() if build is None else build
    if not build.get("is_cuda_build"):
        return None
    try:
        load("libcuda.so.1")
    except OSError as e:
        return f"no NVIDIA driver: {e}"
    tf_site = tf_site or _tensorflow_site()
    beside = wheel_library_folders([tf_site])
    majors = {"cuda": str(build.get("cuda_version", "12")).split(".")[0],
              "cudnn": str(build.get("cudnn_version", "9")).split(".")[0]}
    missing = []
    for library in (name.format(**majors) for name in CUDA_LIBRARIES):
        if any(os.path.exists(os.path.join(d, library)) for d in beside):
            continue
        try:
            load(library)
        except OSError as e:
            missing.append(str(e))
    if not missing:
        return None
    if site_dirs is None:
        site_dirs = site.getsitepackages() + [site.getusersitepackages()] + sys.path
    elsewhere = [d for d in wheel_library_folders(d for d in site_dirs if d and d != tf_site)
                 if d not in beside]
    more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
    fix = (f"the CUDA wheels are installed apart from TensorFlow: export LD_LIBRARY_PATH="
           f"{':'.join(elsewhere)}" if elsewhere else
           "install TensorFlow's CUDA wheels: pip install 'tfmulti[gpu]'")
    return f"TensorFlow cannot load {missing[0]}{more}; {fix}"


def cudnn_loaded_version(build: Mapping[str, object] | None = None) -> tuple[int, int, int] | None:
    """The cuDNN this process loaded (after a convolution ran), as (major, minor, patch), or
    None. dlopen of the soname returns the copy TensorFlow loaded."""
    build = _build_info() if build is None else build
    major = str(build.get("cudnn_version", "9")).split(".")[0]
    try:
        library = ctypes.CDLL(f"libcudnn.so.{major}")
    except OSError:
        return None
    library.cudnnGetVersion.restype = ctypes.c_size_t
    return cudnn_version_parts(library.cudnnGetVersion())


def cudnn_version_parts(number):
    """cudnnGetVersion()'s number as (major, minor, patch): 90300 is 9.3.0, 8902 is 8.9.2."""
    if number >= 90000:
        return number // 10000, number % 10000 // 100, number % 100
    return number // 1000, number % 1000 // 100, number % 100


def cudnn_problem(loaded: tuple[int, int, int] | None, build: Mapping[str, object],
                  tf_version: str) -> str | None:
    """A line naming a cuDNN that does not match TensorFlow's build, or None."""
    built = str(build.get("cudnn_version", "?"))
    if loaded is None or str(loaded[0]) == built.split(".")[0]:
        return None
    return (f"cuDNN {'.'.join(map(str, loaded))} is loaded but TensorFlow {tf_version} was "
            f"built with cuDNN {built}: install cuDNN {built} (pip install 'tfmulti[gpu]' "
            f"brings it) or use an image that has it")
