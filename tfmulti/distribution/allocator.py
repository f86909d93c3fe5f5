"""The memory allocator: TCMalloc when the machine has it, preloaded where processes start;
glibc's malloc told to keep a step's buffers where it is the one a process has.

With glibc's malloc, TensorFlow's CPU steps can hand their large buffers back to the system
and fault them in again, zeroed, on the next step. glibc serves a request of its mmap
threshold or more with a mapping of its own, unmapped when freed; it raises that threshold by
itself to the size of what a program frees, up to 32 MB, unless the program sets one, and
TensorFlow's tf.data sets it to 128 KB once per process, when the first generator dataset's
iterator runs: the datasets tf.distribute makes for each device of several in one process
are such datasets. Every buffer of 128 KB or more then costs a mapping and its page faults at
every step (benchmarks/results/malloc_threshold.json). keep_buffers sets glibc's thresholds to
the ceiling of its own after TensorFlow has set its one. TCMalloc keeps the buffers by
itself. An allocator can only be chosen when a process starts (LD_PRELOAD), and
tfmulti never restarts itself to choose one: it is preloaded where processes are created:
every child of the supervisor (the launcher's workers, the tuning workers, the benchmarks')
gets it (child_environment), as do `make run` and the Docker image; for a command of your
own, `LD_PRELOAD=<find_tcmalloc()> python -m tfmulti.main ...` (docs/performance.md). The
doctor and metrics.json say which malloc a process has.

TFMULTI_MALLOC (environment): `auto` (the default: TCMalloc if installed, else the system's),
`tcmalloc` (an error if not installed), `system`, or the path of a malloc library to preload.
"""
from __future__ import annotations

import ctypes
import os
import sys
from typing import TYPE_CHECKING

from tfmulti.errors import UsageError

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

SETTING = "TFMULTI_MALLOC"
NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib",
        "/usr/local/lib")
INSTALL_HINT = "apt-get install libtcmalloc-minimal4 (Debian, Ubuntu) or gperftools-libs"
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
KEPT_MMAP_THRESHOLD = 32 << 20  # the ceiling of glibc's own threshold (64-bit)
KEPT_TRIM_THRESHOLD = 2 * KEPT_MMAP_THRESHOLD  # glibc keeps the trim threshold at twice it
# your own thresholds for glibc's malloc, which keep_buffers leaves as you set them
GLIBC_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
GLIBC_TUNABLES = ("glibc.malloc.mmap_threshold", "glibc.malloc.trim_threshold")
KEPT = [False]  # whether keep_buffers set glibc's thresholds in this process


class AllocatorError(UsageError):
    """A TFMULTI_MALLOC that cannot be honoured: one line, as any usage error."""


def find_tcmalloc(dirs=DIRS):
    """The path of an installed TCMalloc library, or None."""
    for directory in dirs:
        for name in NAMES:
            path = os.path.join(directory, name)
            if os.path.isfile(path):
                return path
    return None


def choose(setting: str | None, dirs: Sequence[str] = DIRS) -> str | None:
    """The library TFMULTI_MALLOC=setting asks to preload, or None for the system's malloc."""
    setting = (setting or "auto").strip()
    if setting == "system":
        return None
    if setting in ("auto", "tcmalloc"):
        path = find_tcmalloc(dirs)
        if path is None and setting == "tcmalloc":
            raise AllocatorError(f"{SETTING}=tcmalloc: TCMalloc is not installed "
                                 f"({INSTALL_HINT}); or set {SETTING}=system")
        return path
    if os.path.isabs(setting):
        if not os.path.isfile(setting):
            raise AllocatorError(f"{SETTING}={setting}: no such file")
        return setting
    raise AllocatorError(f"{SETTING}={setting}: give auto, tcmalloc, system or the absolute "
                         "path of a malloc library")


def memory_map(maps_path="/proc/self/maps"):
    """This process's memory map ('' where there is none to read: not Linux)."""
    try:
        with open(maps_path) as f:
            return f.read()
    except OSError:
        return ""


def loaded_malloc(maps_path: str = "/proc/self/maps") -> str:
    """The malloc library mapped into this process ('tcmalloc', 'jemalloc' or 'system')."""
    maps = memory_map(maps_path)
    for name in ("tcmalloc", "jemalloc"):
        if f"lib{name}" in maps:
            return name
    return "system"


def tuned_by_you(environ: Mapping[str, str]) -> bool:
    """Whether the environment sets glibc's mmap or trim threshold itself."""
    return (any(environ.get(name) for name in GLIBC_SETTINGS)
            or any(name in environ.get("GLIBC_TUNABLES", "") for name in GLIBC_TUNABLES))


def keep_buffers(before: Callable[[], None] = lambda: None,
                 environ: Mapping[str, str] = os.environ,
                 loaded: Callable[[], str] = loaded_malloc) -> bool:
    """With glibc's malloc (and neither threshold set in the environment by you): runs
    before() (what sets TensorFlow's own threshold: tfprivate.settle_tf_data_malloc), then
    sets glibc's mmap threshold to 32 MB and its trim threshold to 64 MB, so that a step's
    buffers stay in the heap from one step to the next. True when set; False otherwise (another
    malloc, your thresholds, not Linux). Memory: up to 64 MB more kept free in each of
    glibc's arenas."""
    if loaded() != "system" or not sys.platform.startswith("linux") or tuned_by_you(environ):
        return False
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:  # a C library without it
        return False
    before()
    KEPT[0] = bool(mallopt(M_MMAP_THRESHOLD, KEPT_MMAP_THRESHOLD)
                   and mallopt(M_TRIM_THRESHOLD, KEPT_TRIM_THRESHOLD))
    return KEPT[0]


def preloads_without(environ, library):
    """LD_PRELOAD's libraries (colon or space separated) other than `library`."""
    return [p for p in environ.get("LD_PRELOAD", "").replace(":", " ").split() if p != library]


def _with_preload(environ, library):
    """environ with `library` first in LD_PRELOAD (what was there kept after it)."""
    others = preloads_without(environ, library)
    return dict(environ, LD_PRELOAD=" ".join([library] + others),
                # TensorFlow's data arrays are legitimately large: no report per allocation.
                TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD=environ.get(
                    "TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD", str(1 << 40)))


def preload_environment(environ, library):
    """environ with `library` first in LD_PRELOAD (what was there kept after it)."""
    return _with_preload(environ, library)


def child_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment a process tfmulti starts gets (the supervisor's children): environ
    with the malloc its TFMULTI_MALLOC chooses first in LD_PRELOAD, so the child has it from
    its first instruction; unchanged for the system's malloc (and for auto without TCMalloc:
    nothing to preload, so no loader error). Raises AllocatorError for a setting that cannot
    be honoured."""
    library = choose(setting_of(environ))
    return dict(environ) if library is None else _with_preload(environ, library)


def setting_of(environ):
    return (environ.get(SETTING) or "auto").strip()


def describe(environ: Mapping[str, str] = os.environ, dirs: Sequence[str] = DIRS,
             loaded: Callable[[], str] = loaded_malloc,
             kept: bool | None = None) -> tuple[str, str]:
    """(what this process uses, a hint or ''): for the doctor and a CPU run's first lines.
    kept: whether keep_buffers set glibc's thresholds (None: whether it did in this
    process)."""
    used = loaded()
    if used != "system":
        return f"{used} (preloaded)", ""
    chosen = f" ({SETTING}=system)" if setting_of(environ) == "system" else ""
    if KEPT[0] if kept is None else kept:
        return (f"the system's{chosen}, a step's buffers kept (glibc's mmap threshold "
                f"{KEPT_MMAP_THRESHOLD >> 20} MB)"), ""
    if chosen:
        return f"the system's{chosen}", ""
    if find_tcmalloc(dirs) is None:
        return "the system's", (f"TCMalloc is not installed; CPU training steps page-fault "
                                f"their buffers in again every step without it ({INSTALL_HINT})")
    return "the system's", (f"TCMalloc is installed but not loaded: start the command with "
                            f"LD_PRELOAD={find_tcmalloc(dirs)} (as make run does, and "
                            "tfmulti's launcher and tuner in the processes they start): CPU "
                            "steps then keep their buffers, and CPU replicas in one process "
                            "run faster (docs/performance.md)")


def run_line(environ: Mapping[str, str] = os.environ, loaded: Callable[[], str] = loaded_malloc,
             kept: bool | None = None) -> str:
    """The line a CPU run says of its malloc in its first lines ('' when it was preloaded, as
    make run and tfmulti's own processes preload TCMalloc): glibc's, whether its buffers are
    kept, and the hint, if any (describe)."""
    used, hint = describe(environ, loaded=loaded, kept=kept)
    if loaded() != "system":
        return ""
    return f"malloc: {used}" + (f"; {hint}" if hint else "")
