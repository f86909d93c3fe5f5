"""Trains the book's ResNet-18 variant on Fashion-MNIST across devices.

    python -m tfmulti.main --num_gpus=2
    python -m tfmulti.main --flagfile=flags/quickstart.cfg   # offline, CPU, minutes

Prints the book's line `test acc: 0.93, 7.3 sec/epoch on [GPU:0, GPU:1]` and writes the
report to --model_dir. All logic lives in the library (train.py); this file reads the flags.
"""
import os

from tfmulti import cli  # first: it imports TensorFlow quietly
from tfmulti import devices, train
from tfmulti.cli import FLAGS


def main():
    cluster = devices.cluster_config(FLAGS.worker_hosts, FLAGS.task_index,
                                     os.environ.get("TF_CONFIG"))
    plan = cli.device_plan()
    cli.batch_sizes(plan)  # flag errors before anything starts
    cli.check_sizes()
    model_dir = cli.model_dir(FLAGS.model, chief=devices.is_chief(cluster))
    cli.start_devices(plan)
    if cluster:
        strategy = devices.make_multi_worker_strategy(cluster, plan, FLAGS.worker_timeout)
        task = cluster["task"]
        role = "chief" if devices.is_chief(cluster) else f"{task['type']}-{task['index']}"
    else:
        strategy, role = devices.make_strategy(plan), None
    per_replica, _ = cli.hparams.batch_sizes(strategy.num_replicas_in_sync,
                                             FLAGS.per_replica_batch_size, FLAGS.global_batch_size)
    line, _ = train.train_and_evaluate(
        strategy, cli.load_data(), model=FLAGS.model, width=FLAGS.width, dtype=FLAGS.dtype,
        sync_batchnorm=FLAGS.sync_batchnorm, per_replica_batch_size=per_replica,
        base_lr=FLAGS.base_lr, lr_scaling=FLAGS.lr_scaling, warmup_epochs=FLAGS.warmup_epochs,
        epochs=FLAGS.epochs, seed=FLAGS.seed, steps_per_call=FLAGS.steps_per_call,
        model_dir=model_dir, show_replicas=FLAGS.show_replicas, run_info=cli.run_info(),
        checkpoint_steps=FLAGS.checkpoint_steps, role=role)
    if role in (None, "chief"):
        print(line)
        print(f"report: {model_dir}/ (metrics.json, accuracy.png, tensorboard/, model.keras)")


def run():
    """Console-script entry point (`tfmulti`)."""
    cli.run(main)


if __name__ == "__main__":
    run()
