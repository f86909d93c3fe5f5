"""python -m tfmulti.doctor: real processes on logical CPU devices, problems simulated."""
import io
import os
import pathlib
import platform
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
from test_data import write_idx

from tfmulti.bench import advise, stepmodel
from tfmulti.data import idx as idx_files
from tfmulti.distribution import allocator, gpulibs
from tfmulti.distribution.devices import DevicePlan
from tfmulti.doctor import machine, prediction, probes
from tfmulti.doctor.report import Report
from tfmulti.processes.launcher import free_ports

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = pathlib.Path(ROOT) / "tests" / "data"


def run_doctor(*args, timeout=120):
    """The doctor as a user starts it after `make`: TCMalloc preloaded where installed."""
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    tcmalloc = allocator.find_tcmalloc()
    if tcmalloc:
        env = allocator.preload_environment(env, tcmalloc)
    return subprocess.run([sys.executable, "-m", "tfmulti.doctor", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def problems(result):
    lines = result.stderr.strip().splitlines()
    assert lines[0].startswith("tfmulti doctor: "), result.stderr
    return [line.strip() for line in lines[1:]]


def test_flags_that_would_run_pass_with_a_checked_allreduce(tmp_path):
    result = run_doctor("--cpu_replicas=2", "--dataset=synthetic", "--doctor_allreduce_mb=4",
                        "--model=lenet", "--per_replica_batch_size=32", "--dtype=mixed_bfloat16",
                        f"--model_dir={tmp_path}/run")
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    # with oneDNN (the default) the dtype warning follows the rates printed, whatever the CPU
    # (rounded to whole GFLOP/s there: a ratio at the threshold itself could go either way)
    float32, bfloat16 = matmul_rates(out)
    if abs(bfloat16 / float32 - stepmodel.BFLOAT16_SLOWER) > 0.02:
        assert warned_of_bfloat16(out) == (bfloat16 < stepmodel.BFLOAT16_SLOWER * float32), out
    # one replica timed, then its speed-up on both predicted: CPU replicas share the cores
    line = next(x for x in out.splitlines() if x.strip().startswith("prediction:"))
    assert "2 replicas at 32 per replica: " in line and "CPU replicas share the cores" in line
    speedup = float(line.split("per replica: ")[1].split("x")[0])
    assert 0.5 < speedup < 1.05, line
    assert "GFLOP/s float32" in out
    # measured as bench predict measures (in the run's dtype), and advised from the same functions
    assert "measured: one replica on /CPU:0: " in out
    assert "at batch 32 in mixed_bfloat16 (a step " in out
    assert "recommended: for 2 replicas: per-device batch" in out and "--steps_per_call=" in out
    assert "2 logical CPU replicas (/CPU:0, /CPU:1) on the " in out
    assert "MirroredStrategy over /CPU:0, /CPU:1" in out
    assert "4 MB across 2 replicas" in out and "sums right" in out and "GB/s" in out
    assert ("kernels: 3x3 convolution and fused batch norm, forward and backward, ran on "
            "CPU:0, CPU:1") in out
    assert "TensorFlow 2.21" in out and "NCCL" in out
    assert ("malloc: tcmalloc (preloaded)" if allocator.find_tcmalloc() else
            "malloc: the system's") in out
    assert f"cache: {os.environ['XDG_CACHE_HOME']}/tfmulti: " in out
    assert "gpu: none found (" in out  # a CUDA build that sees no GPU says why
    assert f"{tmp_path}/run (will be created under {tmp_path}, writable)" in out
    assert "no problems" in out
    assert not os.path.exists(tmp_path / "run") and os.listdir(tmp_path) == []  # wrote nothing


def test_each_problem_gets_one_line_and_a_non_zero_exit(tmp_path):
    (tmp_path / "a_file").write_text("not a directory")
    idx = tmp_path / "idx"
    idx.mkdir()
    rng = np.random.default_rng(0)
    write_idx(idx / idx_files.IDX_FILES["train_images"], rng.integers(0, 256, (5, 28, 28)), cut=7)
    result = run_doctor("--num_gpus=2", f"--model_dir={tmp_path}/a_file/run", f"--data_dir={idx}")
    assert result.returncode == 1
    found = problems(result)
    assert len(found) == 3, found
    assert found[0].startswith("problem: --num_gpus=2 asks for 2 GPUs but TensorFlow sees 0")
    assert "a_file is a file, not a directory" in found[1]
    assert "train-images-idx3-ubyte.gz: truncated" in found[2]


@pytest.mark.soak  # the doctor's all-reduce waiting out its limit (make soak)
def test_a_hung_allreduce_becomes_a_clear_failure():
    """Worker 0 of two with no worker 1: setting up the collective waits for ever."""
    hosts = ",".join(f"localhost:{p}" for p in free_ports(2))
    result = run_doctor("--num_gpus=0", "--dataset=synthetic", f"--worker_hosts={hosts}",
                        "--task_index=0", "--doctor_timeout=4")
    assert result.returncode == 1
    found = problems(result)
    assert len(found) == 1 and "did not finish in 4 s" in found[0], found
    assert "--shm-size" in found[0] and "IOMMU" in found[0] and "peer-to-peer" in found[0]


@pytest.mark.soak  # the doctor starts as the main job does (startup.py), whose wait for a
def test_a_missing_worker_is_named_after_worker_timeout():  # missing worker make test keeps
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


@pytest.mark.soak  # 27 s: make soak (and make cluster-test, across srun tasks); make test
# keeps a missing worker named after --worker_timeout
def test_two_workers_that_are_both_there_allreduce_across_processes():
    hosts = ",".join(f"localhost:{p}" for p in free_ports(2))
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    workers = [subprocess.Popen([sys.executable, "-m", "tfmulti.doctor", "--num_gpus=0",
                                 "--dataset=synthetic", "--doctor_allreduce_mb=1",
                                 "--model=lenet", "--per_replica_batch_size=32",
                                 f"--worker_hosts={hosts}", f"--task_index={i}"],
                                cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True) for i in range(2)]
    for worker in workers:
        out, err = worker.communicate(timeout=120)
        assert worker.returncode == 0, out + err
        assert "MultiWorkerMirroredStrategy, 2 workers" in out
        assert "1 MB across 2 replicas" in out and "sums right" in out
        assert "prediction: 2 replicas on 2 workers at 32 per replica: " in out


@pytest.mark.soak  # 30 s: make soak
def test_the_launcher_runs_the_doctor_on_two_workers_in_a_network_of_their_own():
    """`tfmulti.launch --program=doctor`: both workers' doctors probe the all-reduce across
    them, in the launcher's network of their own, and say so instead of the warning that their
    servers listen on every interface (the network itself: tests/test_launch.py)."""
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    result = subprocess.run([sys.executable, "-m", "tfmulti.launch", "--workers=2",
                             "--program=doctor", "--", "--dataset=synthetic", "--model=lenet",
                             "--doctor_allreduce_mb=1", "--per_replica_batch_size=32"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert out.startswith("[launch] the workers have a network of their own")
    for i in range(2):
        mine = [line for line in out.splitlines() if line.startswith(f"[worker {i}]")]
        assert any("MultiWorkerMirroredStrategy, 2 workers" in line for line in mine)
        assert any("1 MB across 2 replicas" in line and "sums right" in line for line in mine)
        assert any(re.search(r"network: this worker's server \(localhost:\d+\) listens in the "
                             "launcher's network of its own", line) for line in mine), mine
        assert not any("WARNING: this worker's server" in line for line in mine)
        assert any("tfmulti doctor: no problems" in line for line in mine)


def matmul_rates(out):
    """(float32, bfloat16) GFLOP/s from the doctor's matmul line."""
    rates = next(x for x in out.splitlines() if "GFLOP/s float32" in x)
    return (float(rates.split("matmul: ")[1].split()[0]),
            float(rates.split("float32, ")[1].split()[0]))


def warned_of_bfloat16(out):
    return "WARNING: --dtype=mixed_bfloat16 is slower than float32" in out


def test_dtype_slower_than_float32_here_is_a_warning_not_a_problem(capsys):
    """A CPU without native bfloat16 (faked: the measurement of a Xeon whose bfloat16 matmul
    runs at a third of float32's rate): the doctor's warning names both rates, and the flags
    still run (exit 0). The first test runs the real doctor on this machine's own rates,
    where the warning comes exactly when bfloat16 measures below 80% of float32."""
    from tfmulti.doctor.report import finish
    from tfmulti.run.config import RunConfig

    measured = {"device": "/CPU:0", "batch": 32, "step_s": 0.05, "steps_s": [0.05, 0.05],
                "call_overhead_s": 0.001, "second_batch": 16, "step_s_second": 0.03,
                "steps_s_second": [0.03, 0.03], "why_one_batch": "", "gradient_bytes": 2e6,
                "tensors": 10, "float32_gflops": 306.0, "bfloat16_gflops": 62.0}
    probed = {"local": 2, "replicas": 2, "allreduce": (0.001,), "latency": 1e-4}
    out = io.StringIO()
    report = Report(out)
    prediction.report_prediction(report, DevicePlan("cpu", 2), RunConfig(dtype="mixed_bfloat16"),
                                 probed, measured, 4.0)
    assert warned_of_bfloat16(out.getvalue()) and "62 against 306 GFLOP/s" in out.getvalue()
    assert not report.problems
    finish(report)  # no SystemExit: exit 0
    assert "no problems; these flags would run" in capsys.readouterr().out


def test_small_shm_in_a_container_is_a_problem_only_for_several_gpus():
    report = Report(out=io.StringIO())
    machine.shm_check(report, DevicePlan("gpu", 2), True, 64 << 20)
    assert report.problems and "64 MiB" in report.problems[0] and "--shm-size" in report.problems[0]
    for plan, container in ((DevicePlan("gpu", 2), False), (DevicePlan("cpu", 2), True),
                            (DevicePlan("gpu", 1), True)):
        report = Report(out=io.StringIO())
        machine.shm_check(report, plan, container, 64 << 20)
        assert not report.problems
    report = Report(out=io.StringIO())
    machine.shm_check(report, DevicePlan("gpu", 4), True, 8 << 30)
    assert not report.problems


def test_fashion_mnist_that_cannot_be_fetched_is_a_problem(tmp_path):
    def offline(url):
        raise OSError("storage.googleapis.com is unreachable: no route")

    report = Report(out=io.StringIO())
    machine.data_check(report, "fashion_mnist", str(tmp_path), check_network=offline)
    assert len(report.problems) == 1
    assert "cannot be downloaded" in report.problems[0] and "--data_dir" in report.problems[0]
    reachable = Report(out=io.StringIO())
    machine.data_check(reachable, "fashion_mnist", str(tmp_path), check_network=lambda url: None)
    assert not reachable.problems and "reachable" in reachable.out.getvalue()


def test_allreduce_bus_bandwidth_follows_nccl_tests():
    # 2(n-1)/n of the data crosses each link: 1 GiB in 1 s over 4 replicas is 1.61 GB/s.
    assert probes.bus_bandwidth(1024, 4, 1.0) == 1024 * 2**20 * 1.5 / 1e9


# ----------------------------------------------------------------------------- the GPU table

SMI = """0, GPU-aaaa1111, 00000000:1A:00.0, NVIDIA A100-SXM4-40GB, 40960 MiB
1, GPU-bbbb2222, 00000000:1B:00.0, NVIDIA A100-SXM4-80GB, 81920 MiB
2, GPU-cccc3333, 00000000:3D:00.0, NVIDIA A100-SXM4-40GB, 40960 MiB
3, GPU-dddd4444, 00000000:3E:00.0, NVIDIA A100-SXM4-80GB, 81920 MiB
"""


@pytest.fixture
def stand_in_nvidia_smi(tmp_path, monkeypatch):
    """An nvidia-smi on PATH that answers the doctor's query as a 4-GPU machine would."""
    script = tmp_path / "nvidia-smi"
    script.write_text("#!/bin/sh\ncat <<'END'\n" + SMI + "END\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    return machine.nvidia_smi_rows()


A100 = {"device_name": "NVIDIA A100", "compute_capability": (8, 0)}


@pytest.mark.parametrize("visible, wanted", [
    (None, ["0", "1"]),
    ("2,1", ["2", "1"]),  # before: paired with nvidia-smi's 0 and 1 whatever was visible
    ("3", ["3"]),
    ("GPU-cccc,GPU-aaaa1111", ["2", "0"]),  # UUIDs, whole or a prefix
])
def test_each_gpu_line_shows_that_gpus_nvidia_smi_row(stand_in_nvidia_smi, visible, wanted):
    environ = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    if visible is not None:
        environ["CUDA_VISIBLE_DEVICES"] = visible
    lines = machine.gpu_lines([A100] * len(wanted), stand_in_nvidia_smi, environ)
    rows = {row["index"]: row for row in stand_in_nvidia_smi}
    assert lines == [f"GPU {i}: NVIDIA A100, compute capability 8.0, nvidia-smi GPU {index} "
                     f"({rows[index]['pci.bus_id']}), memory {rows[index]['memory.total']}"
                     for i, index in enumerate(wanted)]


def test_no_pairing_in_cudas_fastest_first_order(stand_in_nvidia_smi):
    lines = machine.gpu_lines([A100], stand_in_nvidia_smi, {"CUDA_DEVICE_ORDER": "FASTEST_FIRST"})
    assert lines == ["GPU 0: NVIDIA A100, compute capability 8.0, memory unknown (its "
                     "nvidia-smi row cannot be told in this GPU order)"]
    assert machine.gpu_lines([A100], [], {}) == [
        "GPU 0: NVIDIA A100, compute capability 8.0, memory unknown (no nvidia-smi)"]


def test_tfmulti_numbers_gpus_as_nvidia_smi_does(monkeypatch):
    """Every entry point sets CUDA_DEVICE_ORDER=PCI_BUS_ID before TensorFlow looks for GPUs
    (so --gpus and CUDA_VISIBLE_DEVICES mean nvidia-smi's numbers), unless the user set it.
    (The import of TensorFlow is quiet.import_tensorflow's; run again, it imports nothing.)"""
    from tfmulti import quiet
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    quiet.import_tensorflow()
    assert os.environ["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "FASTEST_FIRST")
    quiet.import_tensorflow()
    assert os.environ["CUDA_DEVICE_ORDER"] == "FASTEST_FIRST"


# ----------------------------------------------------------------------------- cuDNN

def test_cudnn_version_numbers():
    assert gpulibs.cudnn_version_parts(90300) == (9, 3, 0)
    assert gpulibs.cudnn_version_parts(8902) == (8, 9, 2)


def test_a_cudnn_other_than_tensorflows_is_a_problem():
    build = {"cudnn_version": "9"}
    assert gpulibs.cudnn_problem((9, 3, 0), build, "2.21.0") is None
    assert gpulibs.cudnn_problem(None, build, "2.21.0") is None
    assert gpulibs.cudnn_problem((8, 9, 7), build, "2.21.0").startswith(
        "cuDNN 8.9.7 is loaded but TensorFlow 2.21.0 was built with cuDNN 9: install cuDNN 9")


def test_a_failed_gpu_kernel_and_the_loaded_cudnn_are_reported():
    out = io.StringIO()
    report = Report(out)
    plan = DevicePlan("gpu", 2)
    probes.report_kernels(report, (["GPU:0", "GPU:1"], "DNN library initialization failed"),
                          (8, 9, 7), plan, {"cudnn_version": "9"})
    assert report.problems[0] == ("a convolution or fused batch norm failed on GPU:0, GPU:1: "
                                  "DNN library initialization failed; a cuDNN other than "
                                  "TensorFlow's is the usual cause")
    assert report.problems[1].startswith("cuDNN 8.9.7 is loaded but")


def stand_in_cudnn(folder):
    """folder/libcudnn.so.9 whose cudnnGetVersion says 8.9.2 (tests/data/cudnn_stand_in.c):
    built with gcc where there is one, else the copy built from it for x86-64."""
    library = folder / "libcudnn.so.9"
    if shutil.which("gcc"):
        subprocess.run(["gcc", "-shared", "-fPIC", "-Wl,-soname,libcudnn.so.9", "-o",
                        str(library), str(DATA / "cudnn_stand_in.c")], check=True, timeout=60)
    elif platform.machine() == "x86_64":
        shutil.copy(DATA / "libcudnn_stand_in_x86_64.so.9", library)
    else:
        pytest.skip(f"no gcc to build the stand-in cuDNN for {platform.machine()}")
    return library


def test_the_loaded_cudnn_is_read_from_the_library_itself(tmp_path):
    """A library named libcudnn.so.9 whose cudnnGetVersion says 8.9.2: the doctor reads what
    is loaded, not what the package says."""
    assert gpulibs.cudnn_loaded_version({"cudnn_version": "9"}) is None  # none here
    stand_in_cudnn(tmp_path)
    code = ("from tfmulti.distribution import gpulibs; "
            "print(gpulibs.cudnn_loaded_version({'cudnn_version': '9'}))")
    env = dict(os.environ, LD_LIBRARY_PATH=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.stdout.strip() == "(8, 9, 2)", out.stderr
    assert gpulibs.cudnn_loaded_version({"cudnn_version": "9"}) is None  # none here


def test_the_doctor_advises_16_bit_gradients_over_a_slow_link():
    """ResNet-50's gradients (102 MB) between 4 workers over a measured 0.5 GB/s: the doctor's
    prediction is bound by the all-reduce and it advises --allreduce_dtype=float16; with that
    flag the prediction is higher and the advice gone."""
    from tfmulti.run.config import RunConfig

    plan = DevicePlan("gpu", 1)
    probed = {"local": 1, "replicas": 4, "allreduce": (0.1,), "latency": 2e-4}
    measured = {"batch": 64, "step_s": 0.16, "gradient_bytes": 102e6, "tensors": 161,
                "float32_gflops": 300.0, "bfloat16_gflops": 600.0}
    lines = {}
    for wire in ("float32", "float16"):
        out = io.StringIO()
        prediction.report_prediction(Report(out), plan, RunConfig(allreduce_dtype=wire),
                                 probed, measured, 32.0)
        lines[wire] = out.getvalue().splitlines()
    first = [line.strip() for line in lines["float32"]]
    assert first[0].startswith("prediction: 4 replicas on 4 workers at 64 per replica:")
    assert "bound by all-reduce bandwidth" in first[0]
    advice = next(line for line in first if line.startswith("advice:"))
    assert advice.startswith("advice: --allreduce_dtype=float16 halves the gradients' all-reduce")
    speedups = [float(ls[0].split(": ")[2].split("x")[0]) for ls in (lines["float32"],
                                                                      lines["float16"])]
    assert speedups[1] > 1.03 * speedups[0]
    assert f"-> {speedups[1]:.2f}x predicted" in advice
    assert not any("advice:" in line for line in lines["float16"])


def test_the_doctor_and_bench_predict_give_the_same_figures_and_advice():
    """One measurement (a fake dict, as advise.measure_here returns them), one setup (4
    workers of one GPU over the probe's link): the doctor's lines and `bench predict`'s carry
    the same speed-up, the same description of what was measured, and the same advice, word
    for word, all four kinds of it present."""
    from tfmulti.run.config import RunConfig

    measured = {"device": "/GPU:0", "batch": 64, "step_s": 0.16, "steps_s": [0.15, 0.16, 0.18],
                "call_overhead_s": 0.02, "second_batch": 32, "step_s_second": 0.09,
                "steps_s_second": [0.09, 0.09], "why_one_batch": "", "gradient_bytes": 102e6,
                "tensors": 161, "float32_gflops": 300.0, "bfloat16_gflops": 100.0}
    cfg = RunConfig(dtype="mixed_bfloat16", allreduce_dtype="float32", steps_per_call=1)
    plan = DevicePlan("gpu", 1)
    probed = {"local": 1, "replicas": 4, "allreduce": (0.02,), "latency": 2e-4}
    out = io.StringIO()
    prediction.report_prediction(Report(out), plan, cfg, probed, measured, 32.0)
    told = {line.split(":", 1)[0].strip(): line.split(":", 1)[1].strip()
            for line in out.getvalue().splitlines()}

    link = prediction.probed_link(probed, 32.0)
    lines, rows, advice = advise.grid_report(
        measured, "gpu", cfg, lambda n, m: advise.setup(measured, cfg, n, m, link, link), [1], [4])
    assert advice.batch and advice.steps_per_call > 1 and advice.dtype and advice.allreduce
    # the same prediction
    assert told["prediction"].split(": ", 1)[1].startswith(f"{rows[0].speedup:.2f}x")
    # the same measurement, said the same way
    assert lines[0].startswith("one GPU device here: ")
    assert told["measured"] == f"one replica on {plan.devices[0]}: " + lines[0].split(
        "here: ", 1)[1]
    # the same advice: batch and steps per call, the dtype warning, the all-reduce's dtype
    assert told["recommended"] == f"for 4 replicas on 4 workers: {advice.recommendation}"
    assert lines[2].startswith(f"recommended at 4 x 1: {advice.recommendation}; matmul "
                               f"{advise.matmul_text(measured)} here")
    assert told["WARNING"] == advice.dtype and told["advice"] == advice.allreduce
    assert lines[2].endswith(f"; {advice.dtype}; {advice.allreduce}")
    assert told["matmul"] == f"{advise.matmul_text(measured)} on {plan.devices[0]}"
