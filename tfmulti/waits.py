"""The one bounded wait: every wait on another process, a file or a server asks its
question again until it is answered or its time is up, never for ever."""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def until(answer: Callable[[], T], seconds: float, poll_s: float = 0.05) -> T:
    """answer()'s first true value, asked every poll_s seconds (at least once) for at most
    `seconds`; its last value, false, when the time runs out. An error answer() raises ends
    the wait with it."""
    deadline = time.monotonic() + seconds
    while True:
        got = answer()
        if got or time.monotonic() >= deadline:
            return got
        time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))
