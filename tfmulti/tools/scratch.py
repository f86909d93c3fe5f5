"""Data parallelism from scratch: the book's LeNet on every device, no tf.distribute.

Reads the flags (the book's global batch 256 and rate 0.2 unless given), then calls
scratch/lesson.py's train.
"""
import dataclasses

from tfmulti.data import sources
from tfmulti.distribution import startup
from tfmulti.errors import UsageError
from tfmulti.run import config, flagdefs
from tfmulti.run.plan import run_plan
from tfmulti.rundir import lifecycle, names
from tfmulti.scratch import lesson

BOOK_GLOBAL_BATCH = 256  # the book's scratch run, kept whatever the device count (its rate:
# flagdefs.TOOL_DEFAULTS)


def main():
    FLAGS = flagdefs.FLAGS
    cfg = config.from_flags(FLAGS, model="lenet")  # the book's float32 LeNet, a fixed rate
    if cfg.per_replica_batch_size is None and cfg.global_batch_size is None:
        cfg = dataclasses.replace(cfg, global_batch_size=BOOK_GLOBAL_BATCH)
    if cfg.dataset not in config.DATASETS:
        raise UsageError(f"--dataset={cfg.dataset}: tfmulti.scratch trains the book's "
                         "hand-written LeNet on 28x28 grayscale images of 10 classes: "
                         "fashion_mnist or synthetic (tfmulti.main trains on your own data)")
    start = startup.from_config(cfg, one_run=False)
    plan = start.plan
    resolved = run_plan(cfg, plan.count)
    dataset = sources.load_for(cfg)
    directory = cfg.model_dir or lifecycle.default_model_dir("scratch-lenet", cfg.dataset)
    # locked while it trains; a scratch run's folder is marked by its metrics.json
    with lifecycle.in_use(directory, cfg.overwrite, marks=(names.METRICS_FILE,)) as model_dir:
        start.start_devices()
        line, _, _ = lesson.train(
            dataset, plan.devices, resolved.global_batch_size, resolved.learning_rate,
            cfg.epochs, allreduce=FLAGS.allreduce, width=cfg.width, seed=cfg.seed,
            model_dir=model_dir, run_info={"flags": flagdefs.values("scratch"),
                                           "command": flagdefs.command_line()})
    print(line)
    print(f"report: {model_dir}/ (metrics.json, accuracy.png, tensorboard/)")
