"""What the process tests share: whether a pid still runs, and a bounded wait for pids to end."""
import time


def alive(pid):
    """Whether process `pid` still runs (a zombie has ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def gone_within(pids, timeout):
    """Waits at most `timeout` s for every pid to end; whether they all did."""
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.02)
    return not any(alive(p) for p in pids)
