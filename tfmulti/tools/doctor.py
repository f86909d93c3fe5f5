"""Preflight: the main job's flags checked against this machine before a long run starts;
the checks are tfmulti/preflight/."""
import os

import tensorflow as tf

from tfmulti import quiet
from tfmulti.distribution import allocator, devices, gpulibs, slurm, startup, workers
from tfmulti.errors import UserError
from tfmulti.preflight import machine, prediction, probes, yourcode
from tfmulti.preflight.report import Report, finish
from tfmulti.run import config, flagdefs
from tfmulti.run.plan import run_plan


def main():
    FLAGS = flagdefs.FLAGS
    report = Report()
    report.info("versions", machine.versions())
    cluster = plan = start = None
    try:
        cfg = config.from_flags(flagdefs.FLAGS)
        start = startup.from_config(cfg)
        plan, cluster = start.plan, start.cluster
    except UserError as e:
        report.problem(str(e))
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
    container = machine.in_container()
    if plan is not None and plan.kind == "cpu":
        report.info("device", f"{plan.count} logical CPU replica{'s' if plan.count > 1 else ''}"
                    f" ({', '.join(plan.devices)}) on the {cores} core{'s' if cores > 1 else ''}")
    if cluster and slurm.in_step(os.environ):
        report.info("slurm", slurm.describe(cluster, os.environ))
        if slurm.ephemeral_overlap(os.environ):
            report.warn(slurm.ephemeral_overlap(os.environ))
    if cluster:
        from tfmulti.distribution import netns

        line = workers.listening_line(cluster)
        report.info("network", line) if netns.JOINED else report.warn(line)
    if plan is not None:
        report.info("strategy", probes.describe_strategy(plan, cluster))
        threads = start.threads
        probed = probes.check_allreduce(report, start, FLAGS.doctor_allreduce_mb,
                                        FLAGS.doctor_timeout)
        if FLAGS.doctor_predict and FLAGS.measure_budget <= 0:
            report.problem(f"--measure_budget={FLAGS.measure_budget:g}: must be positive "
                           "(seconds)")
        if probed is not None and FLAGS.doctor_predict and not report.problems:
            prediction.check_prediction(report, plan, cfg, threads, probed,
                                        FLAGS.doctor_allreduce_mb, FLAGS.doctor_timeout,
                                        FLAGS.measure_budget)
        machine.shm_check(report, plan, container, machine.shm_size())
    machine.model_dir_check(report, FLAGS.model_dir)
    if plan is not None and yourcode.applies(cfg):  # your model or data: built and tried
        yourcode.check(report, cfg, FLAGS.doctor_timeout)
    elif plan is not None or FLAGS.dataset in config.DATASETS:
        machine.data_check(report, FLAGS.dataset, FLAGS.data_dir)
    finish(report)
