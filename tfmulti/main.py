"""Trains the book's ResNet-18 variant on Fashion-MNIST across devices.

    python -m tfmulti.main --num_gpus=2
    python -m tfmulti.main --flagfile=flags/quickstart.cfg   # offline, CPU, minutes

Prints the book's line `test acc: 0.93, 7.3 sec/epoch on [GPU:0, GPU:1]` and writes the
report to --model_dir. All logic lives in the library (train.py); this file reads the flags.
"""
import os

from tfmulti import cli  # first: it imports TensorFlow quietly
from tfmulti.distribution import devices, workers
from tfmulti.run.plan import run_plan
from tfmulti.training import train


def main():
    cfg = cli.run_config()
    cluster = workers.cluster_config(cfg.worker_hosts, cfg.task_index,
                                     os.environ.get("TF_CONFIG"))
    plan = cli.device_plan(cfg)
    if cluster:  # flag errors before anything starts
        workers.check_multi_worker_plan(plan, cfg.worker_timeout)
    else:
        run_plan(cfg, plan.count)  # a batch that cannot work: one line, now
    dataset = cli.load_data(cfg)  # and data errors before anything is made on disk
    model_dir = cli.model_dir(cfg, cfg.model, chief=workers.is_chief(cluster))
    cli.start_devices(plan, cfg)
    if cluster:
        strategy = workers.make_multi_worker_strategy(cluster, plan, cfg.worker_timeout)
        task = cluster["task"]
        role = "chief" if workers.is_chief(cluster) else f"{task['type']}-{task['index']}"
    else:
        strategy, role = devices.make_strategy(plan), None
    line, _ = train.train_and_evaluate(strategy, dataset, cfg, model_dir=model_dir,
                                       command=cli.command(), role=role)
    if role in (None, "chief"):
        print(line)
        print(f"report: {model_dir}/ (metrics.json, accuracy.png, tensorboard/, model.keras)")


def run():
    """Console-script entry point (`tfmulti`)."""
    cli.run(main, "main")


if __name__ == "__main__":
    run()
