"""Devices and the strategy factory: the one place that decides where replicas run.

`plan_devices` turns the flags into a plain (kind, count); `configure` sets up the runtime
before it starts (logical CPU devices, thread pools, GPU thread mode); `make_strategy` builds
the tf.distribute strategy. startup.py calls them in order for every tool; tests skip
`configure` and inject their own logical devices.

The plans and the shares need no TensorFlow: only the functions that start or query the
runtime import it, so the launcher (which starts workers and trains nothing) does not load it.
"""
from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING

from tfmulti import quiet
from tfmulti.distribution import gpulibs
from tfmulti.errors import UsageError

if TYPE_CHECKING:
    import tensorflow as tf


@dataclasses.dataclass(frozen=True)
class DevicePlan:
    kind: str  # "gpu" or "cpu"
    count: int  # replicas
    gpu_ids: tuple = ()  # which GPUs (TensorFlow's numbers); () = the first `count`
    memory_growth: bool = False  # GPU memory taken as needed instead of almost all at start

    @property
    def chosen_gpus(self):
        """The GPUs this process may see and use, in TensorFlow's numbering."""
        if self.kind != "gpu":
            return ()
        return tuple(self.gpu_ids) or tuple(range(self.count))

    @property
    def devices(self):
        """TensorFlow device names, one per replica: ['/GPU:0', '/GPU:1']."""
        return [f"/{self.kind.upper()}:{i}" for i in range(self.count)]


def plan_devices(num_gpus, cpu_replicas, gpus_available, why_none="", gpus=None,
                 memory_growth=False):
    """Where to train. num_gpus: None (all GPUs, else the CPU), 0 (CPU), -1 (all GPUs), N.
    gpus: which GPUs (TensorFlow's numbers, as strings from --gpus=0,2), or None.

    why_none: what TensorFlow said when it found no GPU (CUDA's error), quoted in the error.
    """
    said = f" (TensorFlow: {why_none.strip()})" if why_none and not gpus_available else ""
    if gpus:
        ids = chosen_gpu_ids(gpus, num_gpus, cpu_replicas, gpus_available, said)
        return DevicePlan("gpu", len(ids), ids, memory_growth)
    plan = _plan_by_count(num_gpus, cpu_replicas, gpus_available, said)
    return dataclasses.replace(plan, memory_growth=memory_growth and plan.kind == "gpu")


def chosen_gpu_ids(gpus, num_gpus, cpu_replicas, gpus_available, said=""):
    """--gpus=0,2 as a tuple of GPU numbers, checked against the other flags and the GPUs."""
    try:
        ids = tuple(int(g) for g in gpus)
    except ValueError:
        raise UsageError(f"--gpus={','.join(gpus)}: give GPU numbers, like --gpus=0,2")
    if any(i < 0 for i in ids) or len(set(ids)) != len(ids):
        raise UsageError(f"--gpus={','.join(gpus)}: give each GPU once, numbered from 0")
    if cpu_replicas > 0:
        raise UsageError(f"--gpus={','.join(gpus)} and --cpu_replicas={cpu_replicas}: choose "
                         "GPUs or CPU replicas, not both")
    if num_gpus is not None and num_gpus != len(ids):
        raise UsageError(f"--gpus={','.join(gpus)} names {len(ids)} GPU"
                         f"{'s' if len(ids) > 1 else ''} but --num_gpus={num_gpus}; "
                         "leave --num_gpus out")
    missing = [i for i in ids if i >= gpus_available]
    if missing:
        raise UsageError(f"--gpus={','.join(gpus)}: no GPU {missing[0]}, TensorFlow sees "
                         f"{gpus_available} (numbered from 0){said}")
    return ids


def _plan_by_count(num_gpus, cpu_replicas, gpus_available, said):
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
        plural = "s" if num_gpus > 1 else ""
        raise UsageError(f"--num_gpus={num_gpus} asks for {num_gpus} GPU{plural} but TensorFlow "
                         f"sees {gpus_available}{said}; use --cpu_replicas={num_gpus} to run "
                         f"{num_gpus} replica{plural} on the CPU")
    return DevicePlan("gpu", num_gpus)


def plan_for(cfg):
    """The devices RunConfig cfg asks for, checked against the machine (the runtime not
    started); with no GPU found, the error quotes why (TensorFlow's start-up lines)."""
    available = gpus_available()
    return plan_devices(cfg.num_gpus, cfg.cpu_replicas, available,
                        why_none=gpulibs.why_no_gpu(quiet.STARTUP) if available == 0 else "",
                        gpus=list(cfg.gpus) if cfg.gpus else None,
                        memory_growth=cfg.gpu_memory_growth)


def no_gpu_visible(environ=None, dev="/dev") -> bool:
    """Whether TensorFlow could see no GPU here, known without importing it (about 3 s of CPU):
    CUDA_VISIBLE_DEVICES hides them all, or no NVIDIA device node is there (/dev/nvidia0,
    nvidiactl: the driver's; /dev/dxg: WSL2's), without which CUDA finds none."""
    environ = os.environ if environ is None else environ
    if environ.get("CUDA_VISIBLE_DEVICES", "unset").strip() in ("", "-1"):
        return True
    try:
        names = os.listdir(dev)
    except OSError:
        return False  # cannot tell: ask TensorFlow
    return not any(name.startswith("nvidia") or name == "dxg" for name in names)


def gpus_available() -> int:
    """Physical GPUs TensorFlow sees (does not start the runtime; TensorFlow's start-up lines
    held where it was not imported yet: the launcher's). 0 without importing TensorFlow
    where no GPU can be visible (no_gpu_visible)."""
    if no_gpu_visible():
        return 0
    quiet.import_tensorflow()
    import tensorflow as tf

    return len(tf.config.list_physical_devices("GPU"))


def cpu_thread_pools(replicas, cores=None):
    """(intra-op, inter-op) threads that let N CPU replicas share the cores without fighting.

    With the defaults every replica's ops each try to use every core, and 2 replicas on 2 cores
    can fight over the cores (one early measurement saw a third of one replica's speed; not
    reproduced with TensorFlow 2.21, see docs/performance.md). Each op gets a replica's share
    of the cores, and as many ops run at once as there are replicas: more ops at once than
    that were slower in every measurement (benchmarks/replicas.py, oneDNN and Eigen;
    docs/performance.md).
    """
    if replicas <= 1:
        return 0, 0  # TensorFlow's own choice
    cores = cores or usable_cores()
    return max(1, cores // replicas), replicas


def usable_core_ids() -> list[int]:
    """The cores this process may run on (its affinity: a taskset, a container's cpuset)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def usable_cores() -> int:
    return len(usable_core_ids())


def configure(plan, intra_op_threads=0, inter_op_threads=0):
    """Sets up the runtime for `plan`; must run before TensorFlow starts its devices."""
    import tensorflow as tf

    if plan.kind == "gpu":
        # One dedicated thread pool per GPU to launch kernels: steadier step times with several
        # GPUs (TensorFlow GPU performance guide). Read when the runtime starts.
        os.environ.setdefault("TF_GPU_THREAD_MODE", "gpu_private")
        show_only_gpus(plan, tf.config.list_physical_devices("GPU"))
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


def show_only_gpus(plan, physical, config=None):
    """Makes the plan's GPUs the only ones this process starts: TensorFlow otherwise starts
    every visible GPU and maps nearly all of its memory, and a multi-worker strategy makes one
    replica per GPU it sees. With memory_growth, memory is taken as it is needed (for several
    processes on one GPU, as the doctor's probe and tuning trials are). config: tf.config
    (a stand-in in the tests)."""
    if config is None:
        import tensorflow as tf

        config = tf.config
    chosen = [physical[i] for i in plan.chosen_gpus]
    config.set_visible_devices(chosen, "GPU")
    if plan.memory_growth:
        for gpu in chosen:
            config.experimental.set_memory_growth(gpu, True)


def check_configured(plan):
    """The logical CPU devices the plan needs exist (they are set before TensorFlow starts)."""
    if plan.kind == "cpu" and plan.count > 1:
        import tensorflow as tf

        have = len(tf.config.list_logical_devices("CPU"))
        if have < plan.count:
            raise UsageError(f"{plan.count} CPU replicas asked for but only {have} logical CPU "
                             "devices exist (they must be configured before TensorFlow starts)")


def make_strategy(plan: DevicePlan) -> tf.distribute.Strategy:
    """OneDeviceStrategy for one replica, MirroredStrategy for several (NCCL on GPUs)."""
    import tensorflow as tf

    devices = plan.devices
    check_configured(plan)
    if plan.count == 1:
        return tf.distribute.OneDeviceStrategy(devices[0])
    if plan.kind == "gpu":
        return tf.distribute.MirroredStrategy(devices,
                                              cross_device_ops=tf.distribute.NcclAllReduce())
    return tf.distribute.MirroredStrategy(devices)


def worker_count(strategy: tf.distribute.Strategy) -> int:
    """Processes the strategy's replicas span (each holds as many as this one)."""
    return strategy.num_replicas_in_sync // len(strategy.extended.worker_devices)


def replica_names(strategy: tf.distribute.Strategy) -> list[str]:
    """Short device names of the replicas, like the book's [gpu(0), gpu(1)]: ['GPU:0', 'GPU:1'];
    over several workers ['worker0/GPU:0', ..., 'worker1/GPU:0', ...]."""
    local = [d.split("device:")[-1] for d in strategy.extended.worker_devices]
    workers = worker_count(strategy)
    if workers == 1:
        return local
    return [f"worker{w}/{name}" for w in range(workers) for name in local]


# ----------------------------------------------------------------------------- shares
# Several processes on one machine (the launcher's workers, parallel tuning trials) each get
# an equal share of its devices and cores.

@dataclasses.dataclass
class Share:
    """One worker's devices: the flags and environment that give it them."""
    label: str
    flags: list
    env: dict
    cores: list


def device_shares(plan: DevicePlan, k: int, cores: list[int],
                  visible_gpus: list[str] | None = None) -> list[Share]:
    """Splits `plan` into k equal shares, one per worker.

    GPUs: each worker sees its GPUs only (CUDA_VISIBLE_DEVICES, mapped through the one the
    user set) and trains on all of them. CPU replicas: each worker gets count/k replicas and
    len(cores)/k cores (shared round-robin when there are fewer cores than workers).
    """
    if k < 1:
        raise UsageError(f"--parallel_trials={k}: run at least one trial at a time")
    if plan.count % k:
        divisors = [d for d in range(1, plan.count + 1) if plan.count % d == 0]
        unit = "GPUs" if plan.kind == "gpu" else "CPU replicas (--cpu_replicas)"
        raise UsageError(f"--parallel_trials={k} cannot split {plan.count} {unit} into equal "
                         f"shares; use one of {', '.join(map(str, divisors))}")
    each = plan.count // k
    if len(cores) >= k:
        core_groups = [cores[i * len(cores) // k:(i + 1) * len(cores) // k] for i in range(k)]
    else:
        core_groups = [[cores[i % len(cores)]] for i in range(k)]
    shares = []
    for i, group in enumerate(core_groups):
        on_cores = f"core{'s' if len(group) > 1 else ''} {','.join(map(str, group))}"
        if plan.kind == "gpu":
            ids = (visible_gpus or [str(g) for g in range(plan.count)])[i * each:(i + 1) * each]
            shares.append(Share(f"GPU {','.join(ids)} ({on_cores})",
                                [f"--num_gpus={each}", "--cpu_replicas=0"],
                                {"CUDA_VISIBLE_DEVICES": ",".join(ids)}, group))
        else:
            shares.append(Share(f"{each} CPU replica{'s' if each > 1 else ''} on {on_cores}",
                                [f"--cpu_replicas={each}", "--num_gpus=0"], {}, group))
    return shares


def visible_gpus() -> list[str] | None:
    """The GPU ids CUDA lets this process see, as CUDA_VISIBLE_DEVICES names them."""
    said = os.environ.get("CUDA_VISIBLE_DEVICES")
    return [g.strip() for g in said.split(",") if g.strip()] if said else None
