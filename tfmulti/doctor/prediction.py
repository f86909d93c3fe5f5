"""The doctor's prediction: one replica measured in a process of its own, then the one
measure -> predict -> advise path (bench/advise.py) with the probe's link.
"""
import dataclasses

from tfmulti.bench import advise, progress, stepmodel
from tfmulti.data import sources
from tfmulti.distribution import startup
from tfmulti.doctor import probes
from tfmulti.processes import child
from tfmulti.run import config
from tfmulti.run.plan import run_plan
from tfmulti.training import xla


def _measure_child(send, plan, cfg, threads, budget_s):
    """One replica's training step at the per-replica batch, and the matmul rates, measured
    as `bench predict` measures (advise.measure_here), in a process of its own (the training
    job's devices, as the probe's). A progress bar only on a terminal."""
    try:
        startup.Startup(plan, threads=threads).start_devices()
        per_replica = run_plan(cfg, plan.count).per_replica_batch_size
        data = None
        if cfg.dataset not in config.DATASETS:  # your data: your model's real step
            data = sources.load_for(cfg)
        bar = progress.Bar(budget_s, piped_lines=False)
        try:
            jit, timed = cfg.jit_compile == "on", None
            if cfg.jit_compile == "auto":  # the verdict --jit_compile=auto runs by, first:
                bar.show("the step with XLA and without")  # the prediction times the step
                timed = advise.measure_xla(plan.devices[0], cfg.model, cfg.width,  # it gives
                                           cfg.dtype, per_replica, budget_s, data)
                jit = verdict_turns_xla_on(timed)
            measured = advise.measure_here(plan.devices[0], cfg.model, cfg.width, cfg.dtype,
                                           per_replica, budget_s, bar=bar, data=data, jit=jit)
            if timed is not None:
                measured["xla"] = timed
        finally:
            bar.close()
        send.send(measured)
    except Exception as e:  # noqa: BLE001 - the parent reports it
        send.send(probes.sendable(e))


def verdict_turns_xla_on(timed):
    """Whether --jit_compile=auto trains with XLA after this measurement (xla.turns_on, the
    rule a run reads the kept verdict by)."""
    return xla.turns_on(timed)


def check_prediction(report, plan, cfg, threads, probed, megabytes, timeout, budget_s):
    """Times one replica, then predicts these devices and workers with the probe's link.
    The measurement aims at budget_s seconds; `timeout` more before it counts as hung."""
    probe_plan = dataclasses.replace(plan, memory_growth=plan.kind == "gpu")
    try:
        measured = child.run(_measure_child, (probe_plan, cfg, threads, budget_s),
                             budget_s + timeout, what="the training-step measurement")
    except (TimeoutError, child.Died) as e:
        report.warn(f"no prediction: {e}")
        return
    if isinstance(measured, Exception):
        report.warn(f"no prediction: one replica's training step failed: {measured}")
        return
    report_prediction(report, plan, cfg, probed, measured, megabytes)


def probed_link(probed, megabytes):
    """The probe's all-reduce as a Link: its bus bandwidth, and the latency of a one-number
    all-reduce per hop of the ring (PCIe 3's figures with one replica: nothing crosses)."""
    replicas = probed["replicas"]
    if probed["allreduce"] is None:
        return stepmodel.LINKS["pcie3"]
    return stepmodel.Link("measured",
                          probes.bus_bandwidth(megabytes, replicas, probed["allreduce"][0]),
                          probed["latency"] / (2 * (replicas - 1)))


def prediction_inputs(plan, cfg, probed, measured, megabytes):
    """(compute, model, setup) of stepmodel.py for this plan's replicas over its workers, from
    one replica's measurement and the probe's all-reduce (advise.inputs and advise.setup, as
    `bench predict` builds them)."""
    local, replicas = probed["local"], probed["replicas"]
    link = probed_link(probed, megabytes)
    compute, model = advise.inputs(measured, plan.kind == "cpu", cfg.allreduce_dtype)
    return compute, model, advise.setup(measured, cfg, local, replicas // local, link, link)


def report_prediction(report, plan, cfg, probed, measured, megabytes):
    """The prediction for these flags, what it was measured from, and the advice, each from
    advise.py (`bench predict` words them the same)."""
    compute, model, setup = prediction_inputs(plan, cfg, probed, measured, megabytes)
    result = stepmodel.predict(compute, model, setup, measured["batch"])
    step = sum(result.terms.values())
    n = result.devices * result.machines
    where = (f"{n} replicas" + (f" on {result.machines} workers" if result.machines > 1 else "")
             if n > 1 else "1 replica")
    report.info("prediction", f"{where} at {measured['batch']} per replica: "
                f"{result.speedup:.2f}x one replica's {measured['batch'] / measured['step_s']:.0f}"
                f" images/s ({result.efficiency:.0%} efficiency), bound by {result.bound} "
                f"({result.terms[result.bound] / step:.0%} of a step)"
                + ("; CPU replicas share the cores" if plan.kind == "cpu" and n > 1 else ""))
    report.info("measured", f"one replica on {plan.devices[0]}: "
                f"{advise.describe(measured, model, cfg.allreduce_dtype)}")
    report.info("matmul", f"{advise.matmul_text(measured)} on {plan.devices[0]}")
    if "xla" in measured:
        report_xla(report, plan, cfg, measured)
    advice = advise.advise(compute, model, setup, measured, cfg.dtype, cfg.allreduce_dtype)
    if advice.dtype:
        report.warn(advice.dtype)
    report.info("recommended", f"for {where}: {advice.recommendation}")
    if advice.allreduce:
        report.info("advice", advice.allreduce)


def report_xla(report, plan, cfg, measured):
    """--jit_compile=auto: the step with XLA against without, kept for the runs that ask."""
    timed = measured["xla"]
    if not xla.record_verdict(xla.verdict_key(cfg, measured["batch"], plan.devices[0]), timed):
        report.warn(f"the XLA verdict was not kept: {xla.verdicts_path()}.lock stayed taken by "
                    f"another process for {xla.LOCK_WAIT_S:g} s; run the doctor again")
    if timed["refused"]:
        report.info("xla", f"XLA cannot compile the step: {timed['refused']}; "
                    "--jit_compile=auto trains without it")
        return
    report.info("xla", f"one replica's step {timed['step_s_xla'] * 1e3:.1f} ms with XLA, "
                f"{timed['step_s'] * 1e3:.1f} ms without ({timed['ratio']:.2f}x as fast): "
                f"--jit_compile=auto turns it {'on' if verdict_turns_xla_on(timed) else 'off'}"
                " for this model, batch and dtype on these devices (the prediction above is "
                f"of the step {'with' if verdict_turns_xla_on(timed) else 'without'} it)")
