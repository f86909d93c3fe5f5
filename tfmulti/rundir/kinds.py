"""A folder holds one kind of run: a training run (tfmulti.main, tfmulti.scratch: run.json,
metrics.json, checkpoints/, model.keras) or a tuning session (tfmulti.tune: session.json,
trials/, trials.csv, best.cfg). The other tool refuses it in one line, --overwrite or not:
nothing one kind wrote is replaced by the other.

A session's folder holds one session: session.json says which (its settings, search space,
objective and data set); a session started again with other ones is refused, as a run is
(lifecycle.open_run), and --overwrite replaces it.
"""
from __future__ import annotations

from typing import Any

from tfmulti.distribution import storage
from tfmulti.errors import UsageError
from tfmulti.rundir import names

SESSION_FILE = "session.json"
SESSION_MARKS = (SESSION_FILE, "trials", "trials.csv", "best.cfg")
RUN_MARKS = ("run.json", *names.RUN_FILES)
KINDS = {"run": ("a training run", "python -m tfmulti.main"),
         "session": ("a tuning session", "python -m tfmulti.tune")}


def kind_of(folder: str) -> str | None:
    """"session", "run", or None: what tfmulti left in `folder` (a session's marks first:
    a session's folder also holds its plot)."""
    if not storage.isdir(folder):
        return None
    present = set(n.rstrip("/") for n in storage.listdir(folder))
    if present & set(SESSION_MARKS):
        return "session"
    if present & set(RUN_MARKS):
        return "run"
    return None


def refuse_other_kind(folder: str, mine: str) -> None:
    """UsageError when `folder` holds the other kind of run than `mine` ("run", "session")."""
    found = kind_of(folder)
    if found is None or found == mine:
        return
    what, tool = KINDS[found]
    raise UsageError(f"--model_dir={folder} holds {what} ({tool}'s), not "
                     f"{KINDS[mine][0]}; each kind has a folder of its own: choose another "
                     "--model_dir (--overwrite replaces only a run of the same kind)")


def open_session(folder: str, identity: dict[str, Any]) -> bool:
    """True when `folder` holds this session (the same identity: what makes the session what
    it is, flat, keyed as the refusal names it, "--model", "data set") to go on with, False
    when it holds none (session.json is written); UsageError for another session, or for
    trials of a session that says nothing of what it was."""
    path = storage.join(folder, SESSION_FILE)
    if not storage.exists(path):
        # The oracle's state, not trials/ alone: srun's worker tasks make trials/ and
        # workers/ as they start, before the chief opens the folder
        if storage.exists(storage.join(folder, "trials", "oracle.json")):
            raise UsageError(f"--model_dir={folder} holds trials but no {SESSION_FILE}: a "
                             "session whose settings are unknown cannot be continued; pass "
                             "--overwrite to start over or choose another --model_dir")
        storage.write_json(path, identity)
        return False
    try:
        was = storage.read_json(path)
    except (OSError, ValueError) as e:
        raise UsageError(f"{path} is unreadable ({e}); pass --overwrite to start over") from None
    if was == identity:
        return True
    differ = "; ".join(f"{key} {_text(was.get(key))} there, {_text(identity.get(key))} now"
                       for key in sorted(set(was) | set(identity))
                       if was.get(key) != identity.get(key))
    raise UsageError(f"--model_dir={folder} holds a different tuning session ({differ}); pass "
                     "--overwrite to replace it or choose another --model_dir")


def _text(value):
    return repr(value) if value is not None else "none"
