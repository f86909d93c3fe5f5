"""--per_replica_batch_size=auto: the search's rules, the GPU's memory search run for real on a
CPU under an address-space cap (TensorFlow's allocator then fails as a full GPU's does), the
CPU's speed search through tfmulti.main, its resume, and an out-of-memory step as one line."""
import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import pytest

from tfmulti.bench import batchsize
from tfmulti.errors import UsageError
from tfmulti.run import config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_largest_fitting_batch_doubles_then_bisects_to_a_multiple_of_8():
    tried = []

    def fits_up_to(most):
        def fits(batch):
            tried.append(batch)
            return batch <= most
        return fits

    assert batchsize.largest_fitting(fits_up_to(300), limit=4096) == 296
    assert tried[:6] == [16, 32, 64, 128, 256, 512]  # doubling, then bisecting 256..512
    assert batchsize.largest_fitting(fits_up_to(5), limit=4096) == 4  # halving below START
    assert batchsize.largest_fitting(fits_up_to(0), limit=4096) is None  # not even 1
    assert batchsize.largest_fitting(fits_up_to(10 ** 6), limit=1000) == 1000  # the limit
    assert batchsize.largest_fitting(fits_up_to(20), limit=4096) == 16  # 16 fits, 24 not


def test_the_fastest_batch_stops_after_two_slower_ones_or_the_first_that_does_not_fit():
    rates = {16: 100.0, 32: 180.0, 64: 200.0, 128: 190.0, 256: 150.0, 512: 400.0}
    asked = []

    def rate(batch):
        asked.append(batch)
        return rates.get(batch), True

    assert batchsize.fastest(rate, limit=4096)[0] == 64
    assert asked == [16, 32, 64, 128, 256]  # 512 never tried: two slower in a row
    asked.clear()
    rates[128] = None  # 128 does not fit: the search ends there
    best, seen = batchsize.fastest(rate, limit=4096)
    assert best == 64 and seen == {16: 100.0, 32: 180.0, 64: 200.0, 128: None}
    rates.update({32: 191.0, 128: 199.0})  # within 5% of the fastest: the smallest wins
    assert batchsize.fastest(rate, limit=4096)[0] == 32
    assert batchsize.fastest(rate, limit=48)[0] == 32  # never past the limit
    asked.clear()
    best, seen = batchsize.fastest(lambda b: (asked.append(b) or 100.0 * b, b < 32), 4096)
    assert best == 32 and asked == [16, 32]  # 32's step too long: kept, nothing larger tried


def test_a_step_past_the_longest_ends_the_cpu_search_and_is_still_counted(monkeypatch):
    """A real search on one CPU replica where every step takes longer than MOST_STEP_S (set
    to 0): the first batch is timed, kept, and none larger is tried."""
    monkeypatch.setattr(batchsize, "MOST_STEP_S", 0.0)
    found = batchsize.search("/cpu:0", "lenet", 4, "float32", None, 1024, say=lambda line: None)
    assert found["per_replica_batch_size"] == 16 and list(found["tried"]) == ["16"]
    assert found["by"] == "speed" and found["tried"]["16"] > 0


def test_under_jit_compile_auto_each_batch_is_timed_as_the_doctors_verdict_for_it_says(
        tmp_path, monkeypatch):
    """--jit_compile=auto with the batch found: a real search on one CPU replica times each
    candidate with XLA where the doctor's verdict for that batch turns it on (kept for 32
    here, none kept for 16: off), as the run would train it."""
    from tfmulti.tools.main import xla_of_batch
    from tfmulti.training import xla

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(batchsize, "CANDIDATE_BUDGET_S", 0.5)
    cfg = config.RunConfig(model="lenet", width=4, jit_compile="auto",
                           per_replica_batch_size=config.AUTO_BATCH)
    xla.record_verdict(xla.verdict_key(cfg, 32, "/cpu:0"),
                       {"ratio": 1.3, "refused": "", "step_s": 0.013, "step_s_xla": 0.01})
    found = batchsize.search("/cpu:0", "lenet", 4, "float32", None, 32,
                             jit_compile=xla_of_batch(cfg, "/cpu:0"), say=lambda line: None)
    assert found["xla"] == {"16": False, "32": True} and set(found["tried"]) == {"16", "32"}
    assert xla_of_batch(dataclasses.replace(cfg, jit_compile="on"), "/cpu:0") is True


def test_auto_is_a_value_of_the_flag_and_refused_with_what_cannot_go_with_it():
    from tfmulti.run import flagdefs

    assert flagdefs.FLAGS["per_replica_batch_size"].parser.parse("auto") == "auto"
    assert flagdefs.FLAGS["per_replica_batch_size"].parser.parse("64") == 64
    with pytest.raises(ValueError, match="give a number of examples or auto"):
        flagdefs.FLAGS["per_replica_batch_size"].parser.parse("lots")
    config.RunConfig(per_replica_batch_size="auto")
    with pytest.raises(UsageError, match="auto and --global_batch_size both given"):
        config.RunConfig(per_replica_batch_size="auto", global_batch_size=64)
    with pytest.raises(UsageError, match="auto with --grad_accum_steps"):
        config.RunConfig(per_replica_batch_size="auto", grad_accum_steps=2)
    from tfmulti.run.plan import run_plan
    with pytest.raises(UsageError, match="only tfmulti.main finds the batch"):
        run_plan(config.RunConfig(per_replica_batch_size="auto"), 2)


# TensorFlow's BFC allocator, the one a GPU's memory goes through, put on the CPU with a limit
# (oneDNN's kernels off: under an address-space cap instead they crashed, SIGSEGV, at the
# limit); a step past it fails with the ResourceExhaustedError a full GPU gives.
CAPPED = {"TF_ENABLE_ONEDNN_OPTS": "0", "TF_CPU_ALLOCATOR_USE_BFC": "true",
          "TF_CPU_BFC_MEM_LIMIT_IN_MB": "300", "TF_CPP_MIN_LOG_LEVEL": "3"}
MEMORY_SEARCH = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {root!r})
    from tfmulti.bench import batchsize

    found = batchsize.search("/cpu:0", "resnet18", 8, "float32", None, 4096, by="memory",
                             say=print)
    print("FOUND " + json.dumps(found))
""")


@pytest.mark.soak  # make soak: about 85 s (a dozen models built and stepped)
def test_the_gpus_memory_search_finds_the_largest_step_that_fits_a_capped_memory(tmp_path):
    """The GPU's search, run on a CPU whose memory TensorFlow's BFC allocator caps: steps
    that do not fit fail with TensorFlow's own out-of-memory error and the process goes on;
    the batch found is the largest that ran, less the spare eighth, and the next one tried
    above it really failed."""
    script = tmp_path / "search.py"
    script.write_text(MEMORY_SEARCH.format(root=ROOT))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=900, env={**os.environ, **CAPPED})
    assert out.returncode == 0, out.stderr[-3000:]
    found = json.loads(out.stdout.split("FOUND ", 1)[1])
    tried = {int(b): fit for b, fit in found["tried"].items()}
    largest = max(b for b, fit in tried.items() if fit)
    failed = [b for b, fit in tried.items() if not fit]
    assert failed and 16 <= largest < 4096, tried  # the cap was met, past the first batch
    assert min(b for b in failed if b > largest) - largest <= batchsize.GRANULE, tried
    assert found["per_replica_batch_size"] == int(largest * 7 / 8) // 8 * 8
    assert found["by"] == "memory"


CASES = {  # flags of the model and data, and the PYTHONPATH of the user's code
    "lenet": (["--model=lenet", "--dataset=synthetic", "--synthetic_train_size=2048",
               "--synthetic_test_size=100"], ""),
    # a user's text classifier on token ids (examples/your_task)
    "your_text": (["--model=my_models:text_classifier", "--dataset=my_data:reviews"],
                  os.path.join(ROOT, "examples", "your_task")),
}


def main_command(case, model_dir, *more):
    return [sys.executable, "-m", "tfmulti.main", *CASES[case][0], "--cpu_replicas=2",
            "--per_replica_batch_size=auto", f"--model_dir={model_dir}", *more]


# make soak (25 s each; make test times each batch under --jit_compile=auto below)
@pytest.mark.parametrize("case", [pytest.param("lenet", marks=pytest.mark.soak),
                                  pytest.param("your_text", marks=pytest.mark.soak)])
def test_auto_on_cpus_trains_the_fastest_batch_and_a_resume_keeps_its_global_batch(tmp_path,
                                                                                   case):
    env = {**os.environ, "PYTHONPATH": CASES[case][1]}
    run = subprocess.run(main_command(case, tmp_path / "run", "--epochs=1"), cwd=ROOT,
                         capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    said = [line for line in run.stdout.splitlines() if line.startswith("per-replica batch: ")]
    assert len(said) == 1 and "of the most examples/s on one replica of CPU:0" in said[0], said
    saved = json.loads((tmp_path / "run" / "run.json").read_text())
    search = saved["batch_search"]
    rates = {int(b): r for b, r in search["tried"].items()}
    batch = search["per_replica_batch_size"]
    best = max(r for r in rates.values() if r)
    assert search["by"] == "speed" and rates[batch] >= 0.95 * best
    assert all(r < 0.95 * best for b, r in rates.items() if b < batch)
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    train = metrics["train_examples"]
    assert len(rates) >= 3 and max(rates) <= train // (2 * 16)  # an epoch keeps 16 steps
    if case == "lenet":  # 2048 examples: the search reaches that limit (64), never past it
        assert max(rates) == train // (2 * batchsize.LEAST_STEPS_PER_EPOCH) == 64, rates
    assert saved["global_batch_size"] == 2 * batch
    assert metrics["per_replica_batch_size"] == batch
    assert metrics["learning_rate"] == pytest.approx(0.1 * 2 * batch / 256)  # the linear rule
    # the same command again: run.json's global batch, not searched again, and the run is
    # the same one (a different global batch would be refused as another run)
    again = subprocess.run(main_command(case, tmp_path / "run", "--epochs=1"), cwd=ROOT,
                           capture_output=True, text=True, timeout=600, env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "batch search:" not in again.stdout
    assert (f"per-replica batch: {batch} (--per_replica_batch_size=auto: the global batch "
            "found at the run's start, from run.json)") in again.stdout
    assert (f"The run in {tmp_path / 'run'} is complete ({metrics['epochs'][-1]['step']} "
            "steps)") in again.stdout
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["epochs"] == (
        metrics["epochs"])  # and trains nothing more
    assert json.loads((tmp_path / "run" / "run.json").read_text())["global_batch_size"] == (
        2 * batch)


@pytest.mark.soak  # make soak: about 20 s (make test keeps under its 8 minutes)
def test_a_step_that_does_not_fit_is_one_line(tmp_path):
    """A per-replica batch past the memory (TensorFlow's allocator capped, as above): one
    line naming the allocation and what to do, exit 1, no traceback, and no run folder left
    (nothing trained: the retry with a smaller batch is a new run)."""
    out = subprocess.run([sys.executable, "-m", "tfmulti.main", "--model=lenet",
                          "--dataset=synthetic", "--synthetic_train_size=4096",
                          "--synthetic_test_size=100", "--per_replica_batch_size=4096",
                          "--epochs=1", f"--model_dir={tmp_path}/run"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600,
                         env={**os.environ, **CAPPED, "TF_CPU_BFC_MEM_LIMIT_IN_MB": "100"})
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert lines[-1].startswith("tfmulti: error: out of memory (OOM when allocating tensor"), (
        out.stderr[-3000:])
    assert lines[-1].endswith("or --per_replica_batch_size=auto to find one that fits")
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.soak  # make soak: 15 s (a real doctor)
def test_the_doctor_takes_auto(tmp_path):
    doctor = subprocess.run([sys.executable, "-m", "tfmulti.doctor", "--cpu_replicas=2",
                             "--dataset=synthetic", "--per_replica_batch_size=auto",
                             "--nodoctor_predict", f"--model_dir={tmp_path}/run"], cwd=ROOT,
                            capture_output=True, text=True, timeout=600)
    assert doctor.returncode == 0, doctor.stdout[-2000:] + doctor.stderr[-2000:]
    assert ("--per_replica_batch_size=auto: the run finds it at its start; the checks below "
            "take 64 per replica") in doctor.stdout


def test_bench_refuses_auto_in_one_line(tool):
    code, _, err = tool("bench", "predict", "--per_replica_batch_size=auto")
    assert code == 1 and err.strip().splitlines()[-1] == (
        "tfmulti: error: --per_replica_batch_size=auto: the main job finds the batch at its "
        "start (its line and run.json say which); give bench a number")
