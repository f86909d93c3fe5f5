"""Work in a process of its own: a tuning trial, the doctor's all-reduce probe.

A child process gives back everything TensorFlow kept (traced functions, pipelines), starts a
runtime with its own devices, and, unlike a thread, can be given up on when a collective hangs.
Children die with their parent (Linux), so a killed session leaves nothing running.
"""
from __future__ import annotations

import contextlib
import ctypes
import importlib
import multiprocessing
import os
import pickle
import signal
from typing import TYPE_CHECKING, Any

from tfmulti import quiet
from tfmulti.distribution import allocator

if TYPE_CHECKING:
    from collections.abc import Callable

# Set by a parent that starts an entry point (the launcher, the tuning chief): the child's
# cli.run makes it die with that parent.
PARENT_VARIABLE = "TFMULTI_PARENT_PID"


class Died(RuntimeError):
    """The child ended without sending anything."""


def die_with_parent(parent):
    """Linux: this process is killed when `parent`, the process that started it, dies, so a
    killed session leaves nothing training (or holding GPUs) behind."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:
        os._exit(1)  # the parent was gone before the line above


def die_with_parent_from_environment() -> None:
    """die_with_parent for an entry point started by a tfmulti parent (see PARENT_VARIABLE);
    the variable is taken out so that this process's own children do not inherit it."""
    parent = os.environ.pop(PARENT_VARIABLE, None)
    if parent:
        die_with_parent(int(parent))


def _start(target, send, args):
    """The spawned process: it dies with its parent, loads TensorFlow with its start-up lines
    held back (quiet.py), and only then unpickles the work (target and args name modules
    that import TensorFlow)."""
    die_with_parent(multiprocessing.parent_process().pid)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    quiet.import_tensorflow()
    module, _, name = target.partition(":")
    function = importlib.import_module(module)
    for part in name.split("."):
        function = getattr(function, part)
    function(send, *pickle.loads(args))


@contextlib.contextmanager
def _preloaded_environment():
    """os.environ as the spawned child should start with it (the malloc TFMULTI_MALLOC chooses
    preloaded, as for every process tfmulti starts): multiprocessing's spawn hands the child
    this process's environment, so it is set for the start and put back after."""
    wanted = allocator.child_environment(os.environ)
    saved = {k: os.environ.get(k) for k in wanted if os.environ.get(k) != wanted[k]}
    os.environ.update({k: wanted[k] for k in saved})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run(target: Callable[..., None], args: tuple[Any, ...], timeout: float | None = None,
        what: str = "the process",
        started: Callable[[multiprocessing.Process | None], None] | None = None) -> Any:
    """target(send, *args) in a spawned process; returns the one thing it sends.
    started(process) is called once it runs, and started(None) once it has ended (a
    parent that forwards signals to it).

    Raises Died if it ends without sending, TimeoutError if nothing comes within `timeout`
    seconds (the process is then killed).
    """
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    work = (f"{target.__module__}:{target.__qualname__}", send, pickle.dumps(args))
    process = context.Process(target=_start, args=work)
    with _preloaded_environment():
        process.start()
    if started is not None:
        started(process)
    send.close()
    try:
        if timeout is not None and not receive.poll(timeout):
            process.kill()
            process.join()
            raise TimeoutError(f"{what} sent nothing in {timeout:g} s")
        try:
            return receive.recv()
        except EOFError:
            process.join()
            raise Died(f"{what} died (exit code {process.exitcode})") from None
        finally:
            process.join()
    finally:
        if started is not None:
            started(None)
