"""Your code, named on the command line as MODULE:FUNCTION (--model, --dataset).

MODULE is imported the way Python imports it, from the command's working directory and
PYTHONPATH. Whatever goes wrong in it (no module, an import that fails, no function, a
function that raises) is one line that names your function and, when it raised, the frames of
your own code that led there.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.machinery
import os
import re
import sys
import traceback
from typing import TYPE_CHECKING, Any

from tfmulti.errors import UsageError, first_line

SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")  # MODULE:FUNCTION

if TYPE_CHECKING:
    from collections.abc import Callable

MAX_FRAMES = 3  # of your code, shown when your function raises


def load_function(spec: str, flag: str) -> Callable[..., Any]:
    """The function `spec` ("MODULE:FUNCTION") names, imported; flag is how the user gave
    it ("--model"), for the messages."""
    module_name, function_name = spec.split(":")
    if "" not in sys.path and os.getcwd() not in sys.path:  # python -m puts it there too
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and (e.name == module_name or module_name.startswith(e.name + ".")):
            raise UsageError(f"{flag}={spec}: no module {module_name!r} in the working "
                             f"directory ({os.getcwd()}) or on PYTHONPATH") from None
        raise UsageError(f"{flag}={spec}: importing {module_name} failed: {e}") from None
    except Exception as e:  # noqa: BLE001 - the user's module: say what it raised, in one line
        raise UsageError(f"{flag}={spec}: importing {module_name} failed: "
                         f"{type(e).__name__}: {e}{_your_frames(e)}") from None
    function = getattr(module, function_name, None)
    if not callable(function):
        raise UsageError(f"{flag}={spec}: {module_name} has no function {function_name!r}")
    return function


def recorded_code_matches(spec: str, recorded: dict[str, Any] | None) -> bool:
    """Whether MODULE's file, found as an import would find it but NOT imported, has the
    sha256 a run.json recorded for it (`recorded`: its your_code entry). Code is imported
    from a run folder someone else wrote only when it is the code that run used."""

    if not recorded or not recorded.get("sha256"):
        return False
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    origin = _file_of(spec.split(":")[0])
    if origin is None:
        return False
    with open(origin, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16] == recorded["sha256"]


def _file_of(module_name: str) -> str | None:
    """The file `import module_name` would run, found on sys.path part by part without
    running anything: importlib.util.find_spec("pkg.mod") imports pkg (its __init__ runs).
    None when it is not a plain file on the path."""
    found, path = None, None
    for part in module_name.split("."):
        try:
            found = importlib.machinery.PathFinder.find_spec(part, path)
        except (ImportError, ValueError):
            return None
        if found is None:
            return None
        path = found.submodule_search_locations
    if not found.origin or not os.path.isfile(found.origin):
        return None
    return found.origin


def provenance(spec: str) -> dict[str, str | None]:
    """{"module", "function", "file", "sha256"} of MODULE:FUNCTION, imported: what run.json
    records of your code, so a resume can tell when the file changed."""
    module_name, function_name = spec.split(":")
    path = getattr(sys.modules.get(module_name), "__file__", None)
    digest = None
    if path and os.path.isfile(path):
        with open(path, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()[:16]
    return {"module": module_name, "function": function_name,
            "file": os.path.basename(path) if path else None, "sha256": digest}


def call(spec: str, flag: str, function: Callable[..., Any], *args: Any,
         **kwargs: Any) -> Any:
    """function(*args, **kwargs); what it raises becomes one UsageError line."""
    try:
        return function(*args, **kwargs)
    except UsageError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's function: say what it raised
        message = first_line(e, 300)
        raise UsageError(f"{flag}={spec} raised {type(e).__name__}"
                         f"{': ' + message if message else ''}{_your_frames(e)}") from None


def _your_frames(error):
    """' (at file.py:12 in f <- file.py:30 in g)': the innermost frames outside tfmulti,
    TensorFlow and Keras, innermost first."""
    library = (os.path.dirname(os.path.dirname(__file__)),) + tuple(
        p for p in sys.path if p.endswith(("site-packages", "dist-packages")))
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if not f.filename.startswith(library) and not f.filename.startswith("<frozen")]
    shown = [f"{os.path.basename(f.filename)}:{f.lineno} in {f.name}"
             for f in reversed(frames[-MAX_FRAMES:])]
    return f" (at {' <- '.join(shown)})" if shown else ""
