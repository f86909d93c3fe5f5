"""Which CPU kernels TensorFlow runs, and why tfmulti leaves that to TensorFlow.

TensorFlow turns its oneDNN kernels on by itself only on x86 CPUs with AVX-512 VNNI, bfloat16
or AMX; elsewhere it runs Eigen's. oneDNN's are the faster (benchmarks/results/onednn.json:
ResNet-18 2.3x Eigen's on one replica, their AVX2 code 1.95x), but their AVX2 code, what a
CPU without AVX-512 runs, computes a 1x1 convolution's weight gradients wrongly when its
stride is above 1 and its input has fewer than 8 channels, or crashes with one thread
(oneDNN issue 6035; reproduced here: tests/test_kernels.py). So tfmulti keeps TensorFlow's
default, and says which kernels a run has (its first lines, run.json); your own
TF_ENABLE_ONEDNN_OPTS wins, and the line warns when it turns on that AVX2 code.
"""
import os

VARIABLE = "TF_ENABLE_ONEDNN_OPTS"
ISSUE = "https://github.com/uxlfoundation/oneDNN/issues/6035"


def chosen_by(environ: "os._Environ | dict" = os.environ) -> str:
    """Who chose this process's CPU kernels: "you" (TF_ENABLE_ONEDNN_OPTS set) or
    "TensorFlow" (its default on this CPU)."""
    return "you" if VARIABLE in environ else "TensorFlow"


def cpu_has_avx512(cpuinfo: str = "/proc/cpuinfo") -> bool | None:
    """Whether this CPU has AVX-512 (its flags list avx512f); None where that is not known."""
    try:
        with open(cpuinfo) as f:
            return "avx512f" in f.read().split()
    except OSError:
        return None


def described(onednn: bool, chosen: str, intra: int, inter: int,
              avx512: bool | None = None) -> dict:
    """run.json's record of the CPU kernels and threads a run had (onednn: whether
    TensorFlow runs oneDNN's kernels; intra, inter: its thread pools, 0 = its default;
    avx512: whether the CPU has AVX-512, None: not known)."""
    return {"onednn": onednn, "chosen_by": chosen, "intra_op_threads": intra,
            "inter_op_threads": inter, "cpu_avx512": avx512}


def line(record: dict) -> str:
    """The run's first lines' word on its CPU kernels and threads."""
    by = {"you": f"your {VARIABLE}", "TensorFlow": "TensorFlow's default on this CPU"}[
        record["chosen_by"]]
    pools = ", ".join(f"{n} {kind}-op thread{'s' if n != 1 else ''}" if n else
                      f"TensorFlow's {kind}-op threads"
                      for n, kind in ((record["intra_op_threads"], "intra"),
                                      (record["inter_op_threads"], "inter")))
    warning = (f"; warning: without AVX-512 oneDNN's 1x1 strided convolutions on fewer than 8 "
               f"channels compute wrong gradients ({ISSUE})"
               if record["onednn"] and record.get("cpu_avx512") is False else "")
    return (f"CPU kernels: {'oneDNN' if record['onednn'] else 'Eigen'}'s ({by}); "
            f"{pools}{warning}")
