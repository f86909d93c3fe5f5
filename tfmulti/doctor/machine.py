"""What the doctor reads off the machine: versions, GPUs (nvidia-smi paired with TensorFlow's
numbering), containers and /dev/shm, --model_dir and the data set.
"""
import os
import subprocess
import tempfile
from importlib import metadata

import tensorflow as tf

from tfmulti.data import idx, tfds_sets
from tfmulti.errors import UserError

SHM_MIN_BYTES = 1 << 30  # NCCL keeps its intra-node buffers in /dev/shm; Docker's default is 64 MB


def versions():
    """TensorFlow's own build info (CUDA, cuDNN), and NCCL as the wheel that brings it says."""
    build = tf.sysconfig.get_build_info()
    parts = [f"TensorFlow {tf.__version__}"]
    if build.get("is_cuda_build"):
        parts.append(f"CUDA {build.get('cuda_version', '?')}, "
                     f"cuDNN {build.get('cudnn_version', '?')}")
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
        report.problem(f"/dev/shm is {shown} in this container; NCCL across {plan.count} GPUs "
                       "needs more: run the container with --shm-size=1g (or --ipc=host)")
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


def data_check(report, dataset, data_dir, check_network=tfds_sets.check_download_host):
    if dataset == "synthetic":
        report.info("data", "the embedded synthetic set (not Fashion-MNIST), nothing to fetch")
        return
    if data_dir is not None and not os.path.isdir(data_dir):
        report.problem(f"--data_dir={data_dir} is not a directory")
        return
    if data_dir is not None and idx.has_idx_files(data_dir):
        try:
            loaded = idx.load_idx_dir(data_dir)
        except UserError as e:
            report.problem(str(e))
            return
        report.info("data", f"Fashion-MNIST IDX files in {data_dir}: "
                    f"{loaded.train_size} + {loaded.test_size} images, all readable")
        return
    import tensorflow_datasets as tfds

    builder = tfds.builder("fashion_mnist", data_dir=data_dir)
    if builder.is_prepared():
        report.info("data", f"Fashion-MNIST prepared by tensorflow-datasets in {builder.data_dir}")
        return
    url = tfds_sets.download_url(builder)
    try:
        check_network(url)
    except OSError as e:
        report.problem(f"Fashion-MNIST is not in {data_dir or 'the TFDS data_dir'} and cannot be "
                       f"downloaded ({e}); mount --data_dir=DIR with the four IDX files or a "
                       "prepared TFDS data_dir, or use --dataset=synthetic")
        return
    report.info("data", f"Fashion-MNIST not downloaded yet; {url} is reachable (the main job "
                "downloads it)")
