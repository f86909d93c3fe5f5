"""The benchmarks' tool: flags read and checked here, the work in performance/
(parallel and overlap: experiments.py; scaling: scaling.py; predict: advise.py)."""

import dataclasses
import json
import os
import time

from tfmulti.distribution import devices, startup
from tfmulti.errors import UsageError
from tfmulti.run import config, flagdefs
from tfmulti.run.plan import run_plan

COMMANDS = ("parallel", "overlap", "scaling", "predict", "scaling_point")  # the last: one
# point of the sweep in a process of its own (performance/scaling.py starts them)


def main(command):
    if command == "scaling_point":
        return scaling_point()

    FLAGS = flagdefs.FLAGS
    cfg = config.from_flags(flagdefs.FLAGS)
    start = startup.from_config(cfg, one_run=False)
    if FLAGS.repeats < 1 or FLAGS.warmup < 0 or FLAGS.products < 1 or FLAGS.matrix_size < 0:
        raise UsageError("--repeats and --products must be at least 1, --warmup and "
                         "--matrix_size not negative")
    out = FLAGS.out or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S") + f"-bench-{command}")
    if command == "scaling":
        return scaling(start.plan, cfg, out)
    if command == "predict":
        return predict(start, cfg, out)
    return experiment(command, start, out)


def experiment(command, start, out):
    from tfmulti.performance import experiments

    FLAGS = flagdefs.FLAGS
    plan = start.plan
    if command == "parallel" and plan.count < 2:
        raise UsageError("parallel needs two devices: --num_gpus=2, or --cpu_replicas=2 on the CPU")
    if command == "overlap" and plan.kind == "cpu" and plan.count < 2:
        raise UsageError("overlap on the CPU needs a device apart from the host: --cpu_replicas=2")
    size = FLAGS.matrix_size or (4000 if plan.kind == "gpu" else 1024)  # the book's on GPUs
    start.start_devices()
    info = _environment(plan)
    result = experiments.run(command, plan, size, FLAGS.products, FLAGS.repeats, FLAGS.warmup)
    path = _write(out, f"{command}.json", {**info, "matrix_size": size,
                                           "products": FLAGS.products, "result": result})
    print(f"saved {path}")


def scaling(plan, cfg, out):
    from tfmulti.performance import scaling as sweep

    FLAGS = flagdefs.FLAGS
    if cfg.per_replica_batch_size is None and cfg.global_batch_size is None:
        cfg = dataclasses.replace(cfg, per_replica_batch_size=64)
    per_replica = run_plan(cfg, plan.count).per_replica_batch_size
    points = sweep.sweep(plan, cfg, per_replica, FLAGS.steps, FLAGS.repeats, FLAGS.warmup)
    os.makedirs(out, exist_ok=True)
    sweep.plot_scaling(points, os.path.join(out, "scaling.png"),
                       f"{cfg.model} (width {cfg.width}), {per_replica} per replica, "
                       f"{plan.kind.upper()}")
    path = _write(out, "scaling.json", {**_environment(plan), "per_replica_batch_size":
                                        per_replica, "points": points})
    print(f"saved {path} and scaling.png")


def predict(start, cfg, out):
    """Measures one device here, predicts the --predict_devices x --predict_machines grid,
    recommends batch, steps per call, dtype (performance/advise.py)."""
    from tfmulti.performance import advise, stepmodel

    FLAGS = flagdefs.FLAGS
    plan = start.plan
    try:
        grid = ([int(n) for n in FLAGS.predict_devices], [int(m) for m in FLAGS.predict_machines])
    except ValueError:
        raise UsageError("--predict_devices and --predict_machines take whole numbers, comma "
                         "separated") from None
    try:
        inter = stepmodel.link(FLAGS.inter_link)
        intra = stepmodel.link(FLAGS.intra_link) if FLAGS.intra_link else None
    except ValueError as e:
        raise UsageError(f"--intra_link/--inter_link: {e}") from None
    if min(grid[0] + grid[1]) < 1 or not 0 <= FLAGS.overlap <= 1 or FLAGS.steps < 2:
        raise UsageError("--predict_devices and --predict_machines must be at least 1, "
                         "--overlap between 0 and 1, --steps at least 2")
    if FLAGS.measure_budget <= 0:
        raise UsageError(f"--measure_budget={FLAGS.measure_budget:g}: must be positive (seconds)")
    cores = devices.usable_cores()
    if plan.kind == "cpu":  # the measured device gets every core: CPU replicas share them
        start = dataclasses.replace(start, threads=(cores, 0), seed=None)
    start.start_devices()
    found = advise.predict_grid(plan, cfg, *grid, intra, inter, FLAGS.collective, FLAGS.overlap,
                                FLAGS.measure_budget, FLAGS.steps,
                                cores if plan.kind == "cpu" else None)
    print(f"saved {_write(out, 'predict.json', {**_environment(plan), **found})}")


def scaling_point():
    """One point of the sweep, run in its own process; prints POINT {json}. With
    --worker_hosts it is one worker of a multi-worker point (benchmarks/multiworker.py)."""
    from tfmulti.performance import scaling as sweep

    FLAGS = flagdefs.FLAGS
    cfg = config.from_flags(flagdefs.FLAGS)
    strategy = startup.from_config(cfg).start()
    per_replica = run_plan(cfg, strategy.num_replicas_in_sync).per_replica_batch_size
    point = sweep.point(strategy, devices.replica_names(strategy), cfg, per_replica,
                        FLAGS.steps, FLAGS.repeats, FLAGS.warmup, FLAGS.step_times,
                        FLAGS.link_mb)
    print("POINT " + json.dumps(point))


def _environment(plan):
    from tfmulti.training import report

    return {"flags": flagdefs.values("bench"), "command": flagdefs.command_line(),
            "devices": plan.devices, "versions": report.versions(), "cpu_cores": os.cpu_count()}


def _write(out, name, payload):
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, name)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
    return path
