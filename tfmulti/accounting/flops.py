"""Model FLOPs utilization (MFU): the model's floating-point operations per training example,
counted from the graph of its training step, over the devices' peak. Counted as MFU counts
them: the multiply-adds of the convolutions, their two gradients and the matrix products, 2
FLOPs each, from each op's shapes; the element-wise ops are left out. (TensorFlow's
profiler counts a convolution's gradients from the input's size, which overcounts a
convolution without padding: 2x for LeNet's 5x5 ones.)

The peak is the fastest rate the step's own largest counted kernels reach (on a GPU each
timed on it; on the CPU as many copies at once as cores), or a large matmul's where that is
faster (Peak): the step's rate is its counted FLOPs over its time, a weighted mean of its
kernels' rates, so it cannot pass the fastest of them (a matmul's rate alone could: oneDNN's
convolutions can run faster than a large matmul, and an MFU over it would pass 100%).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import time
import weakref
from typing import Any

from tfmulti.distribution import devices

_CONVOLUTIONS = ("Conv2D", "Conv2DBackpropInput", "Conv2DBackpropFilter", "Conv3D",
                 "DepthwiseConv2dNative", "DepthwiseConv2dNativeBackpropInput",
                 "DepthwiseConv2dNativeBackpropFilter")


def graph_flops(graph: Any, loop_trips: int = 1) -> float:
    """The multiply-add FLOPs of a graph's convolutions and matrix products (shapes known)
    that its outputs need: ops nothing reads (the first layer's input gradient, when the
    inputs need none) are pruned before a step runs, and not counted. A function it calls is
    counted inside (XLA's compiled step); a loop's body counted loop_trips times (the
    micro-batches of --grad_accum_steps)."""
    live, stack = set(), [t.op for t in graph.outputs]
    while stack:
        op = stack.pop()
        if op.name in live:
            continue
        live.add(op.name)
        stack.extend(t.op for t in op.inputs)
        stack.extend(op.control_inputs)
    total = 0.0
    for op in graph.get_operations():
        if op.name not in live:
            continue
        if op.type in ("While", "StatelessWhile") and hasattr(op, "_body_graph"):
            total += loop_trips * graph_flops(op._body_graph)
        elif op.type in ("PartitionedCall", "StatefulPartitionedCall"):
            called = _called_graph(graph, op)
            total += graph_flops(called) if called is not None else 0.0
        else:
            total += op_flops(op)
    return total


def _called_graph(graph, op):
    """The graph of the function a call op runs, where the graph knows it."""
    name = op.get_attr("f").name
    while graph is not None:
        function = graph._functions.get(name) if hasattr(graph, "_functions") else None
        if function is not None:
            return getattr(function, "graph", None)
        graph = getattr(graph, "outer_graph", None)
    return None


def matmul_gflops(device: str, dtype: Any, size: int, repeats: int = 3,
                  warmups: int = 1) -> float:
    """GFLOP/s of a size x size matmul in dtype on device (best of repeats, after warmups:
    the first products on a CPU run at half the rate, its threads not yet spun up)."""
    import tensorflow as tf

    with tf.device(device):
        x = tf.random.stateless_uniform((size, size), seed=[1, 2], dtype=tf.float32)
        x = tf.cast(x, dtype)
        product = tf.function(lambda a: tf.reduce_sum(tf.cast(tf.matmul(a, a)[:1, :1],
                                                              tf.float32)))
        for _ in range(warmups):
            product(x).numpy()
        best = math.inf
        for _ in range(repeats):
            start = time.perf_counter()
            product(x).numpy()
            best = min(best, time.perf_counter() - start)
    return 2 * size ** 3 / best / 1e9


def op_flops(op: Any) -> float:
    """2 x the multiply-adds of one convolution (forward or gradient: each output or input
    gradient element is a dot product over the filter's window) or matrix product."""
    import numpy as np

    if op.type in _CONVOLUTIONS:
        filter_shape = _filter_shape(op)
        if filter_shape is None:
            return 0.0
        kh, kw, c_in, c_out = filter_shape[:4] if len(filter_shape) == 4 else (
            *filter_shape[:2], filter_shape[-2], filter_shape[-1])
        # the product of the forward convolution's output shape with its window
        out = op.outputs[0].shape if op.type in ("Conv2D", "Conv3D",
                                                 "DepthwiseConv2dNative") else \
            op.inputs[2].shape
        if "Depthwise" in op.type:
            return 2.0 * float(np.prod(out)) * kh * kw
        return 2.0 * float(np.prod(out)) * kh * kw * c_in
    if op.type in ("MatMul", "BatchMatMulV2", "BatchMatMulV3"):
        a = op.inputs[0].shape
        transpose_a = op.get_attr("transpose_a") if op.type == "MatMul" else op.get_attr("adj_x")
        k = a[-2] if transpose_a else a[-1]
        return 2.0 * float(np.prod(op.outputs[0].shape)) * k
    return 0.0


def _filter_shape(op):
    """The forward convolution's filter shape [kh, kw, in, out], or None if unknown."""
    shape = op.outputs[0].shape if op.type.endswith("BackpropFilter") else op.inputs[1].shape
    return None if not shape.is_fully_defined() else shape.as_list()


def per_example_in_step(traced: Any, examples_per_step: float, micro_batches: int = 1
                        ) -> float:
    """The model FLOPs of one training example: those of one step of the traced training
    function (`traced`, a ConcreteFunction whose one while loop's body is a step: every local
    replica's forward and backward pass, in micro_batches) over the examples this worker's
    replicas take in a step; 0 where it cannot be counted."""
    try:
        [loop] = [op for op in traced.graph.get_operations()
                  if op.type in ("While", "StatelessWhile")]
        return graph_flops(loop._body_graph, micro_batches) / examples_per_step
    except Exception:  # noqa: BLE001 -- a report, never a reason to stop the run
        return 0.0


@dataclasses.dataclass(frozen=True)
class StepCost:
    """A training step's cost, counted from its trace: the model FLOPs of one example (0:
    they could not be counted; None: no step traced yet) and its counted kernels (for Peak)."""
    per_example: float | None = None
    kernels: tuple = ()


_COSTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # engine -> its StepCost


def step_cost(eng: Any) -> StepCost:
    """The step cost of an engine (training/engine.py), counted once from the training call
    it traced first (its traced_call), as each worker's replicas take global_batch_size /
    workers examples a step in grad_accum_steps micro-batches; StepCost() before that call."""
    if getattr(eng, "traced_call", None) is None:
        return StepCost()
    if eng not in _COSTS:
        _COSTS[eng] = StepCost(
            per_example_in_step(eng.traced_call, eng.global_batch_size / eng.workers,
                                eng.grad_accum_steps), kernels_in_step(eng.traced_call))
    return _COSTS[eng]


def utilization(flops_per_example: float | None, examples_per_sec: float,
                peak: float | None) -> float | None:
    """Model FLOPs utilization: the model's FLOP/s at this speed over the devices' peak (a
    share), or None when either is unknown (0 or None)."""
    if not flops_per_example or not peak:
        return None
    return flops_per_example * examples_per_sec / peak


PEAKS = {}  # (device, dtype) -> its matmul GFLOP/s, measured once per process


def matmul_peak(strategy: Any, dtype: str) -> float:
    """A matmul's rate in the compute dtype on this worker's first device (best of 5 after
    3, once per process), in GFLOP/s (a GPU's 4096x4096 product, a CPU's 1024x1024)."""
    import tensorflow as tf

    device = strategy.extended.worker_devices[0]
    gpu = "GPU" in device.upper()
    if (device, dtype) not in PEAKS:
        compute = {"mixed_bfloat16": tf.bfloat16, "mixed_float16": tf.float16}.get(dtype,
                                                                                   tf.float32)
        # 1024 on a CPU: a smaller matmul runs below the thread's rate, and 0.2 s is all
        # 1024 costs
        PEAKS[device, dtype] = matmul_gflops(device, compute, 4096 if gpu else 1024,
                                             repeats=5, warmups=3)
    return PEAKS[device, dtype]


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One counted op of a traced step, as it can be run alone: its type, its inputs (a
    (shape, dtype) to fill, or the constant a size input holds), its attributes, its FLOPs."""
    op_type: str
    inputs: tuple
    attrs: tuple
    flops: float

    def run(self, filled: list) -> Any:
        import tensorflow as tf

        return getattr(tf.raw_ops, self.op_type)(**dict(filled), **dict(self.attrs))


_SIZE_INPUTS = ("input_sizes", "filter_sizes")  # a gradient's shape, a constant of the graph


def kernels_in_step(traced: Any) -> tuple[Kernel, ...]:
    """The distinct counted kernels (op_flops > 0, shapes known) of a traced training call
    (a ConcreteFunction, as per_example_in_step takes it), largest first; () where it cannot
    tell."""
    try:
        [loop] = [op for op in traced.graph.get_operations()
                  if op.type in ("While", "StatelessWhile")]
        found = {}
        _collect_kernels(loop._body_graph, found)
        return tuple(sorted(found.values(), key=lambda k: -k.flops))
    except Exception:  # noqa: BLE001 -- a report, never a reason to stop the run
        return ()


def _collect_kernels(graph: Any, found: dict) -> None:
    for op in graph.get_operations():
        if op.type in ("PartitionedCall", "StatefulPartitionedCall"):
            called = _called_graph(graph, op)
            if called is not None:
                _collect_kernels(called, found)
            continue
        if op.type in ("While", "StatelessWhile") and hasattr(op, "_body_graph"):
            _collect_kernels(op._body_graph, found)
            continue
        counted = op_flops(op)
        if not counted:
            continue
        names = [arg.name for arg in op.op_def.input_arg]
        inputs = []
        for name, tensor in zip(names, op.inputs):
            if name in _SIZE_INPUTS:  # the gradient's shape: the forward input's or filter's
                inputs.append((name, ("size", tuple(op.outputs[0].shape.as_list()))))
            elif tensor.shape.is_fully_defined():
                inputs.append((name, ("fill", tuple(tensor.shape.as_list()),
                                      tensor.dtype.name)))
            else:
                break
        else:
            attrs = tuple((a.name, op.get_attr(a.name)) for a in op.op_def.attr
                          if a.name != "T")
            attrs = tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in attrs)
            kernel = Kernel(op.type, tuple(inputs), attrs, counted)
            found.setdefault((kernel.op_type, kernel.inputs, kernel.attrs), kernel)


KERNEL_RATES = {}  # (device, Kernel, side by side) -> its GFLOP/s, measured once per process


def kernel_gflops(device: str, kernel: Kernel, side_by_side: int = 1, repeats: int = 2
                  ) -> float:
    """GFLOP/s of `kernel` on `device`, `side_by_side` copies of it at once (each from a
    thread of its own, eagerly: no tracing; the result read back), the better of `repeats`
    rounds after one to warm up; 0 where it cannot run there. On a CPU, as many copies as
    cores give the most the cores do with this kernel, whatever the threads of one op."""
    import tensorflow as tf

    key = (device, kernel, side_by_side)
    if key in KERNEL_RATES:
        return KERNEL_RATES[key]
    rate = 0.0
    try:
        with tf.device(device):
            filled = [(name, tf.constant(spec[1], tf.int32) if spec[0] == "size" else
                       tf.cast(tf.random.stateless_uniform(spec[1], seed=[1, 2]), spec[2]))
                      for name, spec in kernel.inputs]

        def once():
            with tf.device(device):
                tf.reshape(kernel.run(filled), [-1])[:1].numpy()  # waits for it (a GPU too)

        best = math.inf
        with concurrent.futures.ThreadPoolExecutor(side_by_side) as pool:
            for turn in range(repeats + 1):
                start = time.perf_counter()
                for done in [pool.submit(once) for _ in range(side_by_side)]:
                    done.result()
                if turn:
                    best = min(best, time.perf_counter() - start)
        rate = side_by_side * kernel.flops / best / 1e9
    except Exception:  # noqa: BLE001 -- a kernel that cannot run alone is not a peak
        rate = 0.0
    KERNEL_RATES[key] = rate
    return rate


# The step's kernels timed for the peak: those with the most FLOPs (a full-width ResNet-18
# has 36; its fastest are among its largest, and the small ones run far below them)
TIMED_KERNELS = 8


class Peak:
    """The peak FLOP/s the MFU divides by, for this worker's devices (strategy: a
    tf.distribute.Strategy) in the run's dtype: the faster of a matmul's and, once the step is
    traced (of_step), the fastest of its own counted kernels' (the TIMED_KERNELS largest);
    times the workers. A GPU's kernel is timed on the first GPU, times the worker's GPUs; on
    a CPU, as many copies of it at once as the process has cores (kernel_gflops): the CPU
    replicas share those cores, and a step runs its ops side by side too. `source` says which
    rate it is."""

    def __init__(self, strategy: Any, dtype: str):
        self.device = strategy.extended.worker_devices[0]
        local = len(strategy.extended.worker_devices)
        self.workers = strategy.num_replicas_in_sync // local
        self.gpu = "GPU" in self.device.upper()
        # a GPU: each of this worker's; the CPU: its cores, whatever the replicas
        self.copies = local if self.gpu else 1
        self.gflops = matmul_peak(strategy, dtype) * local  # a CPU replica's share each
        self.source = "matmul"
        self._kernels = None

    @property
    def flops(self) -> float:
        return self.gflops * 1e9 * self.workers

    def of_step(self, kernels: tuple[Kernel, ...]) -> float:
        """The peak FLOP/s once the step's kernels are known (measured the first time)."""
        if kernels and self._kernels is None:
            self._kernels = kernels
            side_by_side = 1 if self.gpu else devices.usable_cores()
            rates = [(kernel_gflops(self.device, k, side_by_side) * self.copies, k.op_type)
                     for k in kernels[:TIMED_KERNELS]]
            fastest, op_type = max(rates)
            if fastest > self.gflops:
                self.gflops, self.source = fastest, op_type
        return self.flops
