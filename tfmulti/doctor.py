"""Preflight: says what is wrong before a long run starts, with the main job's flags.

    python -m tfmulti.doctor --num_gpus=2 --model_dir=runs/big --data_dir=/data/fashion
    docker run --gpus all ... --entrypoint python3 tfmulti -m tfmulti.doctor --num_gpus=2

Reports the devices (GPUs with memory and compute capability, logical CPU replicas), the
TensorFlow, CUDA, cuDNN and NCCL versions, the strategy the main job would pick, and runs a
small all-reduce across every replica under --doctor_timeout, checking its sum and measuring
its bandwidth. Then /dev/shm (in containers), --model_dir and the data set. Exit 0 when the
flags would run; otherwise one `problem:` line per problem and exit 1. Nothing is written.
"""
import dataclasses
import os
import subprocess
import sys
import tempfile
import time

from tfmulti import cli  # first: it imports TensorFlow quietly
from tfmulti.distribution import allocator, child, devices, gpulibs  # noqa: E402
from tfmulti.training import data
from tfmulti.performance import advise, progress, stepmodel
from tfmulti.run.plan import run_plan
from tfmulti.errors import UserError  # noqa: E402

import tensorflow as tf  # noqa: E402

SHM_MIN_BYTES = 1 << 30  # NCCL keeps its intra-node buffers in /dev/shm; Docker's default is 64 MB
HANG_CAUSES = (
    "the usual causes: a small /dev/shm in a container (docker run --shm-size=1g, or --ipc=host),"
    " IOMMU enabled (NCCL peer-to-peer copies stall; NCCL_P2P_DISABLE=1 to confirm), GPUs "
    "without working peer-to-peer (nvidia-smi topo -m; NCCL_P2P_LEVEL), or, across machines, a "
    "worker that is not running or not reachable")


class Report:
    def __init__(self, out=sys.stdout):
        self.problems, self.out = [], out

    def info(self, label, text):
        print(f"{label:>11}: {text}", file=self.out, flush=True)

    def warn(self, text):
        """Something that runs, but not as the user expects: no effect on the exit code."""
        print(f"{'WARNING':>11}: {text}", file=self.out, flush=True)

    def problem(self, text):
        self.problems.append(text)
        print(f"{'PROBLEM':>11}: {text}", file=self.out, flush=True)


# ----------------------------------------------------------------------------- versions, devices

def versions():
    """TensorFlow's own build info (CUDA, cuDNN), and NCCL as the wheel that brings it says."""
    from importlib import metadata

    build = tf.sysconfig.get_build_info()
    parts = [f"TensorFlow {tf.__version__}"]
    if build.get("is_cuda_build"):
        parts.append(f"CUDA {build.get('cuda_version', '?')}, cuDNN {build.get('cudnn_version', '?')}")
    else:
        parts.append("not a CUDA build")
    nccl = "not installed"
    for dist in ("nvidia-nccl-cu12", "nvidia-nccl-cu13", "nvidia-nccl-cu11"):
        try:
            nccl = f"{metadata.version(dist)} ({dist})"
            break
        except metadata.PackageNotFoundError:
            continue
    parts.append(f"NCCL {nccl}")
    return ", ".join(parts)


SMI_QUERY = "index,uuid,pci.bus_id,name,memory.total"


def nvidia_smi_rows():
    """nvidia-smi's GPUs as dicts (index, uuid, pci.bus_id, name, memory.total); [] without it."""
    try:
        smi = subprocess.run(["nvidia-smi", f"--query-gpu={SMI_QUERY}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return []
    keys = SMI_QUERY.split(",")
    return [dict(zip(keys, (x.strip() for x in line.split(","))))
            for line in smi.stdout.splitlines() if line.count(",") == len(keys) - 1]


def smi_row_of_each_gpu(count, rows, visible=None, order="PCI_BUS_ID"):
    """The nvidia-smi row of each of TensorFlow's `count` GPUs, or None where it cannot be
    told. TensorFlow's GPU i is the i-th of CUDA_VISIBLE_DEVICES (indices or UUIDs), or of
    all GPUs, in CUDA's order, which is nvidia-smi's only in PCI bus order."""
    if order != "PCI_BUS_ID":
        return [None] * count
    by_index = {row["index"]: row for row in rows}
    if visible is None:
        return [by_index.get(str(i)) for i in range(count)]
    chosen = []
    for item in (v.strip() for v in visible.split(",") if v.strip()):
        match = by_index.get(item) or next(
            (row for row in rows if row["uuid"].startswith(item) and item.startswith("GPU-")), None)
        chosen.append(match)
    return (chosen + [None] * count)[:count]


def gpu_lines(physical, rows=None, environ=os.environ):
    """One line per GPU TensorFlow sees (physical: their get_device_details): name, compute
    capability, and nvidia-smi's index, bus and memory for that very GPU."""
    rows = nvidia_smi_rows() if rows is None else rows
    matched = smi_row_of_each_gpu(len(physical), rows, environ.get("CUDA_VISIBLE_DEVICES"),
                                  environ.get("CUDA_DEVICE_ORDER", "FASTEST_FIRST"))
    lines = []
    for i, (details, row) in enumerate(zip(physical, matched)):
        cc = details.get("compute_capability")
        name = details.get("device_name", "GPU")
        if row is not None:
            smi = (f"nvidia-smi GPU {row['index']} ({row['pci.bus_id']}), memory "
                   f"{row['memory.total']}")
        elif rows:
            smi = "memory unknown (its nvidia-smi row cannot be told in this GPU order)"
        else:
            smi = "memory unknown (no nvidia-smi)"
        lines.append(f"GPU {i}: {name}, compute capability "
                     f"{'.'.join(map(str, cc)) if cc else '?'}, {smi}")
    return lines


def describe_strategy(plan, cluster):
    if cluster:
        workers = len(cluster["cluster"].get("worker", [])) + len(cluster["cluster"].get("chief", []))
        ops = "NCCL" if plan.kind == "gpu" else "gRPC ring"
        return (f"MultiWorkerMirroredStrategy, {workers} workers x {plan.count} "
                f"{plan.kind.upper()} replica{'s' if plan.count > 1 else ''} ({ops} all-reduce)")
    if plan.count == 1:
        return f"OneDeviceStrategy on {plan.devices[0]}"
    ops = "NcclAllReduce" if plan.kind == "gpu" else "the default cross-device ops"
    return f"MirroredStrategy over {', '.join(plan.devices)} ({ops})"


# ----------------------------------------------------------------------------- all-reduce

def _probe_child(send, plan, cluster, megabytes, threads, worker_timeout):
    """The all-reduce probe's process: its own runtime, devices and strategy. A hung
    collective holds the runtime, and often Python's lock, so only a process of its own can
    be given up on."""
    try:
        devices.configure(plan, *threads)
        strategy = (devices.make_multi_worker_strategy(cluster, plan, worker_timeout) if cluster
                    else devices.make_strategy(plan))
        n = strategy.num_replicas_in_sync
        kernels = kernel_probe(strategy)
        cudnn = gpulibs.cudnn_loaded_version() if plan.kind == "gpu" else None
        send.send({"replicas": n, "local": len(strategy.extended.worker_devices),
                   "kernels": kernels, "cudnn": cudnn,
                   "allreduce": None if n == 1 else allreduce_probe(strategy, megabytes),
                   "latency": None if n == 1 else allreduce_probe(strategy, 4 / (1 << 20))[0]})
    except Exception as e:  # noqa: BLE001 - the parent reports it
        send.send(_sendable(e))


def _sendable(error):
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


# ----------------------------------------------------------------------------- files and data

def in_container():
    if os.path.exists("/.dockerenv") or os.path.exists("/run/.containerenv"):
        return True
    try:
        with open("/proc/1/cgroup") as f:
            text = f.read()
    except OSError:
        return False
    return any(word in text for word in ("docker", "kubepods", "containerd", "libpod"))


def shm_size(path="/dev/shm"):
    try:
        stats = os.statvfs(path)
    except OSError:
        return None
    return stats.f_frsize * stats.f_blocks


def shm_check(report, plan, container, size):
    shown = "missing" if size is None else f"{size / (1 << 20):.0f} MiB"
    needs = plan.kind == "gpu" and plan.count > 1
    if container and needs and (size is None or size < SHM_MIN_BYTES):
        report.problem(f"/dev/shm is {shown} in this container; NCCL across {plan.count} GPUs needs "
                       "more: run the container with --shm-size=1g (or --ipc=host)")
    else:
        report.info("/dev/shm", f"{shown}{' (in a container)' if container else ''}")


def model_dir_check(report, model_dir):
    """Writable without writing anything that stays: a probe file in the directory or its
    nearest existing parent (the main job creates the rest)."""
    target = model_dir or "runs"
    if os.path.exists(target) and not os.path.isdir(target):
        report.problem(f"--model_dir={target} is a file, not a directory")
        return
    existing = os.path.abspath(target)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        report.problem(f"--model_dir={target}: {existing} is a file, not a directory")
        return
    try:
        fd, probe = tempfile.mkstemp(prefix=".tfmulti-doctor-", dir=existing)
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        report.problem(f"--model_dir={target} is not writable ({existing}: {e.strerror})")
        return
    where = "exists" if os.path.isdir(target) else f"will be created under {existing}"
    report.info("model_dir", f"{target} ({where}, writable)")


def data_check(report, dataset, data_dir, check_network=data.check_download_host):
    if dataset == "synthetic":
        report.info("data", "the embedded synthetic set (not Fashion-MNIST), nothing to fetch")
        return
    if data_dir is not None and not os.path.isdir(data_dir):
        report.problem(f"--data_dir={data_dir} is not a directory")
        return
    if data_dir is not None and data.has_idx_files(data_dir):
        try:
            loaded = data.load_idx_dir(data_dir)
        except UserError as e:
            report.problem(str(e))
            return
        report.info("data", f"Fashion-MNIST IDX files in {data_dir}: "
                    f"{len(loaded.train_images)} + {len(loaded.test_images)} images, all readable")
        return
    import tensorflow_datasets as tfds

    builder = tfds.builder("fashion_mnist", data_dir=data_dir)
    if builder.is_prepared():
        report.info("data", f"Fashion-MNIST prepared by tensorflow-datasets in {builder.data_dir}")
        return
    url = data.download_url(builder)
    try:
        check_network(url)
    except OSError as e:
        report.problem(f"Fashion-MNIST is not in {data_dir or 'the TFDS data_dir'} and cannot be "
                       f"downloaded ({e}); mount --data_dir=DIR with the four IDX files or a "
                       "prepared TFDS data_dir, or use --dataset=synthetic")
        return
    report.info("data", f"Fashion-MNIST not downloaded yet; {url} is reachable (the main job "
                "downloads it)")


# ----------------------------------------------------------------------------- entry point

def main():
    FLAGS = cli.FLAGS
    report = Report()
    report.info("versions", versions())
    cluster = None
    try:
        cfg = cli.run_config()
        cluster = devices.cluster_config(cfg.worker_hosts, cfg.task_index,
                                         os.environ.get("TF_CONFIG"))
        plan = cli.device_plan(cfg)
    except UserError as e:
        plan = None
        report.problem(str(e))
    if plan is not None and not cluster:
        try:
            run_plan(cfg, plan.count)
        except UserError as e:
            report.problem(str(e))
    physical = [tf.config.experimental.get_device_details(g)
                for g in tf.config.list_physical_devices("GPU")]
    for line in gpu_lines(physical):
        report.info("device", line)
    if not physical and tf.sysconfig.get_build_info().get("is_cuda_build"):
        report.info("gpu", f"none found ({cli.why_no_gpu() or 'the driver lists no GPU'})")
    cores = devices.usable_cores()
    report.info("cpu", f"{cores} core{'s' if cores > 1 else ''} usable by this process")
    used, hint = allocator.describe()
    report.info("malloc", used)
    if hint:
        report.warn(hint)
    container = in_container()
    if plan is not None and plan.kind == "cpu":
        report.info("device", f"{plan.count} logical CPU replica{'s' if plan.count > 1 else ''}"
                    f" ({', '.join(plan.devices)}) on the {cores} core{'s' if cores > 1 else ''}")
    if plan is not None:
        report.info("strategy", describe_strategy(plan, cluster))
        threads = (FLAGS.intra_op_threads, FLAGS.inter_op_threads)
        probed = check_allreduce(report, plan, cluster, threads, FLAGS.doctor_allreduce_mb,
                                 FLAGS.doctor_timeout, FLAGS.worker_timeout)
        if FLAGS.doctor_predict and FLAGS.measure_budget <= 0:
            report.problem(f"--measure_budget={FLAGS.measure_budget:g}: must be positive "
                           "(seconds)")
        if probed is not None and FLAGS.doctor_predict and not report.problems:
            check_prediction(report, plan, cfg, threads, probed, FLAGS.doctor_allreduce_mb,
                             FLAGS.doctor_timeout, FLAGS.measure_budget)
        shm_check(report, plan, container, shm_size())
    model_dir_check(report, FLAGS.model_dir)
    data_check(report, FLAGS.dataset, FLAGS.data_dir)
    finish(report)


def check_allreduce(report, plan, cluster, threads, megabytes, timeout,
                    worker_timeout=devices.WORKER_TIMEOUT):
    """Makes the strategy (a multi-worker one waits worker_timeout s for its peers) and runs
    the probe, in a process of its own, under `timeout`."""
    try:
        # Beside a training job on the same GPUs: memory as needed.
        probe_plan = dataclasses.replace(plan, memory_growth=plan.kind == "gpu")
        value = child.run(_probe_child, (probe_plan, cluster, megabytes, threads, worker_timeout),
                          timeout,
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


# ----------------------------------------------------------------------------- prediction

def _measure_child(send, plan, cfg, threads, budget_s):
    """One replica's training step at the per-replica batch, and the matmul rates, measured
    as `bench predict` measures (advise.measure_here), in a process of its own (the training
    job's devices, as the probe's). A progress bar only on a terminal."""
    try:
        devices.configure(plan, *threads)
        per_replica = run_plan(cfg, plan.count).per_replica_batch_size
        bar = progress.Bar(budget_s, piped_lines=False)
        try:
            measured = advise.measure_here(plan.devices[0], cfg.model, cfg.width, cfg.dtype,
                                           per_replica, budget_s, bar=bar)
        finally:
            bar.close()
        send.send(measured)
    except Exception as e:  # noqa: BLE001 - the parent reports it
        send.send(_sendable(e))


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
    return stepmodel.Link("measured", bus_bandwidth(megabytes, replicas, probed["allreduce"][0]),
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
    advice = advise.advise(compute, model, setup, measured, cfg.dtype, cfg.allreduce_dtype)
    if advice.dtype:
        report.warn(advice.dtype)
    report.info("recommended", f"for {where}: {advice.recommendation}")
    if advice.allreduce:
        report.info("advice", advice.allreduce)


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
                    f"ms, sums right, bus bandwidth {bus_bandwidth(megabytes, n, seconds):.2f} GB/s")


def finish(report):
    if report.problems:
        print(f"tfmulti doctor: {len(report.problems)} problem"
              f"{'s' if len(report.problems) > 1 else ''}:", file=sys.stderr)
        for problem in report.problems:
            print(f"  problem: {problem}", file=sys.stderr)
        sys.exit(1)
    print("tfmulti doctor: no problems; these flags would run")


if __name__ == "__main__":
    cli.run(main, "doctor")
