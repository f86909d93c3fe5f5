"""Measure -> predict -> advise, once: one device's training step measured here, the step
model's inputs built from it, predictions, and the advice (per-device batch, --steps_per_call,
the dtype, the gradients' all-reduce dtype). `python -m tfmulti.bench predict` and the doctor
both measure, predict and word their advice with these functions.

What is measured on one device, within a time budget (--measure_budget: tracing the model and
its first step always run, and at least LEAST_STEPS timed steps):
- the main job's training step at the per-device batch: single-step calls of its engine,
  each less the host's round trip, the median of up to --steps of them;
- the host's round trip per call: calls of the same traced function with no steps in them;
- the step at half the batch, when the budget leaves room: with two batch sizes the compute
  is fitted as fixed + batch / rate (the batch recommendation predicts other batches);
  without, it is taken as proportional to the batch, and the figures say so (half the batch,
  not twice it: it costs half a step, not two);
- matmul rates in float32 and bfloat16 (the dtype warning).
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from typing import TYPE_CHECKING, Any

import tensorflow as tf

from tfmulti.accounting import flops
from tfmulti.bench import measure, progress, stepmodel
from tfmulti.distribution import devices
from tfmulti.training import xla

if TYPE_CHECKING:
    from tfmulti.run.config import RunConfig

BUDGET_S = 40.0  # seconds measuring one device aims to take, tracing included
MOST_STEPS = 10  # timed steps at each batch size, at most
LEAST_STEPS = 2  # timed steps at each batch size measured, at least: a median and a spread
MATMUL_SIDE = {"gpu": 4096, "cpu": 1024}  # enough for the device's rate: 2 GFLOP a CPU product
EFFICIENCY = 0.9  # what the recommended batch keeps at the largest setup


# ----------------------------------------------------------------------------- measure

def measure_here(device: str, model: str, width: int, dtype: str, batch: int,
                 budget_s: float = BUDGET_S, most_steps: int = MOST_STEPS,
                 bar: progress.Bar | None = None, data: Any = None,
                 jit: bool = False) -> dict[str, Any]:
    """What the figures need, measured on `device` within about budget_s seconds (tracing the
    model and LEAST_STEPS steps at `batch` whatever the budget). A dict JSON can hold:
    batch, step_s (median, s), steps_s (each timed step, s), call_overhead_s (a call's round
    trip, s), second_batch and step_s_second / steps_s_second (or None, and why_one_batch),
    gradient_bytes and tensors (float32 gradients), peak_gflops, peak_source and mfu (the
    peak a run's MFU divides by, flops.Peak, and the step's MFU), float32_gflops,
    bfloat16_gflops, dtype and jit_compile (the step measured: in the run's dtype, with XLA
    when `jit`, unless XLA refused it: xla_refused says why). data: the DataSet your model
    trains on (its features and task), None for synthetic images."""
    bar = bar or progress.silent()
    started = time.perf_counter()
    deadline = started + budget_s
    side = MATMUL_SIDE["gpu" if "GPU" in device.upper() else "cpu"]
    bar.show(f"matmul {side}x{side}, float32 and bfloat16")
    rates = {f"{name}_gflops": measure.matmul_gflops(device, tf_dtype, side)
             for name, tf_dtype in (("float32", tf.float32), ("bfloat16", tf.bfloat16))}
    spec = (tf.distribute.OneDeviceStrategy(device), model, width, dtype, data)
    half = batch // 2
    at_batch, refused = measure_run_step(spec, batch, most_steps, deadline, bar,
                                         reserve=_half_cost if half else None, jit=jit)
    jit = jit and not refused
    second, why = None, ""
    if not half:
        why = "batch 1 has no half"
    elif time.perf_counter() + _half_cost(statistics.median(at_batch["steps_s"]),
                                          at_batch["first_call_s"]) > deadline:
        why = f"not in the --measure_budget of {budget_s:g} s"
    else:
        second = measure_batch(spec, half, most_steps, deadline, bar, jit=jit)
    return {
        "device": device, "batch": batch, "step_s": statistics.median(at_batch["steps_s"]),
        "steps_s": at_batch["steps_s"], "first_call_s": at_batch["first_call_s"],
        "call_overhead_s": at_batch["round_trip_s"],
        "second_batch": half if second else None, "why_one_batch": why,
        "step_s_second": statistics.median(second["steps_s"]) if second else None,
        "steps_s_second": second["steps_s"] if second else None,
        "gradient_bytes": at_batch["gradient_bytes"], "tensors": at_batch["tensors"],
        "peak_gflops": at_batch["peak_gflops"], "peak_source": at_batch["peak_source"],
        "mfu": at_batch["mfu"], **rates, "matmul_side": side, "budget_s": budget_s, "dtype": dtype,
        "jit_compile": jit, **({"xla_refused": refused} if refused else {}),
        "seconds": time.perf_counter() - started}


def _half_cost(step_s, first_call_s):
    """Seconds the half-batch point is expected to take: its first call (the same tracing,
    half a step's work) and its least steps."""
    return first_call_s - step_s / 2 + LEAST_STEPS * step_s / 2


def measure_xla(device: str, model: str, width: int, dtype: str, batch: int,
                budget_s: float = BUDGET_S, data: Any = None) -> dict[str, Any]:
    """One replica's step at `batch` with XLA (--jit_compile=on) and without, on `device`,
    each timed for about half of budget_s: {"step_s", "step_s_xla", "ratio" (the speed with
    XLA over without), "refused" (why XLA cannot compile the step, or "")}."""
    strategy = tf.distribute.OneDeviceStrategy(device)
    started = time.perf_counter()
    plain = measure_batch((strategy, model, width, dtype, data), batch, MOST_STEPS,
                           started + budget_s / 2, progress.silent())
    step_s = statistics.median(plain["steps_s"])
    compiled = measure_batch((strategy, model, width, dtype, data), batch, MOST_STEPS,
                              time.perf_counter() + budget_s / 2, progress.silent(), jit=True)
    if compiled["refused"]:
        return {"step_s": step_s, "step_s_xla": None, "ratio": None,
                "refused": compiled["refused"]}
    step_s_xla = statistics.median(compiled["steps_s"])
    return {"step_s": step_s, "step_s_xla": step_s_xla, "ratio": step_s / step_s_xla,
            "refused": ""}


def measure_run_step(spec, batch, most_steps, deadline, bar, reserve=None, jit=False):
    """(measure_batch's figures of the step the run trains, why XLA refused it or ''): with
    XLA when `jit`, without it where XLA refuses the step (the run trains without it then)."""
    measured = measure_batch(spec, batch, most_steps, deadline, bar, reserve, jit, peak=True)
    if not measured["refused"]:
        return measured, ""
    return (measure_batch(spec, batch, most_steps, deadline, bar, reserve, peak=True),
            measured["refused"])


def measure_batch(spec, batch, most_steps, deadline, bar, reserve=None, jit=False,
                  peak=False):
    """One batch size: the first call (tracing, a step), the round trip, then timed steps
    until most_steps, or until the next (and `reserve(step_s, first_call_s)` seconds kept for
    what follows) would end after the deadline, LEAST_STEPS at least. jit: with XLA; a step
    XLA cannot compile is not timed ("refused": why). peak: with the peak a run's MFU
    divides by and the step's MFU (peak_gflops, peak_source, mfu), where steps were timed."""
    strategy, model, width, dtype, data = spec
    bar.show(f"batch {batch}: building {model}, tracing, a first step")
    call, eng = measure.training_call(strategy, model, width, batch, 1, dtype,
                                      learning_rate=0.01,  # small: no diverging while timed
                                      disposable=True, data=data,
                                      **({"jit_compile": True} if jit else {}))
    if jit:
        refused = xla.refusal_on_first_batch(eng.xla_refusal, data, batch)
        if refused:
            return {"refused": refused}
    try:
        first_call_s = call(1)
    except xla.XlaFellBack as fell:  # the backend's compile failed at the first step
        return {"refused": fell.reason}
    bar.show(f"batch {batch}: the host's round trip per call")
    round_trip_s = measure.round_trip_seconds(call)

    def keep_going(samples):
        if len(samples) >= most_steps:
            return False
        if len(samples) >= LEAST_STEPS:
            step = statistics.median(samples)
            kept = reserve(step, first_call_s) if reserve else 0.0
            if time.perf_counter() + step + kept > deadline:
                return False
        bar.show(f"batch {batch}: timed step {len(samples) + 1} (at most {most_steps})")
        return True

    gradients = stepmodel.Model.of_keras(eng.model)
    steps_s = measure.time_steps(call, round_trip_s, keep_going)
    figures = {"first_call_s": first_call_s, "round_trip_s": round_trip_s, "steps_s": steps_s,
               "gradient_bytes": gradients.gradient_bytes, "tensors": gradients.tensors,
               "refused": ""}
    if peak and steps_s:  # (a memory search's fit takes the first step only: nothing timed)
        peak = flops.Peak(strategy, dtype)  # the run's MFU divides by the same
        cost = flops.step_cost(eng)
        peak_flops = peak.of_step(cost.kernels)
        figures.update(peak_gflops=peak_flops / 1e9, peak_source=peak.source,
                       mfu=flops.utilization(cost.per_example,
                                             batch / statistics.median(steps_s), peak_flops))
    return figures


# ----------------------------------------------------------------------------- predict

def inputs(measured: dict[str, Any], shared: bool,
           allreduce_dtype: str) -> tuple[stepmodel.Compute, stepmodel.Model]:
    """(compute, model) of the step model: the compute fitted to the two batch sizes when both
    were measured, else proportional to the batch (no fixed part); the gradients as sent."""
    batch, step_s = measured["batch"], measured["step_s"]
    if measured.get("second_batch"):
        compute = stepmodel.Compute.from_two(measured["second_batch"], measured["step_s_second"],
                                             batch, step_s, shared=shared)
    else:
        compute = stepmodel.Compute(batch / step_s, shared=shared)
    model = stepmodel.Model(measured["gradient_bytes"], measured["tensors"]).sent_in(
        allreduce_dtype)
    return compute, model


def call_overhead(measured):
    """Seconds of a call's round trip (0 in a measurement that has none)."""
    return measured.get("call_overhead_s", 0.0)


def setup(measured: dict[str, Any], cfg: RunConfig, devices: int, machines: int,
          intra: stepmodel.Link, inter: stepmodel.Link, algorithm: str = "ring",
          overlap: float = 0.0) -> stepmodel.Setup:
    """The step model's Setup for `devices` per machine on `machines`, with cfg's steps per
    call and the round trip measured."""
    return stepmodel.Setup(devices=devices, machines=machines, intra=intra, inter=inter,
                           algorithm=algorithm, overlap=overlap,
                           steps_per_call=cfg.steps_per_call,
                           call_overhead_s=call_overhead(measured))


def grid(compute, model, setup_for, devices_list, machines_list, batch):
    """Predictions for every (machines, devices) pair, machines first."""
    return [stepmodel.predict(compute, model, setup_for(n, m), batch)
            for m in machines_list for n in devices_list]


# ----------------------------------------------------------------------------- advise

@dataclasses.dataclass(frozen=True)
class Advice:
    batch: object  # the smallest per-device batch that keeps EFFICIENCY, or None
    steps_per_call: int  # the fewest that keep host round trips under 2% of a step
    dtype: str  # a warning when --dtype computes clearly slower than float32 here, or ''
    allreduce: str  # --allreduce_dtype=float16 when it is predicted to gain 3%, or ''

    @property
    def recommendation(self):
        batch = (f" {self.batch} ({EFFICIENCY:.0%} efficiency)" if self.batch
                 else f": none of the sizes tried keeps {EFFICIENCY:.0%} efficiency")
        return f"per-device batch{batch}, --steps_per_call={self.steps_per_call}"


def advise(compute: stepmodel.Compute, model: stepmodel.Model, setup: stepmodel.Setup,
           measured: dict[str, Any], dtype: str, allreduce_dtype: str) -> Advice:
    """The advice for `setup` (the largest one asked about) at the measured batch."""
    batch = measured["batch"]
    step = stepmodel.predict(compute, model, setup, batch)
    return Advice(
        stepmodel.recommend_batch(compute, model, setup, efficiency=EFFICIENCY),
        stepmodel.recommend_steps_per_call(setup, sum(step.terms.values())),
        stepmodel.dtype_advice(measured["float32_gflops"], measured["bfloat16_gflops"], dtype),
        stepmodel.allreduce_advice(compute, model, setup, batch, allreduce_dtype))


# ----------------------------------------------------------------------------- words

def describe(measured: dict[str, Any], model: stepmodel.Model, allreduce_dtype: str) -> str:
    """The figures measured, at which batches and from how many steps, in one line."""
    batch, step_s = measured["batch"], measured["step_s"]
    samples = measured.get("steps_s") or [step_s]
    text = (f"{batch / step_s:.1f} images/s at batch {batch} in {measured.get('dtype', 'float32')}"
            + (" with XLA" if measured.get("jit_compile") else
               f" without XLA ({measured['xla_refused']})" if measured.get("xla_refused") else "")
            + f" ({_steps(samples)})")
    if measured.get("second_batch"):
        second = measured["second_batch"]
        text += (f", {second / measured['step_s_second']:.1f} at batch {second} "
                 f"({_steps(measured['steps_s_second'])})")
    else:
        why = measured.get("why_one_batch") or "not measured"
        text += f"; one batch size ({why}): compute taken as proportional to the batch"
    return (text + f"; host round trip {call_overhead(measured) * 1e3:.2f} ms a call; gradients "
            f"{model.gradient_bytes / 1e6:.1f} MB ({allreduce_dtype}) in {model.tensors} tensors")


def _steps(samples):
    """'a step 6.75 s, median of 3: 6.64-6.85' (ms below a second)."""
    scale, unit = (1.0, "s") if statistics.median(samples) >= 1 else (1e3, "ms")
    low, mid, high = (x * scale for x in (min(samples), statistics.median(samples), max(samples)))
    digits = 2 if unit == "s" else 1
    return (f"a step {mid:.{digits}f} {unit}, median of {len(samples)}: "
            f"{low:.{digits}f}-{high:.{digits}f}")


def matmul_text(measured: dict[str, Any]) -> str:
    """The matmul rates, and the peak a run's MFU divides by (flops.Peak), with the step's
    MFU at the measured batch."""
    peak = ""
    if measured.get("peak_gflops"):
        source = ("a matmul" if measured["peak_source"] == "matmul" else
                  f"the step's fastest kernel, {measured['peak_source']}")
        mfu = f", the step's MFU {measured['mfu']:.0%}" if measured.get("mfu") else ""
        peak = f"; MFU's peak {measured['peak_gflops']:.0f} GFLOP/s ({source}){mfu}"
    return (f"{measured['float32_gflops']:.0f} GFLOP/s float32, "
            f"{measured['bfloat16_gflops']:.0f} bfloat16{peak}")


def format_rows(rows):
    lines = [f"{'machines':>8} {'devices':>7} {'images/s':>10} {'speed-up':>9} "
             f"{'efficiency':>10}  bound (share of the step)"]
    for r in rows:
        step = sum(r.terms.values())
        lines.append(f"{r.machines:>8} {r.devices:>7} {r.images_per_s:>10.1f} {r.speedup:>9.2f} "
                     f"{r.efficiency:>10.0%}  {r.bound} ({r.terms[r.bound] / step:.0%})")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- bench predict

def predict_grid(plan, cfg, devices_list, machines_list, intra, inter, algorithm="ring",
                 overlap=0.0, budget_s=BUDGET_S, most_steps=MOST_STEPS, cores=None):
    """`bench predict` once its devices are started: measures one device (and, with several
    replicas and no `intra` link given, the link between them) under a progress bar on stderr,
    prints the figures, the grid and the advice; returns what its JSON keeps."""
    batch = cfg.per_replica_batch_size or 64
    device = plan.devices[0]
    jit, said = jit_for(cfg, batch, device)
    then = f", then {batch // 2} if the --measure_budget of {budget_s:g} s allows" if batch > 1 \
        else ""
    if said:
        print(said)
    print(f"measuring {cfg.model} (width {cfg.width}), {cfg.dtype}"
          + (", with XLA" if jit else "") + f", on {device}"
          + (f" ({cores} cores)" if cores else "") + f": batch {batch}{then}", flush=True)
    bar = progress.Bar(budget_s)
    try:
        measured = measure_here(device, cfg.model, cfg.width, cfg.dtype, batch, budget_s,
                                most_steps, bar, jit=jit)
        if intra is None and plan.count > 1:
            bar.show(f"all-reduces across {plan.count} replicas: the link between them")
            intra = measure.measured_link(devices.make_strategy(plan))
    finally:
        bar.close()
    intra = intra or stepmodel.LINKS["pcie3"]

    def setup_for(n, m):
        return setup(measured, cfg, n, m, intra, inter, algorithm, overlap)

    lines, rows, advice = grid_report(measured, plan.kind, cfg, setup_for, devices_list,
                                      machines_list)
    print(lines[0])
    print(f"links: inside a machine {intra.name} ({intra.gbytes_per_s:.2f} GB/s, "
          f"{intra.latency_s * 1e6:.0f} us a hop); between machines {inter.name} "
          f"({inter.gbytes_per_s:.2f} GB/s, {inter.latency_s * 1e6:.0f} us); {algorithm}, "
          f"overlap {overlap:g}" + ("; CPU devices share the cores" if plan.kind == "cpu"
                                    else ""))
    print("\n".join(lines[1:]), flush=True)
    return {"measured": measured, "rows": [dataclasses.asdict(r) for r in rows],
            "recommended_batch": advice.batch, "recommended_steps_per_call":
            advice.steps_per_call}


def jit_for(cfg: RunConfig, batch: int, device: str) -> tuple[bool, str]:
    """(whether the run's step compiles with XLA, the line --jit_compile=auto says or ''):
    the step the prediction measures is the one the run trains."""
    if cfg.jit_compile != "auto":
        return cfg.jit_compile == "on", ""
    return xla.auto(xla.verdict_key(cfg, batch, device))


def grid_report(measured, kind, cfg, setup_for, devices_list, machines_list):
    """(lines, rows, advice) for a measurement: what was measured, the grid's table, and the
    advice for its largest setup."""
    shared = kind == "cpu"
    compute, model = inputs(measured, shared, cfg.allreduce_dtype)
    rows = grid(compute, model, setup_for, devices_list, machines_list, measured["batch"])
    largest = setup_for(max(devices_list), max(machines_list))
    advice = advise(compute, model, largest, measured, cfg.dtype, cfg.allreduce_dtype)
    said = "; ".join(a for a in (advice.dtype, advice.allreduce) if a)
    return [f"one {kind.upper()} device here: {describe(measured, model, cfg.allreduce_dtype)}",
            format_rows(rows),
            f"recommended at {max(machines_list)} x {max(devices_list)}: "
            f"{advice.recommendation}; matmul {matmul_text(measured)} here"
            + (f"; {said}" if said else "")], rows, advice
