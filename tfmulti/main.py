"""Trains the book's ResNet-18 variant on Fashion-MNIST across devices.

    python -m tfmulti.main --num_gpus=2
    python -m tfmulti.main --flagfile=flags/quickstart.cfg   # offline, CPU, minutes

Prints the book's line `test acc: 0.93, 7.3 sec/epoch on [GPU:0, GPU:1]` and writes the
report to --model_dir. All logic lives in the library (train.py); this file reads the flags.
"""
import os
import sys

# TensorFlow's C++ info and warning lines; must be set before TensorFlow is imported.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags, logging  # noqa: E402

from tfmulti import quiet  # noqa: E402

# Before flagdefs imports it: TensorFlow's start-up lines, held back (see quiet.py).
_STARTUP = quiet.import_tensorflow()
from tfmulti import flagdefs  # noqa: E402
from tfmulti.errors import UserError

FLAGS = flagdefs.FLAGS
flags.adopt_module_key_flags(flagdefs)  # --help lists them, not just --helpfull


def main(argv):
    if len(argv) > 1:
        raise UserError(f"unexpected arguments: {' '.join(argv[1:])} (flags start with --)")
    if not FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # tf.distribute's INFO lines bury the output
    from tfmulti import data, devices, hparams, train

    model_dir = FLAGS.model_dir or train.default_model_dir(FLAGS.model, FLAGS.dataset)
    plan = devices.plan_devices(FLAGS.num_gpus, FLAGS.cpu_replicas, devices.gpus_available(),
                                why_none="; ".join(line.split("] ", 1)[-1]
                                                   for line in _STARTUP.lines("cuInit")))
    per_replica, _ = hparams.batch_sizes(plan.count, FLAGS.per_replica_batch_size,
                                         FLAGS.global_batch_size)
    for flag in ("synthetic_train_size", "synthetic_test_size", "width", "epochs"):
        if FLAGS[flag].value < (0 if flag == "width" else 1):
            raise UserError(f"--{flag}={FLAGS[flag].value}: must be positive")
    train.prepare_model_dir(model_dir, FLAGS.overwrite)
    devices.configure(plan, FLAGS.intra_op_threads, FLAGS.inter_op_threads)
    strategy = devices.make_strategy(plan)
    dataset = data.load(FLAGS.dataset, FLAGS.data_dir, FLAGS.synthetic_train_size,
                        FLAGS.synthetic_test_size, FLAGS.seed)
    line, _ = train.train_and_evaluate(
        strategy, dataset, model=FLAGS.model, width=FLAGS.width, dtype=FLAGS.dtype,
        sync_batchnorm=FLAGS.sync_batchnorm, per_replica_batch_size=per_replica,
        base_lr=FLAGS.base_lr, lr_scaling=FLAGS.lr_scaling, warmup_epochs=FLAGS.warmup_epochs,
        epochs=FLAGS.epochs, seed=FLAGS.seed, steps_per_call=FLAGS.steps_per_call,
        model_dir=model_dir, show_replicas=FLAGS.show_replicas,
        run_info={"flags": flags_used(), "command": " ".join(sys.argv)})
    print(line)
    print(f"report: {model_dir}/ (metrics.json, accuracy.png, tensorboard/, model.keras)")


def flags_used():
    """This module's flags and their values, for metrics.json."""
    return {f.name: f.value for f in FLAGS.get_key_flags_for_module(flagdefs)}


def _main_or_exit(argv):
    try:
        main(argv)
    except UserError as e:
        sys.exit(f"tfmulti: error: {e}")
    except FloatingPointError as e:  # a diverged run: say where, keep what was written
        sys.exit(f"tfmulti: error: training diverged: {e}; try a lower --base_lr")


def run():
    """Console-script entry point (`tfmulti`)."""
    app.run(_main_or_exit, flags_parser=flagdefs.parse_or_exit)


if __name__ == "__main__":
    run()
