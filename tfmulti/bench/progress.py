"""A one-line progress bar for measurements that take a minute: what is being measured now,
and how much of the time budget is gone.

On a terminal it redraws one line (`\\r`) twice a second, so it moves during a long call
(tracing a model, a step of several seconds). Piped, it writes one line per change, or,
with piped_lines=False (the doctor, whose stderr holds its problem lines), nothing.
"""
import sys
import threading
import time

WIDTH = 24  # characters of the bar
TICK_S = 0.5  # seconds between redraws on a terminal


class Bar:
    def __init__(self, budget_s, stream=None, piped_lines=True):
        self.stream = sys.stderr if stream is None else stream
        self.budget_s = budget_s
        self.live = bool(getattr(self.stream, "isatty", lambda: False)())
        self.piped_lines = piped_lines
        self.label = ""
        self.start = time.perf_counter()
        self._drawn = 0  # characters of the line on the terminal
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ticker = None
        if self.live:  # started here, not at import: a thread only while a bar is shown
            self._ticker = threading.Thread(target=self._tick, daemon=True)
            self._ticker.start()

    def elapsed(self):
        return time.perf_counter() - self.start

    def show(self, label):
        """What is being measured from now on."""
        with self._lock:
            self.label = label
            if self.live:
                self._draw()
            elif self.piped_lines:
                print(f"  {self.elapsed():4.0f} s  {label}", file=self.stream, flush=True)

    def line(self):
        elapsed = self.elapsed()
        filled = int(WIDTH * min(1.0, elapsed / self.budget_s)) if self.budget_s > 0 else WIDTH
        return (f"[{'#' * filled}{'-' * (WIDTH - filled)}] {elapsed:3.0f}/{self.budget_s:.0f} s"
                f"  {self.label}")

    def _draw(self):
        text = self.line()
        self.stream.write("\r" + text + " " * max(0, self._drawn - len(text)))
        self.stream.flush()
        self._drawn = len(text)

    def _tick(self):
        while not self._stop.wait(TICK_S):
            with self._lock:
                self._draw()

    def close(self):
        """Stops redrawing and leaves the last line (a terminal's cursor on a new line)."""
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
            with self._lock:
                self._draw()
                self.stream.write("\n")
                self.stream.flush()


def silent():
    """A bar that shows nothing (a measurement nobody watches)."""
    return Bar(0.0, stream=_Nowhere(), piped_lines=False)


class _Nowhere:
    def write(self, text):
        pass

    def flush(self):
        pass
