"""Devices and the strategy factory: the one place that decides where replicas run.

`plan_devices` turns the flags into a plain (kind, count); `configure` sets up the runtime
before it starts (logical CPU devices, thread pools, GPU thread mode); `make_strategy` builds
the tf.distribute strategy. Tests skip `configure` and inject their own logical devices.
"""
import dataclasses
import json
import os

import tensorflow as tf

from tfmulti.errors import UsageError


@dataclasses.dataclass(frozen=True)
class DevicePlan:
    kind: str  # "gpu" or "cpu"
    count: int  # replicas

    @property
    def devices(self):
        """TensorFlow device names, one per replica: ['/GPU:0', '/GPU:1']."""
        return [f"/{self.kind.upper()}:{i}" for i in range(self.count)]


def plan_devices(num_gpus, cpu_replicas, gpus_available, why_none=""):
    """Where to train. num_gpus: None (all GPUs, else the CPU), 0 (CPU), -1 (all GPUs), N.

    why_none: what TensorFlow said when it found no GPU (CUDA's error), quoted in the error.
    """
    said = f" (TensorFlow: {why_none.strip()})" if why_none and not gpus_available else ""
    if num_gpus is not None and num_gpus < -1:
        raise UsageError(f"--num_gpus={num_gpus}: give a GPU count, 0 for the CPU or -1 for "
                         "all GPUs")
    if cpu_replicas < 0:
        raise UsageError(f"--cpu_replicas={cpu_replicas}: give a count of logical CPU devices "
                         "(0 to leave the CPU as one device)")
    if cpu_replicas > 0:
        if num_gpus not in (None, 0):
            raise UsageError(f"--num_gpus={num_gpus} and --cpu_replicas={cpu_replicas}: "
                             "choose GPUs or CPU replicas, not both")
        return DevicePlan("cpu", cpu_replicas)
    if num_gpus == 0 or (num_gpus is None and gpus_available == 0):
        return DevicePlan("cpu", 1)
    if num_gpus is None or num_gpus == -1:
        if gpus_available == 0:
            raise UsageError(f"--num_gpus=-1 asks for all GPUs but TensorFlow sees none{said}; "
                             "use --num_gpus=0 for the CPU or --cpu_replicas=N for N CPU replicas")
        return DevicePlan("gpu", gpus_available)
    if num_gpus > gpus_available:
        raise UsageError(f"--num_gpus={num_gpus} asks for {num_gpus} GPUs but TensorFlow sees "
                         f"{gpus_available}{said}; use --cpu_replicas={num_gpus} to run {num_gpus} "
                         "replicas on the CPU")
    return DevicePlan("gpu", num_gpus)


def gpus_available():
    """Physical GPUs TensorFlow sees (does not start the runtime)."""
    return len(tf.config.list_physical_devices("GPU"))


def cpu_thread_pools(replicas, cores=None):
    """(intra-op, inter-op) threads that let N CPU replicas share the cores without fighting.

    With the defaults every replica's ops each try to use every core, and 2 replicas on 2 cores
    run at about a third of one replica's speed (../shared/DESIGN.md). One core per replica
    for each op, and enough inter-op threads to run all replicas' ops at once, fixes that.
    """
    if replicas <= 1:
        return 0, 0  # TensorFlow's own choice
    cores = cores or usable_cores()
    return max(1, cores // replicas), 2 * replicas


def usable_core_ids():
    """The cores this process may run on (its affinity: a taskset, a container's cpuset)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def usable_cores():
    return len(usable_core_ids())


def configure(plan, intra_op_threads=0, inter_op_threads=0):
    """Sets up the runtime for `plan`; must run before TensorFlow starts its devices."""
    if plan.kind == "gpu":
        # One dedicated thread pool per GPU to launch kernels: steadier step times with several
        # GPUs (TensorFlow GPU performance guide). Read when the runtime starts.
        os.environ.setdefault("TF_GPU_THREAD_MODE", "gpu_private")
        return
    # Keep the GPUs out of a CPU run: MirroredStrategy would otherwise place ops on them.
    tf.config.set_visible_devices([], "GPU")
    if plan.count > 1:
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * plan.count)
    intra, inter = cpu_thread_pools(plan.count)
    tf.config.threading.set_intra_op_parallelism_threads(intra_op_threads or intra)
    tf.config.threading.set_inter_op_parallelism_threads(inter_op_threads or inter)


def check_configured(plan):
    """The logical CPU devices the plan needs exist (they are set before TensorFlow starts)."""
    if plan.kind == "cpu" and plan.count > 1:
        have = len(tf.config.list_logical_devices("CPU"))
        if have < plan.count:
            raise UsageError(f"{plan.count} CPU replicas asked for but only {have} logical CPU "
                             "devices exist (they must be configured before TensorFlow starts)")


def make_strategy(plan):
    """OneDeviceStrategy for one replica, MirroredStrategy for several (NCCL on GPUs)."""
    devices = plan.devices
    check_configured(plan)
    if plan.count == 1:
        return tf.distribute.OneDeviceStrategy(devices[0])
    if plan.kind == "gpu":
        return tf.distribute.MirroredStrategy(devices, cross_device_ops=tf.distribute.NcclAllReduce())
    return tf.distribute.MirroredStrategy(devices)


def replica_names(strategy):
    """Short device names of the replicas, like the book's [gpu(0), gpu(1)]: ['GPU:0', 'GPU:1'];
    over several workers ['worker0/GPU:0', ..., 'worker1/GPU:0', ...]."""
    local = [d.split("device:")[-1] for d in strategy.extended.worker_devices]
    workers = strategy.num_replicas_in_sync // len(local)
    if workers == 1:
        return local
    return [f"worker{w}/{name}" for w in range(workers) for name in local]


# ----------------------------------------------------------------------------- several machines

def cluster_config(worker_hosts=None, task_index=0, tf_config=None):
    """This worker's TF_CONFIG as a dict, from --worker_hosts/--task_index or an existing
    TF_CONFIG (a scheduler's); None for a single-machine run."""
    if worker_hosts:
        hosts = [h.strip() for h in worker_hosts.split(",") if h.strip()]
        for host in hosts:
            name, _, port = host.rpartition(":")
            if not name or not port.isdigit():
                raise UsageError(f"--worker_hosts: {host!r} is not host:port")
        if not 0 <= task_index < len(hosts):
            raise UsageError(f"--task_index={task_index} is not one of the {len(hosts)} workers "
                             f"(0 to {len(hosts) - 1})")
        return {"cluster": {"worker": hosts}, "task": {"type": "worker", "index": task_index}}
    if tf_config:
        try:
            config = json.loads(tf_config)
            workers, task = config["cluster"]["worker"], config["task"]
            assert task["type"] in ("worker", "chief") and isinstance(task["index"], int)
        except (ValueError, KeyError, TypeError, AssertionError):
            raise UsageError("TF_CONFIG is set but is not a cluster with workers and a task "
                             "(see the TensorFlow multi-worker guide)") from None
        return config if len(workers) + len(config["cluster"].get("chief", [])) > 1 else None
    return None


def is_chief(config):
    """The worker that writes reports and the real checkpoints: the chief, or worker 0."""
    if config is None:
        return True
    task = config["task"]
    return task["type"] == "chief" or ("chief" not in config["cluster"] and task["index"] == 0)


def make_multi_worker_strategy(config, plan):
    """MultiWorkerMirroredStrategy over every worker's devices: NCCL between GPUs, gRPC ring
    between CPUs. Must be made before TensorFlow starts its runtime."""
    if plan.kind == "cpu" and plan.count > 1:
        raise UsageError("with several workers each CPU worker is one replica; drop "
                         "--cpu_replicas (or start more workers)")
    os.environ["TF_CONFIG"] = json.dumps(config)
    implementation = (tf.distribute.experimental.CommunicationImplementation.NCCL
                      if plan.kind == "gpu" else
                      tf.distribute.experimental.CommunicationImplementation.RING)
    return tf.distribute.MultiWorkerMirroredStrategy(
        communication_options=tf.distribute.experimental.CommunicationOptions(
            implementation=implementation))
