"""What every entry point shares: a quiet TensorFlow start-up, flags parsed with one-line
errors, and the common flags (devices, batch, data, model_dir) turned into plain values.

Only entry points import this module; it is where FLAGS are read on their behalf.
"""
import os
import sys

# TensorFlow's C++ info and warning lines; must be set before TensorFlow is imported.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, logging  # noqa: E402

from tfmulti import quiet  # noqa: E402

# Before flagdefs imports it: TensorFlow's start-up lines, held back (see quiet.py).
STARTUP = quiet.import_tensorflow()

import tensorflow as tf  # noqa: E402

from tfmulti import child, data, devices, engine, flagdefs, gpulibs, hparams, train  # noqa: E402
from tfmulti.errors import UserError  # noqa: E402

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: stopped on request, checkpoint saved, run again

FLAGS = flagdefs.FLAGS


def run(main, commands=None, passthrough=False):
    """app.run(main): --help lists tfmulti's flags; user errors end as one line and exit 1.

    With `commands`, the one positional argument must be one of them and main gets it;
    with passthrough, main gets whatever follows `--` (flags for another program).
    """
    for flag in FLAGS.get_key_flags_for_module(flagdefs):
        FLAGS.register_key_flag_for_module(sys.argv[0], flag)

    def main_or_exit(argv):
        child.die_with_parent_from_environment()
        try:
            args = argv[1:]
            if commands and (len(args) != 1 or args[0] not in commands):
                raise UserError(f"give one command: {', '.join(commands)} (got "
                                f"{' '.join(args) or 'none'})")
            if not commands and args and not passthrough:
                raise UserError(f"unexpected arguments: {' '.join(args)} (flags start with --)")
            if not FLAGS["verbosity"].present:
                logging.set_verbosity(logging.WARNING)  # tf.distribute's INFO lines
            main(*args)
        except UserError as e:
            exit_with(f"tfmulti: error: {e}")
        except FloatingPointError as e:  # a diverged run: say where, keep what was written
            exit_with(f"tfmulti: error: training diverged: {e}; try a lower --base_lr")
        except (tf.errors.UnavailableError, tf.errors.DeadlineExceededError) as e:
            if not os.environ.get("TF_CONFIG"):
                raise
            cause = next((line.strip() for line in str(e.message).splitlines()
                          if "aborted by" in line or "unreachable" in line.lower()), "")
            exit_with(f"tfmulti: error: lost contact with another worker ({cause or type(e).__name__}); "
                      "restart every worker with the same command to resume from the last "
                      "checkpoint")
        except engine.Preempted as e:
            print(f"tfmulti: stopped by SIGTERM at step {e.step}, checkpoint saved; run the same "
                  "command again to resume", file=sys.stderr)
            sys.exit(PREEMPTED_EXIT_CODE)

    app.run(main_or_exit, flags_parser=flagdefs.parse_or_exit)


def exit_with(line, code=1):
    """The one line a failure deserves, and nothing after it: TensorFlow's runtime logs its
    shutdown at exit in a failed multi-worker run (kept with TF_CPP_MIN_LOG_LEVEL=0 or 1)."""
    print(line, file=sys.stderr, flush=True)
    if os.environ.get("TF_CPP_MIN_LOG_LEVEL", "0") not in ("0", "1"):
        os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
    sys.exit(code)


def refuse(names, why):
    """Stops if any of these flags was given: they do nothing in this entry point."""
    given = [f"--{name}" for name in names if FLAGS[name].present]
    if given:
        raise UserError(f"{', '.join(given)}: not used here ({why})")


def check_sizes():
    for flag in ("synthetic_train_size", "synthetic_test_size", "epochs"):
        if FLAGS[flag].value < 1:
            raise UserError(f"--{flag}={FLAGS[flag].value}: must be at least 1")
    if FLAGS.checkpoint_steps < 0:
        raise UserError(f"--checkpoint_steps={FLAGS.checkpoint_steps}: must be 0 or more")
    if FLAGS.width < 0:
        raise UserError(f"--width={FLAGS.width}: must be positive (or 0 for the book's)")


def why_no_gpu():
    """TensorFlow's own lines on finding no GPU (cuInit's error, the libraries it could not
    dlopen), and what loading those libraries tells."""
    said = [line.split("] ", 1)[-1] for marker in ("cuInit", "dlopen", "Could not load dynamic")
            for line in STARTUP.lines(marker)]
    return "; ".join(said + [gpulibs.gpu_libraries_problem() or ""]).strip("; ")


def device_plan():
    """The devices the flags ask for, checked against the machine (runtime not started)."""
    available = devices.gpus_available()
    return devices.plan_devices(FLAGS.num_gpus, FLAGS.cpu_replicas, available,
                                why_none=why_no_gpu() if available == 0 else "", gpus=FLAGS.gpus,
                                memory_growth=FLAGS.gpu_memory_growth)


def batch_sizes(plan, default_global=None):
    """(per replica, global); with neither flag given, default_global or 256 per replica."""
    global_batch = FLAGS.global_batch_size
    if global_batch is None and FLAGS.per_replica_batch_size is None:
        global_batch = default_global
    return hparams.batch_sizes(plan.count, FLAGS.per_replica_batch_size, global_batch)


def model_dir(model, chief=True):
    """--model_dir, or a new runs/<time>-<model>-<dataset>, made ready to write (by the
    chief: the other workers of a multi-worker run only check they can write there)."""
    directory = FLAGS.model_dir or train.default_model_dir(model, FLAGS.dataset)
    train.prepare_model_dir(directory, FLAGS.overwrite, chief)
    return directory


def start_devices(plan):
    devices.configure(plan, FLAGS.intra_op_threads, FLAGS.inter_op_threads)
    if FLAGS.deterministic:
        import keras
        import tensorflow as tf

        keras.utils.set_random_seed(FLAGS.seed)
        tf.config.experimental.enable_op_determinism()


def load_data():
    return data.load(FLAGS.dataset, FLAGS.data_dir, FLAGS.synthetic_train_size,
                     FLAGS.synthetic_test_size, FLAGS.seed)


def run_info():
    """The flags and command, for metrics.json."""
    flags = {f.name: f.value for f in FLAGS.get_key_flags_for_module(flagdefs)}
    return {"flags": flags, "command": " ".join(sys.argv)}
