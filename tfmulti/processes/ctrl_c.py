"""Ctrl-C while a tool starts, kept even where TensorFlow loses it.

Python turns SIGINT into a KeyboardInterrupt raised wherever the main thread is. During a
run's start that is often inside TensorFlow's own C++ (tracing, building the model, nest),
which may turn the exception into another one (a TypeError from its C++ nest was seen) or
drop it, so the run went on and trained to the end as if no key had been pressed. So the
tools' SIGINT handler records the Ctrl-C before it raises: the run checks the record before
it trains (`stop_if_arrived`), and an error that comes out of a start a Ctrl-C interrupted is
taken for the Ctrl-C (`interrupted`).
"""
from __future__ import annotations

import signal

_arrived: list[int] = []


def _record_and_raise(signum, frame):
    _arrived.append(signum)
    raise KeyboardInterrupt


def install() -> None:
    """SIGINT recorded, then raised as usual; a SIGINT a shell left ignored (a background
    job) or another program's handler stays as it is."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _record_and_raise)


def record() -> None:
    """A Ctrl-C another handler took (the run's own while it trains: a second Ctrl-C)."""
    _arrived.append(signal.SIGINT)


def arrived() -> bool:
    return bool(_arrived)


def interrupted(error: BaseException) -> bool:
    """Whether `error` is, or came out of, a Ctrl-C (an exit the tool chose is not)."""
    return isinstance(error, KeyboardInterrupt) or (arrived() and not isinstance(error,
                                                                                SystemExit))


def stop_if_arrived() -> None:
    """Raises KeyboardInterrupt when a Ctrl-C arrived and something swallowed it."""
    if arrived():
        raise KeyboardInterrupt
