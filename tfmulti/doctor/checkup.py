"""The doctor: the main job's flags checked against this machine before a long run starts
(python -m tfmulti.doctor; tools/doctor.py reads the flags into a DoctorOptions and calls
examine). The checks themselves are the other modules of tfmulti/doctor/."""
from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING

import tensorflow as tf

from tfmulti import caches, quiet
from tfmulti.distribution import allocator, devices, gpulibs, slurm, startup
from tfmulti.doctor import machine, prediction, probes, yourcode
from tfmulti.doctor.report import Report
from tfmulti.errors import UserError
from tfmulti.processes import netns
from tfmulti.run import config
from tfmulti.run.plan import run_plan

# --per_replica_batch_size=auto is found by the run; the doctor's checks take this batch
AUTO_STAND_IN = 64

if TYPE_CHECKING:
    from collections.abc import Callable

    from tfmulti.run.config import RunConfig


@dataclasses.dataclass(frozen=True)
class DoctorOptions:
    """The doctor's own settings (its flags), and the data flags as given, for the data check
    when the RunConfig is refused."""
    allreduce_mb: float = 32.0
    timeout: float = 60.0
    predict: bool = True
    measure_budget: float = 40.0
    model_dir: str | None = None
    dataset: str = "fashion_mnist"
    data_dir: str | None = None


def examine(read_config: Callable[[], RunConfig], options: DoctorOptions,
            report: Report | None = None) -> Report:
    """The doctor's checks of the RunConfig read_config() gives (a flag it refuses is a
    problem line, and the checks that need no config still run) on this machine, one line
    each in `report`; returns the report (its problems decide the exit code)."""
    report = report or Report()
    report.info("versions", machine.versions())
    cfg = cluster = plan = start = None
    try:
        cfg = read_config()
        start = startup.from_config(cfg)
        plan, cluster = start.plan, start.cluster
    except UserError as e:
        report.problem(str(e))
    if cfg is not None and cfg.per_replica_batch_size == config.AUTO_BATCH:
        report.info("batch", f"--per_replica_batch_size=auto: the run finds it at its start; "
                    f"the checks below take {AUTO_STAND_IN} per replica")
        cfg = dataclasses.replace(cfg, per_replica_batch_size=AUTO_STAND_IN)
    if plan is not None and not cluster:
        try:
            run_plan(cfg, plan.count)
        except UserError as e:
            report.problem(str(e))
    physical = [tf.config.experimental.get_device_details(g)
                for g in tf.config.list_physical_devices("GPU")]
    for line in machine.gpu_lines(physical):
        report.info("device", line)
    if not physical and tf.sysconfig.get_build_info().get("is_cuda_build"):
        report.info("gpu", "none found "
                    f"({gpulibs.why_no_gpu(quiet.STARTUP) or 'the driver lists no GPU'})")
    cores = devices.usable_cores()
    report.info("cpu", f"{cores} core{'s' if cores > 1 else ''} usable by this process")
    used, hint = allocator.describe()
    report.info("malloc", used)
    if hint:
        report.warn(hint)
    report.info("cache", caches.describe())
    container = machine.in_container()
    if plan is not None and plan.kind == "cpu":
        report.info("device", f"{plan.count} logical CPU replica{'s' if plan.count > 1 else ''}"
                    f" ({', '.join(plan.devices)}) on the {cores} core{'s' if cores > 1 else ''}")
    if cluster and slurm.in_step(os.environ):
        report.info("slurm", slurm.describe(cluster, os.environ))
        if slurm.ephemeral_overlap(os.environ):
            report.warn(slurm.ephemeral_overlap(os.environ))
    if cluster:
        line = netns.listening_line(cluster)
        report.info("network", line) if netns.JOINED else report.warn(line)
    if plan is not None:
        report.info("strategy", probes.describe_strategy(plan, cluster))
        threads = start.threads
        probed = probes.check_allreduce(report, start, options.allreduce_mb, options.timeout)
        if options.predict and options.measure_budget <= 0:
            report.problem(f"--measure_budget={options.measure_budget:g}: must be positive "
                           "(seconds)")
        if probed is not None and options.predict and not report.problems:
            prediction.check_prediction(report, plan, cfg, threads, probed,
                                        options.allreduce_mb, options.timeout,
                                        options.measure_budget)
        machine.shm_check(report, plan, container, machine.shm_size())
    machine.model_dir_check(report, cfg.model_dir if cfg else options.model_dir)
    dataset, data_dir = (cfg.dataset, cfg.data_dir) if cfg else (options.dataset,
                                                                 options.data_dir)
    if plan is not None and yourcode.applies(cfg):  # your model or data: built and tried
        yourcode.check(report, cfg, options.timeout)
    elif plan is not None or dataset in config.DATASETS:
        machine.data_check(report, dataset, data_dir)
    return report
