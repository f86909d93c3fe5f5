"""Evaluates a finished run on its test set or on other data, with a confusion matrix.

    python -m tfmulti.evaluate --model_dir=runs/RUN
    python -m tfmulti.evaluate --model_dir=runs/RUN --dataset=folder:more_photos

The tool is tfmulti/tools/evaluate.py.
"""
from tfmulti import cli

if __name__ == "__main__":
    cli.main("evaluate")
