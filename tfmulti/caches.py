"""Where tfmulti keeps what it computed once from your files and can compute again: under
~/.cache/tfmulti ($XDG_CACHE_HOME/tfmulti when that is set), a folder per kind (decoded
examples, record indexes) and XLA's verdicts. Nothing here is yours: deleting the folder
costs only the time to compute it again.

The cache is this user's own: its folders 0700, its files 0600 (FILE_MODE), and nothing is
read from it or kept in it unless each folder is a directory of this user's that nobody
else can write (own_folder) and the file read is a regular file of this user's that nobody
else can write (trusted_file): with a cache folder others share (a common XDG_CACHE_HOME),
what they planted there is never read, and the run computes it again."""
import os
import stat

FILE_MODE = 0o600  # of every file kept in the cache


def home() -> str:
    """~/.cache/tfmulti, or $XDG_CACHE_HOME/tfmulti."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tfmulti")


def folder(kind: str) -> str:
    """The folder of one kind of cached file (not made here)."""
    return os.path.join(home(), kind)


def own_folder(path: str) -> bool:
    """Whether `path` (home() or a folder in it) may be read and written: made 0700 where
    missing (home() first), each a real directory (not a link) of this user's that nobody
    else can write. A folder of this user's that others may write (an earlier tfmulti's,
    made with the umask's mode) is narrowed to 0700 first."""
    root = home()
    try:
        os.makedirs(os.path.dirname(root), exist_ok=True)  # ~/.cache, $XDG_CACHE_HOME
    except OSError:
        return False
    for each in ([root] if path == root else [root, path]):
        try:
            os.mkdir(each, 0o700)
        except FileExistsError:
            pass
        except OSError:
            return False
        try:
            info = os.lstat(each)
            if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
                return False
            if info.st_mode & 0o077:
                os.chmod(each, 0o700, follow_symlinks=False)
        except OSError:
            return False
    return True


def trusted_file(path: str) -> bool:
    """Whether the cached file at `path` may be read: a regular file (not a link) of this
    user's that nobody else can write."""
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return (stat.S_ISREG(info.st_mode) and info.st_uid == os.getuid()
            and not info.st_mode & 0o022)


KINDS = {"decoded": "decoded examples", "index": "record indexes"}


def usage(root: str | None = None) -> dict[str, tuple[int, int]]:
    """{what: (files, bytes)} of the cache at root (home()): a folder per kind, and the
    files beside them (XLA's verdicts and their lock)."""
    root = root or home()
    found: dict[str, tuple[int, int]] = {}
    try:
        entries = list(os.scandir(root))
    except OSError:  # none yet
        return found
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):
            files = list(_walk(entry.path))
            what = KINDS.get(entry.name, entry.name)
        else:
            files = [entry.path]
            what = "XLA verdicts" if entry.name.startswith("xla.json") else "other"
        count, size = found.get(what, (0, 0))
        found[what] = (count + len(files), size + sum(_size(f) for f in files))
    return found


def _walk(folder):
    for base, _, names in os.walk(folder):
        yield from (os.path.join(base, name) for name in names)


def _size(path):
    try:
        return os.stat(path).st_size
    except OSError:  # removed meanwhile
        return 0


def describe(root: str | None = None) -> str:
    """One line for the doctor: where the cache is and what it holds."""
    root = root or home()
    held = usage(root)
    if not held:
        return f"{root}: empty"
    parts = ", ".join(f"{what}: {count} file{'s' if count != 1 else ''}, {_megabytes(size)}"
                      for what, (count, size) in sorted(held.items()))
    return f"{root}: {parts} (made again from your files when deleted)"


def _megabytes(size):
    return f"{size / 2**30:.1f} GB" if size >= 2**30 else f"{size / 2**20:.1f} MB"
