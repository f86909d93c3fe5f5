"""python -m tfmulti.doctor: real processes on logical CPU devices, problems simulated."""
import io
import os
import subprocess
import sys

import numpy as np

from tfmulti import data, doctor
from tfmulti.devices import DevicePlan
from tfmulti.launch import free_ports

from test_data import write_idx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_doctor(*args, timeout=120):
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    return subprocess.run([sys.executable, "-m", "tfmulti.doctor", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def problems(result):
    lines = result.stderr.strip().splitlines()
    assert lines[0].startswith("tfmulti doctor: "), result.stderr
    return [line.strip() for line in lines[1:]]


def test_flags_that_would_run_pass_with_a_checked_allreduce(tmp_path):
    result = run_doctor("--cpu_replicas=2", "--dataset=synthetic", "--doctor_allreduce_mb=4",
                        f"--model_dir={tmp_path}/run")
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "2 logical CPU replicas (/CPU:0, /CPU:1) on the " in out
    assert "MirroredStrategy over /CPU:0, /CPU:1" in out
    assert "4 MB across 2 replicas" in out and "sums right" in out and "GB/s" in out
    assert "TensorFlow 2.21" in out and "NCCL" in out
    assert f"{tmp_path}/run (will be created under {tmp_path}, writable)" in out
    assert "no problems" in out
    assert not os.path.exists(tmp_path / "run") and os.listdir(tmp_path) == []  # wrote nothing


def test_each_problem_gets_one_line_and_a_non_zero_exit(tmp_path):
    (tmp_path / "a_file").write_text("not a directory")
    idx = tmp_path / "idx"
    idx.mkdir()
    rng = np.random.default_rng(0)
    write_idx(idx / data.IDX_FILES["train_images"], rng.integers(0, 256, (5, 28, 28)), cut=7)
    result = run_doctor("--num_gpus=2", f"--model_dir={tmp_path}/a_file/run", f"--data_dir={idx}")
    assert result.returncode == 1
    found = problems(result)
    assert len(found) == 3, found
    assert found[0].startswith("problem: --num_gpus=2 asks for 2 GPUs but TensorFlow sees 0")
    assert "a_file is a file, not a directory" in found[1]
    assert "train-images-idx3-ubyte.gz: truncated" in found[2]


def test_a_hung_allreduce_becomes_a_clear_failure():
    """Worker 0 of two with no worker 1: setting up the collective waits for ever."""
    hosts = ",".join(f"localhost:{p}" for p in free_ports(2))
    result = run_doctor("--num_gpus=0", "--dataset=synthetic", f"--worker_hosts={hosts}",
                        "--task_index=0", "--doctor_timeout=4")
    assert result.returncode == 1
    found = problems(result)
    assert len(found) == 1 and "did not finish in 4 s" in found[0], found
    assert "--shm-size" in found[0] and "IOMMU" in found[0] and "peer-to-peer" in found[0]


def test_a_missing_worker_is_named_after_worker_timeout():
    """The doctor waits --worker_timeout for the other workers, like the main job, and names
    the one that did not come (before its own --doctor_timeout runs out)."""
    ports = free_ports(2)
    hosts = ",".join(f"localhost:{p}" for p in ports)
    result = run_doctor("--num_gpus=0", "--dataset=synthetic", f"--worker_hosts={hosts}",
                        "--task_index=0", "--worker_timeout=3", "--doctor_timeout=60")
    assert result.returncode == 1
    found = problems(result)
    assert found == [f"problem: worker 1 (localhost:{ports[1]}) did not join within "
                     "--worker_timeout=3 s; check that every worker was started with the same "
                     "--worker_hosts and can reach the others"], found


def test_two_workers_that_are_both_there_allreduce_across_processes():
    hosts = ",".join(f"localhost:{p}" for p in free_ports(2))
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    workers = [subprocess.Popen([sys.executable, "-m", "tfmulti.doctor", "--num_gpus=0",
                                 "--dataset=synthetic", "--doctor_allreduce_mb=1",
                                 f"--worker_hosts={hosts}", f"--task_index={i}"],
                                cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True) for i in range(2)]
    for worker in workers:
        out, err = worker.communicate(timeout=120)
        assert worker.returncode == 0, out + err
        assert "MultiWorkerMirroredStrategy, 2 workers" in out
        assert "1 MB across 2 replicas" in out and "sums right" in out


def test_small_shm_in_a_container_is_a_problem_only_for_several_gpus():
    report = doctor.Report(out=io.StringIO())
    doctor.shm_check(report, DevicePlan("gpu", 2), True, 64 << 20)
    assert report.problems and "64 MiB" in report.problems[0] and "--shm-size" in report.problems[0]
    for plan, container in ((DevicePlan("gpu", 2), False), (DevicePlan("cpu", 2), True),
                            (DevicePlan("gpu", 1), True)):
        report = doctor.Report(out=io.StringIO())
        doctor.shm_check(report, plan, container, 64 << 20)
        assert not report.problems
    report = doctor.Report(out=io.StringIO())
    doctor.shm_check(report, DevicePlan("gpu", 4), True, 8 << 30)
    assert not report.problems


def test_fashion_mnist_that_cannot_be_fetched_is_a_problem(tmp_path):
    def offline(url):
        raise OSError("storage.googleapis.com is unreachable: no route")

    report = doctor.Report(out=io.StringIO())
    doctor.data_check(report, "fashion_mnist", str(tmp_path), check_network=offline)
    assert len(report.problems) == 1
    assert "cannot be downloaded" in report.problems[0] and "--data_dir" in report.problems[0]
    reachable = doctor.Report(out=io.StringIO())
    doctor.data_check(reachable, "fashion_mnist", str(tmp_path), check_network=lambda url: None)
    assert not reachable.problems and "reachable" in reachable.out.getvalue()


def test_allreduce_bus_bandwidth_follows_nccl_tests():
    # 2(n-1)/n of the data crosses each link: 1 GiB in 1 s over 4 replicas is 1.61 GB/s.
    assert doctor.bus_bandwidth(1024, 4, 1.0) == 1024 * 2**20 * 1.5 / 1e9
