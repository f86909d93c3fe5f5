import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from tfmulti.bench import experiments, measure, scaling

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_timed_warms_up_then_repeats():
    calls = []
    result = measure.timed(lambda: calls.append(1), repeats=4, warmup=2)
    assert len(calls) == 6 and len(result["samples_s"]) == 4
    assert result["min_s"] <= result["median_s"] <= result["max_s"]


def test_chain_is_the_powers_of_x():
    x = experiments.chain_input(32, "/CPU:1")
    powers = [p.numpy() for p in experiments.chain(x, 4)]
    expected = np.linalg.matrix_power(x.numpy().astype(np.float64), 5)
    np.testing.assert_allclose(powers[-1], expected, rtol=1e-4)
    np.testing.assert_array_equal(experiments.corners(powers).numpy(), [p[0, 0] for p in powers])


def test_a_long_chain_stays_finite():
    x = experiments.chain_input(256, "/CPU:0")
    last = experiments.chain(x, 50)[-1].numpy()
    assert np.isfinite(last).all() and 1e-4 < np.abs(last).mean() < 1.0


def test_parallel_runs_both_chains_and_gets_their_values():
    result = experiments.parallel(["/CPU:0", "/CPU:1"], 64, 5, repeats=2, warmup=1)
    for key in ("device_1", "device_2", "both"):
        assert len(result[key]["samples_s"]) == 2 and result[key]["median_s"] > 0
    assert result["same_results"]  # the two-device graph did the same work as each alone


def test_overlap_copies_every_result_to_the_host():
    result = experiments.overlap("/CPU:1", "/CPU:0", 64, 5, repeats=2, warmup=1)
    assert set(result) >= {"compute", "copy", "compute_and_copy", "overlap_gain", "copy_hidden"}
    assert result["same_results"]  # the host got the device's results
    assert all(len(result[k]["samples_s"]) == 2 for k in ("compute", "copy", "compute_and_copy"))


@pytest.mark.parametrize("largest, counts", [(1, [1]), (2, [1, 2]), (6, [1, 2, 4, 6]),
                                             (8, [1, 2, 4, 8])])
def test_replica_counts(largest, counts):
    assert scaling.replica_counts(largest) == counts


def test_scaling_table():
    points = scaling.scaling_table([{"replicas": 1, "images_per_s": 100.0},
                                    {"replicas": 2, "images_per_s": 180.0}])
    assert points[1]["speedup"] == pytest.approx(1.8)
    assert points[1]["efficiency"] == pytest.approx(0.9)


def test_bench_is_only_the_entry_point():
    """The experiments, the sweep and the prediction live in bench/; the tool reads the
    flags and dispatches (its timing helpers moved with them), and bench/__main__.py only
    starts it."""
    with open(os.path.join(ROOT, "tfmulti", "bench", "__main__.py")) as f:
        shim = f.read()
    imports = [line for line in shim.splitlines() if line.startswith(("import ", "from "))]
    assert imports == ["from tfmulti import cli"] and 'cli.main("bench")' in shim
    with open(os.path.join(ROOT, "tfmulti", "tools", "bench.py")) as f:
        source = f.read()
    for moved in ("def timed", "def chain", "def parallel", "def overlap", "def replica_counts",
                  "def plot_scaling", "def training_rate", "def predict_scaling", "tf.matmul"):
        assert moved not in source, moved


def test_training_rate(two_replicas):
    result = scaling.training_rate(two_replicas, "lenet", 4, per_replica_batch_size=8, steps=2,
                                 repeats=2, step_times=3)
    assert len(result["images_per_s"]) == 2 and min(result["images_per_s"]) > 0
    assert len(result["step_times_s"]) == 3 and min(result["step_times_s"]) > 0


def run_bench(*args):
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    return subprocess.run([sys.executable, "-m", "tfmulti.bench", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.soak  # make soak: the real command (make test keeps its refusals, below)
def test_parallel_command(tmp_path):
    result = run_bench("parallel", "--cpu_replicas=2", "--matrix_size=64", "--products=4",
                       "--repeats=2", f"--out={tmp_path}")
    assert result.returncode == 0, result.stderr
    assert "both / (sum of the two)" in result.stdout
    saved = json.loads((tmp_path / "parallel.json").read_text())
    assert saved["matrix_size"] == 64 and saved["devices"] == ["/CPU:0", "/CPU:1"]
    assert "tensorflow" in saved["versions"] and saved["flags"]["products"] == 4


@pytest.mark.soak  # 21 s: make soak; the sweep's table stays in the suite
def test_scaling_command(tmp_path):
    result = run_bench("scaling", "--cpu_replicas=2", "--model=lenet", "--width=4",
                       "--per_replica_batch_size=16", "--steps=2", "--repeats=1",
                       f"--out={tmp_path}")
    assert result.returncode == 0, result.stderr
    saved = json.loads((tmp_path / "scaling.json").read_text())
    assert [p["replicas"] for p in saved["points"]] == [1, 2]
    assert saved["points"][0]["speedup"] == 1.0 and saved["points"][1]["images_per_s"] > 0
    assert (tmp_path / "scaling.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("args, words", [
    ([], "give one command: parallel, overlap, scaling"),
    (["parallel"], "parallel needs two devices"),
    (["overlap", "--num_gpus=0"], "overlap on the CPU needs a device apart from the host"),
    (["predict", "--inter_link=fast"], "--intra_link/--inter_link: unknown link 'fast'"),
    (["predict", "--predict_machines=1,x"], "take whole numbers"),
    (["predict", "--steps=1"], "--steps at least 2"),
    (["predict", "--measure_budget=0"], "--measure_budget=0: must be positive (seconds)"),
])
def test_command_errors(tool, args, words):
    """In-process through cli.main, as `python -m tfmulti.bench ARGS` runs them: each is
    refused before any device starts (test_main checks the one line from a real process)."""
    code, _, err = tool("bench", *args)
    assert code == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], err


def _multiworker_benchmark():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "multiworker", os.path.join(ROOT, "benchmarks", "multiworker.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_multiworker_benchmark_kills_its_processes_when_one_fails_or_time_runs_out():
    """A worker waits for a dead peer's all-reduce forever: the benchmark's wait is bounded,
    and the first failure (an exit, or a kill -9) stops the others at once, with one line
    naming it. The sleepers would sleep 60 s: ending well before shows they were killed."""
    bench_mw = _multiworker_benchmark()
    python = sys.executable
    sleeper = [python, "-c", "import time; time.sleep(60)"]
    dying = [python, "-c", "import sys, time; time.sleep(1); sys.exit('worker 1 lost its peer')"]
    started = time.monotonic()
    with pytest.raises(SystemExit, match=r"failed \(exit 1\): worker 1 lost its peer"):
        bench_mw.results([sleeper, dying], timeout=60)
    assert time.monotonic() - started < 30
    started = time.monotonic()
    with pytest.raises(SystemExit, match="still running after 2 s: killed"):
        bench_mw.results([sleeper, sleeper], timeout=2)
    assert time.monotonic() - started < 30
    started = time.monotonic()
    killed = [python, "-c", "import os, time; time.sleep(1); os.kill(os.getpid(), 9)"]
    with pytest.raises(SystemExit, match="failed: killed by signal 9"):
        bench_mw.results([sleeper, killed], timeout=60)
    assert time.monotonic() - started < 30
    done = [python, "-c", "print('noise'); print('POINT {\"replicas\": 2}')"]
    assert bench_mw.results([done], timeout=60) == [{"replicas": 2}]
