"""The doctor's report: one line per finding, `PROBLEM` lines counted for the exit code.
"""
from __future__ import annotations

import sys


class Report:
    def __init__(self, out=sys.stdout):
        self.problems, self.out = [], out

    def info(self, label, text):
        print(f"{label:>11}: {text}", file=self.out, flush=True)

    def warn(self, text):
        """Something that runs, but not as the user expects: no effect on the exit code."""
        print(f"{'WARNING':>11}: {text}", file=self.out, flush=True)

    def problem(self, text):
        self.problems.append(text)
        print(f"{'PROBLEM':>11}: {text}", file=self.out, flush=True)


def finish(report: Report) -> None:
    if report.problems:
        print(f"tfmulti doctor: {len(report.problems)} problem"
              f"{'s' if len(report.problems) > 1 else ''}:", file=sys.stderr)
        for problem in report.problems:
            print(f"  problem: {problem}", file=sys.stderr)
        sys.exit(1)
    print("tfmulti doctor: no problems; these flags would run")
