"""The benchmarks as a library (python -m tfmulti.bench COMMAND; tools/bench.py reads the
flags into a BenchOptions and calls run): parallel and overlap (experiments.py), scaling
(scaling.py), predict (advise.py), and one point of the scaling sweep."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import TYPE_CHECKING

from tfmulti.bench import stepmodel
from tfmulti.distribution import devices, startup, storage
from tfmulti.errors import UsageError
from tfmulti.run.plan import run_plan

if TYPE_CHECKING:
    from tfmulti.run.config import RunConfig


@dataclasses.dataclass(frozen=True)
class BenchOptions:
    """The benchmarks' own settings (their flags); flags and command: for the reports."""
    repeats: int = 5
    warmup: int = 1
    products: int = 50
    matrix_size: int = 0
    steps: int = 10
    predict_devices: tuple = ("1", "2", "4", "8")
    predict_machines: tuple = ("1", "2", "4")
    intra_link: str | None = None
    inter_link: str = "eth25"
    collective: str = "ring"
    overlap: float = 0.0
    measure_budget: float = 40.0
    out: str | None = None
    link_mb: float = 0.0
    step_times: int = 0
    flags: dict = dataclasses.field(default_factory=dict)
    command: str = ""


COMMANDS = ("parallel", "overlap", "scaling", "predict", "scaling_point")  # the last: one
# point of the sweep in a process of its own (bench/scaling.py starts them)


def run(command: str, cfg: RunConfig, options: BenchOptions) -> None:
    """The benchmark `command` (one of COMMANDS) of RunConfig cfg with BenchOptions."""
    if command == "scaling_point":
        return scaling_point(cfg, options)
    start = startup.from_config(cfg, one_run=False)
    if options.repeats < 1 or options.warmup < 0 or options.products < 1 or options.matrix_size < 0:
        raise UsageError("--repeats and --products must be at least 1, --warmup and "
                         "--matrix_size not negative")
    out = options.out or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S") + f"-bench-{command}")
    if command == "scaling":
        return scaling(start.plan, cfg, options, out)
    if command == "predict":
        return predict(start, cfg, options, out)
    return experiment(command, start, options, out)


def experiment(command, start, options, out):
    from tfmulti.bench import experiments

    plan = start.plan
    if command == "parallel" and plan.count < 2:
        raise UsageError("parallel needs two devices: --num_gpus=2, or --cpu_replicas=2 on the CPU")
    if command == "overlap" and plan.kind == "cpu" and plan.count < 2:
        raise UsageError("overlap on the CPU needs a device apart from the host: --cpu_replicas=2")
    size = options.matrix_size or (4000 if plan.kind == "gpu" else 1024)  # the book's on GPUs
    start.start_devices()
    info = _environment(plan, options)
    result = experiments.run(command, plan, size, options.products, options.repeats, options.warmup)
    path = _write(out, f"{command}.json", {**info, "matrix_size": size,
                                           "products": options.products, "result": result})
    print(f"saved {path}")


def scaling(plan, cfg, options, out):
    from tfmulti.bench import scaling as sweep

    if cfg.per_replica_batch_size is None and cfg.global_batch_size is None:
        cfg = dataclasses.replace(cfg, per_replica_batch_size=64)
    per_replica = run_plan(cfg, plan.count).per_replica_batch_size
    points = sweep.sweep(plan, cfg, per_replica, options.steps, options.repeats, options.warmup)
    os.makedirs(out, exist_ok=True)
    sweep.plot_scaling(points, os.path.join(out, "scaling.png"),
                       f"{cfg.model} (width {cfg.width}), {per_replica} per replica, "
                       f"{plan.kind.upper()}")
    path = _write(out, "scaling.json", {**_environment(plan, options), "per_replica_batch_size":
                                        per_replica, "points": points})
    print(f"saved {path} and scaling.png")


def predict(start, cfg, options, out):
    """Measures one device here, predicts the --predict_devices x --predict_machines grid,
    recommends batch, steps per call, dtype (bench/advise.py)."""
    from tfmulti.bench import advise

    plan = start.plan
    try:
        grid = ([int(n) for n in options.predict_devices],
                [int(m) for m in options.predict_machines])
    except ValueError:
        raise UsageError("--predict_devices and --predict_machines take whole numbers, comma "
                         "separated") from None
    try:
        inter = stepmodel.link(options.inter_link)
        intra = stepmodel.link(options.intra_link) if options.intra_link else None
    except ValueError as e:
        raise UsageError(f"--intra_link/--inter_link: {e}") from None
    if min(grid[0] + grid[1]) < 1 or not 0 <= options.overlap <= 1 or options.steps < 2:
        raise UsageError("--predict_devices and --predict_machines must be at least 1, "
                         "--overlap between 0 and 1, --steps at least 2")
    if options.measure_budget <= 0:
        raise UsageError(f"--measure_budget={options.measure_budget:g}: must be positive (seconds)")
    cores = devices.usable_cores()
    if plan.kind == "cpu":  # the measured device gets every core: CPU replicas share them
        start = dataclasses.replace(start, threads=(cores, 0), seed=None)
    start.start_devices()
    found = advise.predict_grid(plan, cfg, *grid, intra, inter, options.collective, options.overlap,
                                options.measure_budget, options.steps,
                                cores if plan.kind == "cpu" else None)
    print(f"saved {_write(out, 'predict.json', {**_environment(plan, options), **found})}")


def scaling_point(cfg, options):
    """One point of the sweep, run in its own process; prints POINT {json}. With
    --worker_hosts it is one worker of a multi-worker point (benchmarks/multiworker.py)."""
    from tfmulti.bench import scaling as sweep

    strategy = startup.from_config(cfg).start()
    per_replica = run_plan(cfg, strategy.num_replicas_in_sync).per_replica_batch_size
    point = sweep.point(strategy, devices.replica_names(strategy), cfg, per_replica,
                        options.steps, options.repeats, options.warmup, options.step_times,
                        options.link_mb)
    print("POINT " + json.dumps(point))


def _environment(plan, options):
    from tfmulti.rundir import report

    return {"flags": dict(options.flags), "command": options.command,
            "devices": plan.devices, "versions": report.versions(), "cpu_cores": os.cpu_count()}


def _write(out, name, payload):
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, name)
    with storage.replacing(path, "w") as f:
        json.dump(payload, f, indent=2)
    return path
