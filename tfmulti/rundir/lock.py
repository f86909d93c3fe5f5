"""A run's or a tuning session's folder in use is locked: a second process is refused.

Two `tfmulti.main` with the same flags started at once would both "resume" one run and write
the same checkpoints and metrics.json. The process that trains (the chief) holds an
exclusive lock on the file LOCK_FILE in the folder (flock: the kernel releases it when the
process ends, kill -9 included, so a dead holder's lock is simply taken by the next run), and
writes into it who holds it (host, pid, since when), which the refusal quotes.

flock works on local file systems and on NFS (as a POSIX lock); a folder at a URL (gs://)
cannot be locked this way, and a file system that refuses locks is said in one line.
"""
import contextlib
import datetime
import json
import os
import socket

from tfmulti.distribution import storage
from tfmulti.errors import UsageError

LOCK_FILE = ".tfmulti-lock"


def holder_text(path):
    """'process 123 on host since 2026-11-25 17:30:00', from the lock file ('' if none)."""
    try:
        with open(path) as f:
            who = json.load(f)
        return f"process {who['pid']} on {who['host']} since {who['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return ""


@contextlib.contextmanager
def locked(folder, flag="--model_dir", say=print):
    """Holds the folder's lock while the block runs; UsageError in one line when another
    process holds it."""
    if "://" in folder:
        say(f"{flag}={folder} is at a URL: it cannot be locked, so make sure no other process "
            "runs in it")
        yield
        return
    path = os.path.join(folder, LOCK_FILE)
    try:
        fd = storage.own_file(path)  # never through a link planted under its name
    except OSError as e:
        raise UsageError(f"{flag}={folder} cannot be locked: its {LOCK_FILE} "
                         f"({e.strerror or e}) is not tfmulti's; remove it if you know what it "
                         "is") from None
    try:
        try:
            taken = storage.try_lock(fd)
        except OSError as e:  # a file system without locks
            say(f"{flag}={folder} cannot be locked ({e.strerror or e}): make sure no other "
                "process runs in it")
        else:
            if not taken:
                who = holder_text(path) or "another process"
                raise UsageError(f"{flag}={folder} is in use by {who}; wait for it to end, "
                                 "or stop it (its lock is released when it ends)")
            os.ftruncate(fd, 0)
            os.write(fd, json.dumps({
                "host": socket.gethostname(), "pid": os.getpid(),
                "since": datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")}).encode())
        yield
    finally:
        os.close(fd)  # releases the lock; the file stays (removing it would race a taker)
