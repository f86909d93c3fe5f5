"""Files under --model_dir, through TensorFlow's file systems (tf.io.gfile).

A model_dir may be a local folder, NFS, or an object store TensorFlow knows (gs://, s3:// with
tensorflow-io, ram:// in tests): the checkpoints go there through TensorFlow, so every other
file of a run goes the same way, never through Python's open() and os, which would write a
local folder named "gs:". Several processes (workers, tuning workers) may use one model_dir at
once: each one's temporary and probe files carry its own name, and files are written whole
then renamed, so a reader never sees half of one. A local file is made without following a
link (replacing, new_file, own_file at the end: every file tfmulti makes goes through them).
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import posixpath
import shutil
import socket
import stat
import tempfile
import uuid
from collections.abc import Iterator
from typing import IO, Any

from tfmulti import waits


def _gfile():
    import tensorflow as tf

    return tf.io.gfile


def join(directory: str, *names: str) -> str:
    """Like os.path.join, also for URLs (gs://bucket/run)."""
    return posixpath.join(directory, *names) if "://" in directory else os.path.join(
        directory, *names)


def own_name(prefix: str) -> str:
    """A file name no other process, here or on another host, will pick."""
    return f"{prefix}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def exists(path: str) -> bool:
    return _gfile().exists(path)


def isdir(path: str) -> bool:
    return _gfile().isdir(path)


def makedirs(path: str) -> None:
    _gfile().makedirs(path)


def listdir(path: str) -> list[str]:
    return _gfile().listdir(path) if isdir(path) else []


def remove(path: str) -> None:
    """Deletes a file or a whole folder; nothing there is fine. A local symbolic link is
    removed itself, never followed, and a local folder's links likewise (shutil.rmtree;
    TensorFlow's local rmtree would descend into a linked folder)."""
    if "://" not in path and (os.path.islink(path) or os.path.isdir(path)):
        try:
            if os.path.islink(path):
                os.unlink(path)
            else:
                shutil.rmtree(path)
        except FileNotFoundError:  # another process removed it first
            pass
        return
    gfile = _gfile()
    try:
        if gfile.isdir(path):
            gfile.rmtree(path)
        elif gfile.exists(path):
            gfile.remove(path)
    except Exception as e:  # another process removed it first (NotFoundError)
        if exists(path):
            raise OSError(f"cannot remove {path}: {e}") from e


def write_bytes(path: str, payload: bytes) -> None:
    """Written whole to a file of this process's own, then renamed over `path` (on a local
    disk: replacing, which follows no link)."""
    if "://" not in path:
        with replacing(path) as f:
            f.write(payload)
        return
    gfile = _gfile()
    tmp = f"{path}.{own_name('tmp')}"
    with gfile.GFile(tmp, "wb") as f:
        f.write(payload)
    gfile.rename(tmp, path, overwrite=True)


def write_json(path: str, payload: object) -> None:
    write_bytes(path, json.dumps(payload, indent=2).encode("utf-8"))


def read_json(path: str) -> Any:
    """The object in a JSON file. Raises OSError (missing, unreadable) or ValueError."""
    import tensorflow as tf

    try:
        with _gfile().GFile(path, "rb") as f:
            text = read_all(f)
    except tf.errors.OpError as e:
        raise OSError(e.message) from None
    return json.loads(text.decode("utf-8"))


def read_all(f, chunk=1 << 20):
    """Everything in the open file f, to its end. GFile.read() with no size reads as many
    bytes as the *path* has when it asks (a stat), not the file it opened: when another
    process has just renamed a new version over the path, that cut files short (seen in the
    test of two writers and a reader)."""
    parts = []
    while True:
        part = f.read(chunk)
        if not part:
            return b"".join(parts)
        parts.append(part)


def check_writable(directory: str) -> None:
    """Makes `directory` and writes and deletes a probe file in it; raises OSError if it
    cannot. The probe's name is this process's own: other workers probe at the same moment."""
    import tensorflow as tf

    if exists(directory) and not isdir(directory):
        raise NotADirectoryError(f"{directory} is a file, not a directory")
    probe = join(directory, own_name(".tfmulti-write-test"))  # tfmulti's own: see lifecycle
    try:
        makedirs(directory)
        try:
            with _gfile().GFile(probe, "w") as f:
                f.write("")
        finally:  # a Ctrl-C between the two leaves no probe behind
            if _gfile().exists(probe):
                _gfile().remove(probe)
    except tf.errors.OpError as e:
        raise OSError(e.message.strip().splitlines()[0]) from None


# ----------------------------------------------------------------------------- local files
# Every file tfmulti creates on a local disk is created without following a link and, where
# it replaces one, whole: a folder or cache another user could write into (a shared run
# folder, a common XDG_CACHE_HOME) may hold a link planted under the name tfmulti is about
# to write, pointing at a file of the user's. These are the only ways tfmulti makes one.

def _umask() -> int:
    """This process's umask, read without changing it (os.umask would, for every thread)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


def temporary_name(path: str) -> str:
    """`path`.tmp-HOST-PID: a file on its way to `path` whose writer other processes (on
    other machines too, in a cache they share) can tell, and whether it is gone."""
    return f"{path}.tmp-{socket.gethostname()}-{os.getpid()}"


@contextlib.contextmanager
def replacing(path: str, mode: str = "wb", permissions: int = 0o666,
              named: bool = False) -> Iterator[IO]:
    """A new file beside `path`, open for writing in `mode`, renamed over `path` when the
    block ends without an error, removed when it does not: `path` is whole or as it was.
    The new file's name is mkstemp's, or with `named` temporary_name(path) (for a cache
    whose readers remove what a dead writer left); made with O_EXCL either way: nothing
    planted under it is followed. Its mode open()'s (permissions, 0666, less the umask); a
    link at `path` is replaced, never written through."""
    if named:
        temporary = temporary_name(path)
        opened = new_file(temporary, mode, permissions)
    else:
        directory, name = os.path.split(os.path.abspath(path))
        fd, temporary = tempfile.mkstemp(dir=directory, prefix=f".{name}.", suffix=".tmp")
    try:
        if not named:
            os.fchmod(fd, permissions & ~_umask())
            opened = os.fdopen(fd, mode)
        with opened as f:
            yield f
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def new_file(path: str, mode: str = "wb", permissions: int = 0o666) -> IO:
    """`path` made anew and opened for writing (FileExistsError when anything, a link
    included, is there): for temporary files whose names other processes must read (a
    host and pid in them). Its mode: permissions less the umask."""
    return open(path, mode.replace("w", "x"),  # O_EXCL: a link there is an error, not followed
                opener=lambda name, flags: os.open(name, flags | os.O_NOFOLLOW, permissions))


def try_lock(fd: int | IO, wait_s: float = 0.0) -> bool:
    """Takes the exclusive flock of an open file, trying for at most wait_s seconds (0:
    once); False when another process still holds it. OSError where the file system has
    no locks. Released when the file is closed."""
    def taken():
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False

    return waits.until(taken, wait_s)


def own_file(path: str, flags: int = os.O_RDWR) -> int:
    """A file descriptor of `path`, made if missing (0644 less the umask), for a file
    several runs share by name (a folder's lock, a worker's log): never through a link, and
    only a regular file with one name (OSError, with what it is, otherwise)."""
    fd = os.open(path, flags | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
        os.close(fd)
        raise OSError(f"{path} is not a file of its own (a regular file with "
                      f"{info.st_nlink} names); remove it")
    return fd
