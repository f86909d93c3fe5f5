"""Errors a user can cause. Entry points turn them into one line on stderr and exit 1."""
from __future__ import annotations

import re

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: stopped on request, checkpoint saved, run again
INTERRUPTED_EXIT_CODE = 130  # the shell's for SIGINT: stopped at once by Ctrl-C, nothing saved


class UserError(Exception):
    """Bad flags, files or environment: the message is the whole story, no traceback."""


class UsageError(UserError):
    """Flags that cannot work together or with this machine."""


class DataError(UserError):
    """A data set that cannot be read: missing, truncated or corrupt files, no download."""


def first_line(error: BaseException, limit: int = 200) -> str:
    """The first line of an exception's message, at most `limit` characters ('' if it has
    none); a TensorFlow error's own message, without the op's tags str() adds and the graph
    tags it may carry ({{function_node ...}}, [Op:...] name:)."""
    text = (getattr(error, "message", None) or str(error)).strip()
    lines = text.splitlines()
    if lines and lines[0].strip() == "in user code:":  # a traced function's: after its frames,
        # the error's "Type: message" (Keras's wrapper of a layer's error among them)
        said = [re.match(r"^    \w+: (.*)$", line) for line in lines]
        lines = next(([m.group(1), *(line.strip() for line in lines[i + 1:])]
                      for i, m in enumerate(said) if m), [ln for ln in lines if ln.strip()][-1:])
    if lines and lines[0].startswith("Exception encountered when calling"):
        # Keras's wrapper of a layer's error: the cause is the next line, in bold
        lines = [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in lines[1:]
                 if line.strip()][:1] or lines
    line = _without_tags(lines[0].strip()) if lines else ""
    return line[:limit]


def _without_tags(line):
    line = re.sub(r"\[*\{\{[^}]*\}\}\]*", "", line)
    return re.sub(r"\s*\[Op:[^\]]*\](\s*name:\s*\S*)?\s*$", "", line).strip()


def lost_contact_cause(message, limit=200):
    """The line of TensorFlow's error that says why a worker was lost, without the graph tags
    TensorFlow puts around it ({{function_node ...}}, [[{{node ...}}]]), at most `limit`
    characters; '' if none says. A worker that stopped sending heartbeats (killed, or its
    machine gone) is named as such: worker N (TensorFlow's /job:worker/task:N)."""
    silent = re.search(r"/job:(\w+)/task:(\d+): The following tasks are unhealthy \(stopped "
                       r"sending heartbeats\)", message)
    if silent:
        listed = re.findall(r"^/job:(\w+)/replica:\d+/task:(\d+)$", message, re.M)
        job, task = listed[0] if listed else silent.groups()
        return f"{job} {task} stopped sending heartbeats: killed, or its machine is gone"
    for line in message.splitlines():
        if "aborted by" in line or "unreachable" in line.lower():
            line = _without_tags(line)
            return line if len(line) <= limit else line[:limit - 3] + "..."
    return ""


# What TensorFlow's image decoders say of bytes that are not an image they can read.
_UNDECODABLE = re.compile(r"Unknown image file format|Invalid (PNG|JPEG|GIF|BMP)|"
                          r"(PNG|JPEG|GIF|BMP) data|Input is empty")


def undecodable_image(message):
    """The line of a TensorFlow error that says an image file did not decode (the input
    pipeline reading a folder's files), without its tags; '' if none says so."""
    for line in message.splitlines():
        if _UNDECODABLE.search(line):
            return _without_tags(line.split(" with iterator: ")[-1].split(": ", 1)[-1]
                                 if " with iterator: " in line else line)
    return ""


def out_of_memory_line(message: str) -> str:
    """"OOM when allocating tensor with shape[...] and type ... on DEVICE by allocator ..." from
    a TensorFlow out-of-memory error (a graph's error puts it past its first line); else its
    first line."""
    found = re.search(r"OOM when allocating tensor with shape\[[^\]]*\] and type \w+ on \S+"
                      r"(?: by allocator \S+)?", message)
    return found.group(0) if found else _without_tags(message.strip().splitlines()[0])

