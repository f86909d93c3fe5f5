"""The doctor's probes, each in a process of its own: a small all-reduce across every replica
(its sum checked, its bandwidth measured, a hang bounded by --doctor_timeout) and a
convolution and batch norm on every replica's device.
"""
import dataclasses
import time

import tensorflow as tf

from tfmulti.distribution import gpulibs
from tfmulti.errors import UserError
from tfmulti.processes import child

HANG_CAUSES = (
    "the usual causes: a small /dev/shm in a container (docker run --shm-size=1g, or --ipc=host),"
    " IOMMU enabled (NCCL peer-to-peer copies stall; NCCL_P2P_DISABLE=1 to confirm), GPUs "
    "without working peer-to-peer (nvidia-smi topo -m; NCCL_P2P_LEVEL), or, across machines, a "
    "worker that is not running or not reachable")


def describe_strategy(plan, cluster):
    if cluster:
        workers = (len(cluster["cluster"].get("worker", []))
                   + len(cluster["cluster"].get("chief", [])))
        ops = "NCCL" if plan.kind == "gpu" else "gRPC ring"
        return (f"MultiWorkerMirroredStrategy, {workers} workers x {plan.count} "
                f"{plan.kind.upper()} replica{'s' if plan.count > 1 else ''} ({ops} all-reduce)")
    if plan.count == 1:
        return f"OneDeviceStrategy on {plan.devices[0]}"
    ops = "NcclAllReduce" if plan.kind == "gpu" else "the default cross-device ops"
    return f"MirroredStrategy over {', '.join(plan.devices)} ({ops})"


def _probe_child(send, start, megabytes):
    """The all-reduce probe's process: its own runtime, devices and strategy (`start`, a
    Startup). A hung collective holds the runtime, and often Python's lock, so only a process
    of its own can be given up on."""
    try:
        strategy = start.start()
        plan = start.plan
        n = strategy.num_replicas_in_sync
        kernels = kernel_probe(strategy)
        cudnn = gpulibs.cudnn_loaded_version() if plan.kind == "gpu" else None
        send.send({"replicas": n, "local": len(strategy.extended.worker_devices),
                   "kernels": kernels, "cudnn": cudnn,
                   "allreduce": None if n == 1 else allreduce_probe(strategy, megabytes),
                   "latency": None if n == 1 else allreduce_probe(strategy, 4 / (1 << 20))[0]})
    except Exception as e:  # noqa: BLE001 - the parent reports it
        send.send(sendable(e))


def sendable(error):
    """A child's failure as the parent reports it: a UserError as it is, anything else as
    its type and first line."""
    if isinstance(error, UserError):
        return error
    first = str(error).splitlines()[0][:300] if str(error) else ""
    return RuntimeError(f"{type(error).__name__}: {first}")


def kernel_probe(strategy):
    """A 3x3 convolution and a fused batch norm, forward and backward, on every replica's
    device: on GPUs these are cuDNN's kernels, the first thing a cuDNN that does not match
    TensorFlow breaks. Returns (this worker's replica devices, None) or (them, the error)."""
    def replica_fn():
        x = tf.random.stateless_normal([4, 8, 8, 3], seed=[1, 2])
        w = tf.random.stateless_normal([3, 3, 3, 8], seed=[3, 4])
        scale, offset = tf.ones([8]), tf.zeros([8])
        with tf.GradientTape() as tape:
            tape.watch([x, w, scale])
            y = tf.nn.conv2d(x, w, 1, "SAME")
            z, _, _ = tf.compat.v1.nn.fused_batch_norm(y, scale, offset, is_training=True)
            loss = tf.reduce_sum(z * y)
        grads = tape.gradient(loss, [x, w, scale])
        return tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in grads])

    names = [d.split("device:")[-1] for d in strategy.extended.worker_devices]
    try:
        finite = strategy.run(tf.function(replica_fn))
        results = [bool(v.numpy()) for v in strategy.experimental_local_results(finite)]
    except (tf.errors.OpError, RuntimeError) as e:
        return names, (getattr(e, "message", None) or str(e)).strip().splitlines()[0][:300]
    if not all(results):
        bad = [name for name, ok in zip(names, results) if not ok]
        return names, f"non-finite gradients on {', '.join(bad)}"
    return names, None


def allreduce_probe(strategy, megabytes, repeats=5):
    """Sums a float32 tensor of `megabytes` per replica across all replicas; returns
    (seconds per all-reduce, whether every replica got the right sum). Replica i sends i+1."""
    n = strategy.num_replicas_in_sync
    elements = max(1, int(megabytes * (1 << 20)) // 4)

    def replica_fn():
        context = tf.distribute.get_replica_context()
        value = tf.fill([elements], tf.cast(context.replica_id_in_sync_group + 1, tf.float32))
        return context.all_reduce(tf.distribute.ReduceOp.SUM, value)

    @tf.function
    def step():
        return strategy.run(replica_fn)

    result = step()  # traces, sets up the communicators (NCCL's first call is the slow one)
    expected = n * (n + 1) / 2
    correct = all(float(tf.reduce_min(v)) == expected == float(tf.reduce_max(v))
                  for v in strategy.experimental_local_results(result))
    start = time.perf_counter()
    for _ in range(repeats):
        result = step()
    for v in strategy.experimental_local_results(result):
        v.numpy()
    return (time.perf_counter() - start) / repeats, correct


def bus_bandwidth(megabytes, replicas, seconds):
    """GB/s as nccl-tests report an all-reduce: size x 2(n-1)/n over the time."""
    return megabytes * (1 << 20) * 2 * (replicas - 1) / replicas / seconds / 1e9


def check_allreduce(report, start, megabytes, timeout):
    """Makes the strategy of `start` (a Startup: a multi-worker one waits its worker_timeout
    for its peers) and runs the probe, in a process of its own, under `timeout`."""
    plan = start.plan
    try:
        # Beside a training job on the same GPUs: memory as needed; never seeded.
        probe = dataclasses.replace(start, seed=None, plan=dataclasses.replace(
            plan, memory_growth=plan.kind == "gpu"))
        value = child.run(_probe_child, (probe, megabytes), timeout,
                          what="the all-reduce probe's process")
    except TimeoutError:
        report.problem(f"setting up the replicas and an all-reduce of {megabytes:g} MB across "
                       f"them did not finish in {timeout:g} s; {HANG_CAUSES}")
        return
    except child.Died as e:
        value = e
    if isinstance(value, UserError):
        report.problem(str(value))
    elif isinstance(value, Exception):
        report.problem(f"the all-reduce failed: {value}")
    else:
        report_kernels(report, value["kernels"], value["cudnn"], plan)
        report_allreduce(report, value["replicas"], value["allreduce"], megabytes)
        return value
    return None


def report_kernels(report, kernels, cudnn, plan, build=None):
    build = tf.sysconfig.get_build_info() if build is None else build
    names, error = kernels
    if error is not None:
        report.problem(f"a convolution or fused batch norm failed on {', '.join(names)}: {error}"
                       + ("; a cuDNN other than TensorFlow's is the usual cause" if
                          plan.kind == "gpu" else ""))
    else:
        report.info("kernels", f"3x3 convolution and fused batch norm, forward and backward, "
                    f"ran on {', '.join(names)}")
    if plan.kind == "gpu":
        mismatch = gpulibs.cudnn_problem(cudnn, build, tf.__version__)
        if mismatch:
            report.problem(mismatch)
        else:
            report.info("cudnn", f"{'.'.join(map(str, cudnn)) if cudnn else 'not loaded'} "
                        f"(TensorFlow built with cuDNN {build.get('cudnn_version', '?')})")


def report_allreduce(report, n, result, megabytes):
    if result is None:
        report.info("all-reduce", "one replica, nothing to reduce")
    else:
        seconds, correct = result
        if not correct:
            report.problem(f"the all-reduce across {n} replicas returned wrong sums: the devices"
                           f" do not exchange data correctly; {HANG_CAUSES}")
            return
        report.info("all-reduce", f"{megabytes:g} MB across {n} replicas in {seconds * 1e3:.1f} "
                    "ms, sums right, bus bandwidth "
                    f"{bus_bandwidth(megabytes, n, seconds):.2f} GB/s")
