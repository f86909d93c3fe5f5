"""Starts N workers of the main job (or its doctor, --program=doctor) on this machine and
streams their output; the flags after `--` are the main job's. The workers and their supervision are
distribution/launcher.py."""
import sys

from tfmulti.distribution import devices, launcher
from tfmulti.errors import UsageError
from tfmulti.run import flagdefs

PASSTHROUGH = True  # what follows `--` goes to every worker


def main(*main_args):
    FLAGS = flagdefs.FLAGS
    workers = FLAGS.workers
    if workers < 1:
        raise UsageError(f"--workers={workers}: start at least one")
    if any(a.startswith(("--worker_hosts", "--task_index")) for a in main_args):
        raise UsageError("the launcher sets --worker_hosts and --task_index itself")
    if FLAGS.grace < 0:
        raise UsageError(f"--grace={FLAGS.grace:g}: give seconds, 0 or more")
    shares = launcher.worker_shares(workers, FLAGS.gpus_per_worker, devices.gpus_available(),
                                    devices.visible_gpus(), main_args)
    # The ports are chosen where the workers will listen: in their own network, if they have one
    line, ports, holder = launcher.worker_network(FLAGS.network, main_args, workers)
    launcher.say(line)
    commands = launcher.worker_commands(workers, list(main_args), ports,
                                        program=FLAGS.program)
    for i, (flags, env) in enumerate(shares):
        commands[i] += flags
        if env.get("CUDA_VISIBLE_DEVICES"):
            launcher.say(f"worker {i}: GPU {env['CUDA_VISIBLE_DEVICES']}")
    joining = holder.env if holder is not None else {}
    try:
        code = launcher.launch(commands, FLAGS.grace,
                               envs=[{**env, **joining} for _, env in shares])
    finally:
        if holder is not None:
            holder.close()
    sys.exit(code)
