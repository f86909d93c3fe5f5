"""Trains the book's ResNet-18 variant on Fashion-MNIST across devices.

    python -m tfmulti.main --num_gpus=2
    python -m tfmulti.main --flagfile=flags/quickstart.cfg   # offline, CPU, minutes

Prints the book's line `test acc: 0.93, 7.3 sec/epoch on [GPU:0, GPU:1]` and writes the
report to --model_dir. The tool is tfmulti/tools/main.py; the logic lives in the library.
"""
from tfmulti import cli


def run():
    """Console-script entry point (`tfmulti`): --help says what the tool does, as
    `python -m tfmulti.main --help` does (absl prints __main__'s docstring, the script's none)."""
    import sys

    sys.modules["__main__"].__doc__ = __doc__
    cli.main("main")


if __name__ == "__main__":
    run()
