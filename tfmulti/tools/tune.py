"""Tuning sessions: the flags -> the session's RunConfig and TuneOptions -> the library in
tfmulti/tune/ (runner.py: the session; search.py: the hypermodel and tuners; session.py:
the table, plot and best.cfg; keras_tuner_fixes.py: keras-tuner's patches)."""
import sys

from tfmulti.run import config, flagdefs
from tfmulti.tune import runner


def options(flag_values=flagdefs.FLAGS):
    """The session's own flags as a TuneOptions."""
    return runner.TuneOptions(
        tuner=flag_values.tuner, max_trials=flag_values.max_trials,
        max_retries_per_trial=flag_values.max_retries_per_trial,
        parallel_trials=flag_values.parallel_trials,
        choices={flag: list(flag_values[flag].value or []) for flag in flagdefs.TUNE_CHOICES},
        lr_range=tuple(flag_values.tune_lr_range or ()),
        rate_searched=any(flag_values[f].present for f in ("tune_lr_range", "tune_lr_scalings")),
        objective=flag_values.objective,
        prune=flag_values.prune, decode_once=flag_values.decode_once,
        argv=tuple(sys.argv[1:]))


def main():
    # a session's default: a tenth held out, unless a share or a named split is given
    given = flagdefs.FLAGS["validation_split"].present or flagdefs.FLAGS["validation_set"].value
    runner.run(config.from_flags(flagdefs.FLAGS, **({} if given else {"validation_split": 0.1})),
               options())
