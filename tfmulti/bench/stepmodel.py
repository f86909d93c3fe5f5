"""How fast will N devices on M machines train? A model of one synchronous data-parallel step.

    step = compute(per-device batch) + the all-reduce left exposed + host round trips / call

- compute: the forward and backward pass of one device's batch, t0 + batch / rate (measured
  on this machine at two batch sizes, or given); logical CPU devices share their machine's
  cores, so N of them compute N batches at the machine's one rate.
- all-reduce of the gradients (ring or tree), within a machine over its link, between machines
  over the network: 2 (n - 1) / n x bytes / bandwidth, plus a latency per collective: one per
  pack of gradients (or one per gradient tensor when they are not packed), and the small ones
  of each step and each call (tfmulti's engine: one a call, for batch-norm statistics, losses
  and stop votes together). `overlap` is the share of the backward
  pass the all-reduce may hide behind (0 for tfmulti's engine: Keras applies the gradients,
  and they are summed, after the whole backward pass).
- the input pipeline: a machine's decoding rate, which bounds all its devices together.
- workers sharing one host (measured by benchmarks/multiworker.py, absent otherwise): the
  contention, how much slower one computes while the others compute too, and the straggler,
  the expected wait of a synchronous step for the slowest of its workers, from the spread of
  one worker's step times.

Pure arithmetic, no TensorFlow: the doctor and `tfmulti.bench predict` feed it measurements.
"""
from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class Link:
    """Usable all-reduce bus bandwidth (GB/s, as nccl-tests reports it) and latency per hop."""
    name: str
    gbytes_per_s: float
    latency_s: float


# Usable bus bandwidth: Ethernet at 90% of its line rate; InfiniBand EDR at the 12.2 GB/s an
# NCCL maintainer gives as the best one 100 Gb/s card reaches (nccl-tests issue 29); PCIe at
# about 75% of its theoretical 15.75 (gen 3) and 31.5 GB/s (gen 4) per direction; NVLink at
# about 80% of its per-direction total (P100 80 GB/s, V100 150, A100 300).
LINKS = {
    "pcie3": Link("PCIe 3 x16", 12.0, 10e-6),
    "pcie4": Link("PCIe 4 x16", 24.0, 10e-6),
    "nvlink1": Link("NVLink 1 (P100)", 64.0, 5e-6),
    "nvlink2": Link("NVLink 2 (V100)", 120.0, 5e-6),
    "nvlink3": Link("NVLink 3 (A100)", 240.0, 5e-6),
    "eth10": Link("10 Gb Ethernet", 1.125, 50e-6),
    "eth25": Link("25 Gb Ethernet", 2.81, 30e-6),
    "eth50": Link("50 Gb Ethernet", 5.62, 30e-6),
    "eth100": Link("100 Gb Ethernet", 11.25, 20e-6),
    "eth400": Link("400 Gb Ethernet", 45.0, 10e-6),
    "ib_edr": Link("InfiniBand EDR (100 Gb)", 12.2, 3e-6),
    "ib_hdr": Link("InfiniBand HDR (200 Gb)", 24.4, 3e-6),
}


def link(spec):
    """A Link from a name in LINKS or 'GB/s[@latency_us]' (e.g. '3.2@40')."""
    if isinstance(spec, Link):
        return spec
    if spec in LINKS:
        return LINKS[spec]
    try:
        bandwidth, _, latency = str(spec).partition("@")
        return Link(f"{float(bandwidth):g} GB/s", float(bandwidth),
                    float(latency or 20) * 1e-6)
    except ValueError:
        raise ValueError(f"unknown link {spec!r}: give one of {', '.join(LINKS)} or GB/s[@us]") \
            from None


@dataclasses.dataclass(frozen=True)
class Compute:
    """Seconds for one device's forward and backward pass: fixed + batch / images_per_s."""
    images_per_s: float
    fixed_s: float = 0.0
    shared: bool = False  # logical devices sharing one machine's cores (CPU replicas)
    # Measured with all the set-up's workers computing at once, apart (no all-reduce): the
    # slowdown of one worker's compute against it computing alone, and step times relative
    # to their mean (a synchronous step waits for the slowest worker's).
    contention: float = 1.0
    step_spread: tuple = ()

    @classmethod
    def from_two(cls, batch_a, seconds_a, batch_b, seconds_b, shared=False):
        """Fitted to the step time measured at two batch sizes."""
        per_image = (seconds_b - seconds_a) / (batch_b - batch_a)
        if per_image <= 0:
            return cls(batch_b / seconds_b, 0.0, shared)
        return cls(1 / per_image, max(0.0, seconds_a - batch_a * per_image), shared)

    def seconds(self, batch, devices_here=1):
        """One step's compute with `devices_here` devices of this kind on one machine. Shared
        ones compute their batches on the same cores, each at the whole line, fixed part
        included: that part is CPU work too (op dispatch, thread pools). Counted once, it
        would predict a speed-up for logical CPU replicas sharing the cores, where `bench
        scaling` measures a loss."""
        one = self.fixed_s + batch / self.images_per_s
        return one * devices_here if self.shared else one


@dataclasses.dataclass(frozen=True)
class Model:
    """What is reduced each step: gradient bytes and tensors (float32 gradients: the mixed
    policies keep float32 variables)."""
    gradient_bytes: float
    tensors: int

    @classmethod
    def of_keras(cls, model):
        variables = model.trainable_variables
        return cls(sum(4 * math.prod(v.shape) for v in variables), len(variables))

    def sent_in(self, allreduce_dtype):
        """The same gradients all-reduced in `allreduce_dtype` (--allreduce_dtype)."""
        return dataclasses.replace(
            self, gradient_bytes=self.gradient_bytes * WIRE_BYTES[allreduce_dtype] / 4)


WIRE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclasses.dataclass(frozen=True)
class Setup:
    devices: int = 1  # per machine
    machines: int = 1
    intra: Link = LINKS["pcie3"]
    inter: Link = LINKS["eth25"]
    algorithm: str = "ring"  # or "tree" (latency 2 log2(n) hops instead of 2 (n - 1))
    packed: bool = True  # gradients in few packs (one collective) or one collective per tensor
    packs: int = 1
    overlap: float = 0.0  # share of the backward pass the all-reduce may hide behind
    steps_per_call: int = 10
    call_overhead_s: float = 0.0  # host round trip per tf.function call
    # tfmulti's engine: the gradients' collective(s) each step, and once per call one more
    # (batch-norm statistics, with workers also the losses and the stop vote). Before it
    # reduced the loss each step: per_step_collectives=1, per_call_collectives=2.
    per_step_collectives: int = 0
    per_call_collectives: int = 1
    input_images_per_s: float = math.inf  # per machine


def expected_max(samples, k):
    """The expected largest of k independent draws from the samples (their empirical
    distribution): the sorted i-th of n is the largest with probability (i/n)^k - ((i-1)/n)^k."""
    x = sorted(samples)
    n = len(x)
    return sum(v * (((i + 1) / n) ** k - (i / n) ** k) for i, v in enumerate(x))


def straggler_share(step_spread, workers):
    """The expected wait for the slowest of `workers`, as a share of the mean step."""
    if not step_spread or workers < 2:
        return 0.0
    return expected_max(step_spread, workers) / (sum(step_spread) / len(step_spread)) - 1


def _hops(n, algorithm):
    if n <= 1:
        return 0
    return 2 * math.ceil(math.log2(n)) if algorithm == "tree" else 2 * (n - 1)


def allreduce_seconds(nbytes, setup, collectives=1):
    """(bandwidth term, latency term) of all-reducing nbytes over the setup's devices, in
    `collectives` separate collectives: inside each machine over its link, then between
    machines over the network (the hierarchical ring NCCL and Horovod use)."""
    n, m = setup.devices, setup.machines
    bandwidth = 0.0
    latency = 0.0
    if n > 1:
        bandwidth += 2 * (n - 1) / n * nbytes / (setup.intra.gbytes_per_s * 1e9)
        latency += _hops(n, "ring") * setup.intra.latency_s * collectives
    if m > 1:
        bandwidth += 2 * (m - 1) / m * nbytes / (setup.inter.gbytes_per_s * 1e9)
        latency += _hops(m, setup.algorithm) * setup.inter.latency_s * collectives
    return bandwidth, latency


@dataclasses.dataclass(frozen=True)
class Prediction:
    devices: int
    machines: int
    images_per_s: float
    speedup: float
    efficiency: float
    bound: str  # the largest term
    terms: dict  # seconds per step of each


def predict(compute: Compute, model: Model, setup: Setup, batch: int) -> Prediction:
    """Images/s, speed-up over one device and what bounds the step, at a per-device batch."""
    n, m = setup.devices, setup.machines
    compute_s = compute.seconds(batch, n)
    backward_s = compute_s * 2 / 3
    gradient_collectives = setup.packs if setup.packed else model.tensors
    grad_bw, grad_lat = allreduce_seconds(model.gradient_bytes, setup, gradient_collectives)
    _, small_lat = allreduce_seconds(
        0, setup, setup.per_step_collectives + setup.per_call_collectives / setup.steps_per_call)
    exposed = grad_bw + grad_lat
    hidden = min(exposed, setup.overlap * backward_s)
    terms = {"compute": compute_s}
    if compute.contention != 1.0 and n * m > 1:
        terms["contention"] = compute_s * (compute.contention - 1)
    if compute.step_spread:  # logical CPU devices of one process share their worker's pace
        terms["straggler"] = compute_s * compute.contention * straggler_share(
            compute.step_spread, m if compute.shared else n * m)
    terms |= {"all-reduce bandwidth": grad_bw * (1 - hidden / exposed) if exposed else 0.0,
              "all-reduce latency": grad_lat * (1 - hidden / exposed) + small_lat if exposed
              else small_lat,
              "host round trips": setup.call_overhead_s / setup.steps_per_call}
    step = sum(terms.values())
    input_s = n * batch / setup.input_images_per_s
    if input_s > step:
        terms["input pipeline"] = input_s - step  # what it adds
        step = input_s
    alone = compute.seconds(batch, 1) + setup.call_overhead_s / setup.steps_per_call
    rate = n * m * batch / step
    speedup = rate / (batch / alone)
    return Prediction(n, m, rate, speedup, speedup / (n * m),
                      max(terms, key=terms.get), terms)


def recommend_batch(compute, model, setup, choices=(16, 32, 64, 128, 256, 512, 1024),
                    efficiency=0.9):
    """The smallest per-device batch that keeps `efficiency` (None if none does)."""
    for batch in choices:
        if predict(compute, model, setup, batch).efficiency >= efficiency:
            return batch
    return None


def recommend_steps_per_call(setup, step_s, choices=(1, 2, 5, 10, 20, 50, 100), share=0.02):
    """The fewest steps per call that keep host round trips under `share` of a step."""
    for k in choices:
        if setup.call_overhead_s / k <= share * step_s:
            return k
    return choices[-1]


def allreduce_advice(compute, model, setup, batch, chosen, gain=1.03):
    """Advice to all-reduce the gradients in 16 bits when that is predicted to speed the
    step up by `gain` or more (a slow link), else ''."""
    if chosen != "float32":
        return ""
    now = predict(compute, model, setup, batch)
    halved = predict(compute, model.sent_in("float16"), setup, batch)
    if halved.speedup < gain * now.speedup:
        return ""
    return (f"--allreduce_dtype=float16 halves the gradients' all-reduce: {now.speedup:.2f}x "
            f"-> {halved.speedup:.2f}x predicted (sums rounded to 11 significant bits)")


BFLOAT16_SLOWER = 0.8  # below this share of float32's rate: slower beyond a timing's noise


def dtype_advice(float32_gflops, bfloat16_gflops, chosen):
    """A warning when the chosen mixed policy computes clearly slower than float32 on this
    machine (a CPU without native bfloat16 runs it at a fraction of float32's rate), else ''.
    Within 20% is left unsaid: two short timings on a shared machine differ by that much (and
    a CPU with bfloat16 but Eigen's kernels, without oneDNN, can run it somewhat below
    float32, near that threshold)."""
    if chosen == "mixed_bfloat16" and bfloat16_gflops < BFLOAT16_SLOWER * float32_gflops:
        return (f"--dtype=mixed_bfloat16 is slower than float32 on these devices (matmul "
                f"{bfloat16_gflops:.0f} against {float32_gflops:.0f} GFLOP/s: no native "
                "bfloat16); use --dtype=float32")
    return ""
