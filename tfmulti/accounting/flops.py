"""Model FLOPs utilization (MFU): the model's floating-point operations per training example,
counted from the graph of its training step, and the devices' peak (a matmul's rate). Counted
as MFU counts them: the multiply-adds of the convolutions, their two gradients and
the matrix products, 2 FLOPs each, from each op's shapes; the element-wise ops are left out.
(TensorFlow's profiler counts a convolution's gradients from the input's size, which
overcounts a convolution without padding: 2x for LeNet's 5x5 ones.)
"""
from __future__ import annotations

import math
import time
from typing import Any

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


def utilization(flops_per_example: float | None, examples_per_sec: float,
                peak: float | None) -> float | None:
    """Model FLOPs utilization: the model's FLOP/s at this speed over the devices' peak (a
    share), or None when either is unknown (0 or None)."""
    if not flops_per_example or not peak:
        return None
    return flops_per_example * examples_per_sec / peak


PEAKS = {}  # (device, dtype) -> its matmul GFLOP/s, measured once per process


def peak_flops(strategy: Any, dtype: str) -> float:
    """The peak FLOP/s of this worker's devices for model FLOPs utilization: a matmul's rate
    in the compute dtype on its first device (best of 5 after 3, once per process), times
    its replicas (GPUs, or CPU replicas each on its share of the cores), times the workers
    (strategy: a tf.distribute.Strategy)."""
    import tensorflow as tf

    device = strategy.extended.worker_devices[0]
    gpu = "GPU" in device.upper()
    if (device, dtype) not in PEAKS:
        compute = {"mixed_bfloat16": tf.bfloat16, "mixed_float16": tf.float16}.get(dtype,
                                                                                   tf.float32)
        # 1024 on a CPU: 512 ran 15% below it on one replica's thread here (82 against 96
        # GFLOP/s, 4 processes), and 0.2 s is all 1024 costs
        PEAKS[device, dtype] = matmul_gflops(device, compute, 4096 if gpu else 1024,
                                             repeats=5, warmups=3)
    # A GPU's product runs on that GPU; a CPU replica's on its share of the cores (its
    # thread pool: cores / replicas, devices.cpu_thread_pools), so each replica of every
    # worker is counted
    return PEAKS[device, dtype] * 1e9 * strategy.num_replicas_in_sync
