"""Trains the book's ResNet-18 variant on Fashion-MNIST across devices.

    python -m tfmulti.main --num_gpus=2
    python -m tfmulti.main --flagfile=flags/quickstart.cfg   # offline, CPU, minutes

Prints the book's line `test acc: 0.93, 7.3 sec/epoch on [GPU:0, GPU:1]` and writes the
report to --model_dir. The tool is tfmulti/tools/main.py; the logic lives in the library.
"""
import importlib
import importlib.util
import sys

from tfmulti import cli

TOOLS = ("main", "tune", "scratch", "bench", "doctor", "launch", "evaluate", "dataservice")


def run():
    """Console-script entry point: `tfmulti TOOL FLAGS` runs `python -m tfmulti.TOOL FLAGS`
    (`tfmulti FLAGS`, no tool named: the main job). --help says what the tool does, as the
    module's does (absl prints __main__'s docstring, the script's none)."""
    tool = "main"
    if len(sys.argv) > 1 and not sys.argv[1].startswith("-"):
        if sys.argv[1] not in TOOLS:
            sys.exit(f"tfmulti: error: no tool {sys.argv[1]!r}: tfmulti TOOL [flags], TOOL one "
                     f"of {', '.join(TOOLS)} (no TOOL: main)")
        tool = sys.argv.pop(1)
    sys.modules["__main__"].__doc__ = tool_doc(tool)
    cli.main(tool)


def tool_doc(tool: str) -> str:
    """What `python -m tfmulti.TOOL --help` says first: its entry point's docstring, a module
    (main.py) or a package's __main__.py (tune/, ...), imported without running it."""
    entry = f"tfmulti.{tool}"
    if importlib.util.find_spec(entry).submodule_search_locations is not None:
        entry += ".__main__"  # (its `if __name__ == "__main__"` does not run on import)
    return importlib.import_module(entry).__doc__


if __name__ == "__main__":
    run()
