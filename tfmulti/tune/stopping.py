"""A process that runs trials, stopped by SIGTERM (how clusters preempt) or Ctrl-C: the trial
under way saves a checkpoint in its run folder and ends, no new trial starts, and the
process exits 75, as the main job does, so a batch script requeues it. Run again, the
session goes on: keras-tuner runs the interrupted trial again (it is still RUNNING in the
oracle) and the trial goes on from its checkpoint."""
from __future__ import annotations

import contextlib
import os
import signal
import threading


class SessionStopped(BaseException):
    """Raised out of keras-tuner's search: a BaseException, since keras-tuner counts any
    Exception from a trial as the trial failing (and retries or fails it)."""

    def __init__(self, by, where=""):
        super().__init__(f"stopped by {by}{where}")
        self.by, self.where = by, where


class TrialStopper:
    """The session's side: what asked it to stop, and the trial process to pass SIGTERM to
    (the trial's own handler then saves and stops; Ctrl-C reaches the trial from the
    terminal by itself)."""

    def __init__(self):
        self.by, self.process = "", None

    def started(self, process):
        """child.run's hook: the trial's process (None once it has ended)."""
        self.process = process
        if process is not None and self.by == "SIGTERM":  # it came while the trial started
            self._forward()

    def _forward(self):
        process = self.process
        if process is not None and process.pid and process.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGTERM)

    def check(self):
        """Raises SessionStopped once a stop was asked (before a trial starts)."""
        if self.by:
            raise SessionStopped(self.by, ", between trials")

    @contextlib.contextmanager
    def installed(self):
        """SIGTERM and SIGINT handled while the block runs (main thread only)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return

        def on_signal(signum, frame):
            self.by = self.by or ("SIGTERM" if signum == signal.SIGTERM else "Ctrl-C")
            if signum == signal.SIGTERM:
                self._forward()

        previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)
                    if signal.getsignal(s) is not signal.SIG_IGN}
        try:
            yield self
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
