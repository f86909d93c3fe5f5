"""Steps of a root-only check (testing/container.py, testing/cluster.py): each prints one line,
`ok` or `FAIL`, with what it found and how long it took."""
import time


class Failed(Exception):
    """A step that did not pass; its message is the step's one line."""


def say(ok, step, text):
    print(f"{'ok  ' if ok else 'FAIL'} {step}: {text}", flush=True)


def step(name, function, *args):
    """Runs one step; prints its line. Returns its result, or None when it failed (an
    unexpected error too: its type and message are the line)."""
    start = time.monotonic()
    try:
        result = function(*args)
    except Failed as e:
        say(False, name, f"{e} [{time.monotonic() - start:.0f} s]")
        return None
    except Exception as e:  # noqa: BLE001 - a step's unexpected failure is its line
        say(False, name, f"{type(e).__name__}: {e} [{time.monotonic() - start:.0f} s]")
        return None
    say(True, name, f"{result} [{time.monotonic() - start:.0f} s]")
    return result
