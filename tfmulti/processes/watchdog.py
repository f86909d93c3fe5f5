"""The bound on a training call waiting for its batch from the tf.data service
(--data_service, data/service.py), which cannot tell the training worker that it stopped
serving (a dispatcher or every service worker gone): a step would wait for its batch forever.
No call of steps finished for --worker_timeout seconds past three times the longest call so
far, the run stops with one line (exit code STALLED_EXIT_CODE); its last checkpoint stays,
and the same command resumes from it."""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time

from tfmulti.run.config import host_port

STALLED_EXIT_CODE = 3  # no batch came from the service within the bound
FIRST_CALL = 2  # the first call (tracing, compiling) may take this many --worker_timeout


class Watchdog:
    """Stops the process with one line when no training call ends for `limit` seconds past
    three times the longest call so far (FIRST_CALL times `limit` for the first, which traces
    and compiles): the tf.data service stopped serving. tick() after every call, paused()
    between calls (the loop's Watched action); stop() at the end. exit: what stops the
    process (os._exit: the main thread is blocked in the step, and its checkpoints are on
    disk)."""

    def __init__(self, limit: float, service: str, exit=os._exit, checked_every: float = 1.0):
        self.limit, self.service, self._exit = limit, service, exit
        self._last = time.monotonic()  # when the last call ended (or the watch started)
        self._longest = None  # the longest gap between calls after the first (None: first)
        self._steps = 0
        self._paused = 0  # > 0: between calls, or a checkpoint being written: never cut
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, args=(checked_every,),
                                        name="data-service-watchdog", daemon=True)
        self._thread.start()

    def tick(self, steps: int):
        now = time.monotonic()
        self._longest = 0.0 if self._longest is None else max(self._longest, now - self._last)
        self._last, self._steps = now, steps

    def hold(self):
        """Not stopping the process until release() (between training calls, a checkpoint
        being written); holds nest."""
        self._paused += 1

    def release(self):
        """The end of a hold(): the wait counts again from now."""
        self._last = time.monotonic()
        self._paused -= 1

    @contextlib.contextmanager
    def paused(self):
        """hold() for the block."""
        self.hold()
        try:
            yield
        finally:
            self.release()

    def bound(self) -> float:
        if self._longest is None:
            return FIRST_CALL * self.limit
        return self.limit + 3 * self._longest

    def _watch(self, every):
        while not self._done.wait(every):
            if not self._paused and time.monotonic() - self._last > self.bound():
                where = host_port(self.service)
                print(f"tfmulti: error: no batch from the tf.data service at {where} for "
                      f"{self.bound():.0f} s after step {self._steps} (--worker_timeout="
                      f"{self.limit:g}); is its dispatcher up, with workers? The run stops; "
                      "its last checkpoint stays, and the same command resumes from it",
                      file=sys.stderr, flush=True)
                self._done.set()
                self._exit(STALLED_EXIT_CODE)

    def stop(self):
        self._done.set()
