"""Which CPU kernels TensorFlow runs, chosen before it is imported (quiet.import_tensorflow,
the one import every tool, worker and trial goes through).

TensorFlow turns its oneDNN kernels on by default only on x86 CPUs with AVX-512 VNNI,
bfloat16 or AMX; elsewhere it runs Eigen's, which trained the models here slower than
oneDNN's (benchmarks/results/onednn*.json). So tfmulti turns oneDNN on for every x86 CPU. Your
own TF_ENABLE_ONEDNN_OPTS wins (0: Eigen's kernels); other machines keep TensorFlow's
default. A process tfmulti starts inherits the choice and who made it (CHOSEN_BY).
"""
import os
import platform

VARIABLE = "TF_ENABLE_ONEDNN_OPTS"
CHOSEN_BY = "TFMULTI_ONEDNN_CHOSEN"  # set beside VARIABLE when tfmulti chose its value
X86 = ("x86_64", "amd64", "i386", "i686")


def choose(environ: "os._Environ | dict" = os.environ, machine: str | None = None) -> str:
    """Sets TF_ENABLE_ONEDNN_OPTS=1 in environ on an x86 machine unless it is set already;
    returns who chose: "tfmulti", "you" (it was set, not by tfmulti) or "TensorFlow" (left to
    its default). Before TensorFlow is imported: it reads the variable once, at import."""
    if VARIABLE in environ:
        return "tfmulti" if environ.get(CHOSEN_BY) == environ[VARIABLE] else "you"
    if (machine or platform.machine()).lower() not in X86:
        return "TensorFlow"
    environ[VARIABLE] = environ[CHOSEN_BY] = "1"
    return "tfmulti"


def described(onednn: bool, chosen_by: str, intra: int, inter: int) -> dict:
    """run.json's record of the CPU kernels and threads a run had (onednn: whether
    TensorFlow runs oneDNN's kernels; intra, inter: its thread pools, 0 = its default)."""
    return {"onednn": onednn, "chosen_by": chosen_by, "intra_op_threads": intra,
            "inter_op_threads": inter}


def line(record: dict) -> str:
    """The run's first lines' word on its CPU kernels and threads."""
    by = {"tfmulti": f"tfmulti's choice; {VARIABLE}=0 for Eigen's",
          "you": f"your {VARIABLE}",
          "TensorFlow": "TensorFlow's default on this CPU"}[record["chosen_by"]]
    pools = ", ".join(f"{n} {kind}-op thread{'s' if n != 1 else ''}" if n else
                      f"TensorFlow's {kind}-op threads"
                      for n, kind in ((record["intra_op_threads"], "intra"),
                                      (record["inter_op_threads"], "inter")))
    return (f"CPU kernels: {'oneDNN' if record['onednn'] else 'Eigen'}'s ({by}); {pools}")
