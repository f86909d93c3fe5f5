"""What every entry point shares: a quiet TensorFlow start-up, flags parsed with one-line
errors (each tool its own flags), the run configuration built from them, and the devices,
data and model_dir that configuration asks for.

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

from tfmulti.distribution import child, devices, gpulibs  # noqa: E402
from tfmulti.run import config, flagdefs
from tfmulti.training import data, engine, rundir
from tfmulti import errors  # noqa: E402
from tfmulti.errors import UserError  # noqa: E402

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: stopped on request, checkpoint saved, run again

FLAGS = flagdefs.FLAGS


def main(tool, argv=None):
    """`python -m tfmulti.<tool>`: TensorFlow's start-up lines held back, then the tool
    (tfmulti/tools/<tool>.py, which imports what it uses) run with its flags from argv (the
    command line when None)."""
    import importlib

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before TensorFlow loads
    quiet.import_tensorflow()
    module = importlib.import_module(f"tfmulti.tools.{tool}")
    for name, value in getattr(module, "FLAG_DEFAULTS", {}).items():
        FLAGS.set_default(name, value)
    run(module.main, tool, getattr(module, "COMMANDS", None),
        getattr(module, "PASSTHROUGH", False), argv)


def run(main, tool, commands=None, passthrough=False, argv=None):
    """app.run(main) for the entry point `tool`: --help lists its flags, a flag of another
    tool is refused, user errors end as one line and exit 1.

    With `commands`, the one positional argument must be one of them and main gets it;
    with passthrough, main gets whatever follows `--` (flags for another program).
    """
    for name in flagdefs.tool_flags(tool):
        FLAGS.register_key_flag_for_module((argv or sys.argv)[0], FLAGS[name])

    def main_or_exit(argv):
        child.die_with_parent_from_environment()
        try:
            foreign = flagdefs.check_tool(tool)
            if foreign:
                raise UserError(foreign)
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
            cause = errors.lost_contact_cause(str(e.message))
            exit_with(f"tfmulti: error: lost contact with another worker ({cause or type(e).__name__}); "
                      "restart every worker with the same command to resume from the last "
                      "checkpoint")
        except engine.Preempted as e:
            print(f"tfmulti: stopped by SIGTERM at step {e.step}, checkpoint saved; run the same "
                  "command again to resume", file=sys.stderr)
            sys.exit(PREEMPTED_EXIT_CODE)

    app.run(main_or_exit, argv=argv, flags_parser=flagdefs.parse_or_exit)


def exit_with(line, code=1):
    """The one line a failure deserves, and nothing after it: TensorFlow's runtime logs its
    shutdown at exit in a failed multi-worker run (kept with TF_CPP_MIN_LOG_LEVEL=0 or 1)."""
    print(line, file=sys.stderr, flush=True)
    if os.environ.get("TF_CONFIG") and os.environ.get("TF_CPP_MIN_LOG_LEVEL", "0") not in (
            "0", "1"):
        os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
    sys.exit(code)


def run_config(**overrides):
    """The run's settings from the flags, checked (one line on the first bad value)."""
    return config.from_flags(FLAGS, **overrides)


def why_no_gpu():
    """TensorFlow's own lines on finding no GPU (cuInit's error, the libraries it could not
    dlopen), and what loading those libraries tells."""
    said = [line.split("] ", 1)[-1] for marker in ("cuInit", "dlopen", "Could not load dynamic")
            for line in STARTUP.lines(marker)]
    return "; ".join(said + [gpulibs.gpu_libraries_problem() or ""]).strip("; ")


def device_plan(cfg):
    """The devices cfg asks for, checked against the machine (runtime not started)."""
    available = devices.gpus_available()
    return devices.plan_devices(cfg.num_gpus, cfg.cpu_replicas, available,
                                why_none=why_no_gpu() if available == 0 else "",
                                gpus=list(cfg.gpus) if cfg.gpus else None,
                                memory_growth=cfg.gpu_memory_growth)


def model_dir(cfg, name, chief=True):
    """--model_dir, or a new runs/<time>-<name>-<dataset>, made ready to write (by the
    chief: the other workers of a multi-worker run only check they can write there)."""
    directory = cfg.model_dir or rundir.default_model_dir(name, cfg.dataset)
    rundir.prepare_model_dir(directory, cfg.overwrite, chief)
    return directory


def start_devices(plan, cfg):
    devices.configure(plan, cfg.intra_op_threads, cfg.inter_op_threads)
    if cfg.deterministic:
        import keras
        import tensorflow as tf

        keras.utils.set_random_seed(cfg.seed)
        tf.config.experimental.enable_op_determinism()


def load_data(cfg):
    return data.load(cfg.dataset, cfg.data_dir, cfg.synthetic_train_size,
                     cfg.synthetic_test_size, cfg.seed)


def flag_values(tool):
    """The values of the flags `tool` accepts, for reports."""
    return {name: FLAGS[name].value for name in flagdefs.tool_flags(tool)}


def command():
    return " ".join(sys.argv)
