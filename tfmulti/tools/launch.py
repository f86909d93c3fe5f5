"""Starts N workers of the main job (or its doctor, --program=doctor) on this machine and
streams their output; the flags after `--` are the main job's. The workers and their
supervision are processes/launcher.py."""
import sys

from tfmulti.processes import launcher
from tfmulti.run import flagdefs

PASSTHROUGH = True  # what follows `--` goes to every worker


def main(*main_args):
    FLAGS = flagdefs.FLAGS
    options = launcher.LaunchOptions(workers=FLAGS.workers, gpus_per_worker=FLAGS.gpus_per_worker,
                                     grace=FLAGS.grace, network=FLAGS.network,
                                     program=FLAGS.program,
                                     data_service_workers=FLAGS.data_service_workers)
    sys.exit(launcher.run(options, main_args))
