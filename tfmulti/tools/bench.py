"""The benchmarks' tool: flags read into a BenchOptions here, the work in
bench/commands.py (parallel and overlap: experiments.py; scaling: scaling.py; predict:
advise.py)."""
import dataclasses

from tfmulti.bench import commands
from tfmulti.errors import UsageError
from tfmulti.run import config, flagdefs

COMMANDS = commands.COMMANDS


def main(command):
    FLAGS = flagdefs.FLAGS
    names = [f.name for f in dataclasses.fields(commands.BenchOptions)
             if f.name not in ("flags", "command")]
    options = commands.BenchOptions(
        **{name: tuple(FLAGS[name].value) if isinstance(FLAGS[name].value, list) else
           FLAGS[name].value for name in names},
        flags=flagdefs.values("bench"), command=flagdefs.command_line())
    cfg = config.from_flags(FLAGS)
    if cfg.per_replica_batch_size == config.AUTO_BATCH:
        raise UsageError("--per_replica_batch_size=auto: the main job finds the batch at its "
                         "start (its line and run.json say which); give bench a number")
    return commands.run(command, cfg, options)
