"""The command line as a user meets it: real processes, real flagfiles."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import plain_consumer
import pytest

from tfmulti import kernels
from tfmulti.data import dataset, sources, tfds_sets
from tfmulti.distribution import allocator, devices, gpulibs
from tfmulti.rundir import names

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tfmulti(*args, cwd=ROOT):
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    return subprocess.run([sys.executable, "-m", "tfmulti.main", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def assert_one_line_error(result, *words):
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr  # one clear line, no traceback, no start-up noise
    assert lines[0].startswith("tfmulti: error: ")
    for word in words:
        assert word in lines[0]


BAD_FLAGS = [
    # With no GPU, the line says why (here: no driver), as gpulibs finds it on this machine.
    (["--num_gpus=2"], ["--num_gpus=2 asks for 2 GPUs but TensorFlow sees 0", "--cpu_replicas=2",
                        gpulibs.gpu_libraries_problem() or "(TensorFlow: "]),
    (["--num_gpus=-3"], ["--num_gpus=-3"]),
    (["--gpus=0,1"], ["--gpus=0,1: no GPU 0, TensorFlow sees 0"]),
    (["--per_replica_batch_size=8", "--global_batch_size=16"], ["both given"]),
    (["--per_replica_batch_size=-4"], ["--per_replica_batch_size=-4"]),
    (["--dataset=imagenet"], ["--dataset=imagenet", "fashion_mnist, synthetic, or your own"]),
    (["--cpu_replicas=2", "--global_batch_size=33"], ["does not divide over 2 replicas"]),
    (["--epochs=0", "--dataset=synthetic"], ["--epochs=0"]),
    (["--num_gpus=1", "--cpu_replicas=2"], ["not both"]),
    (["--base_lr=abc"], ["--base_lr"]),
    (["stray"], ["unexpected arguments: stray"]),
    (["--worker_hosts=localhost:1,localhost:2", "--worker_timeout=0"], ["--worker_timeout=0"]),
]


def assert_one_line(code, err, *words):
    assert code != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1, err  # one clear line, no traceback
    assert lines[0].startswith("tfmulti: error: ")
    for word in words:
        assert word in lines[0]


@pytest.mark.parametrize("args, words", BAD_FLAGS[1:], ids=[" ".join(a) for a, _ in BAD_FLAGS[1:]])
def test_bad_flags_exit_with_one_line(tool, tmp_path, args, words):
    """In this process, the way the command runs them (cli.main); nothing made on disk."""
    code, _, err = tool("main", *args, f"--model_dir={tmp_path}/run")
    assert_one_line(code, err, *words)
    assert not (tmp_path / "run").exists(), args  # nothing made for a refused command


def test_a_refused_command_is_one_line_from_a_real_process(tmp_path):
    """The real command: TensorFlow's start-up lines held back, and quoted when they say why
    there is no GPU (the other refusals run in this process, the same code path)."""
    assert_one_line_error(tfmulti(*BAD_FLAGS[0][0], f"--model_dir={tmp_path}/run"),
                          *BAD_FLAGS[0][1])
    assert not (tmp_path / "run").exists()


def test_another_tools_flag_is_refused_in_one_line(tool, tmp_path):
    code, _, err = tool("main", "--allreduce=ring", f"--model_dir={tmp_path}/run")
    assert_one_line(code, err, "--allreduce belongs to python -m tfmulti.scratch")
    assert not (tmp_path / "run").exists()


@pytest.mark.soak  # make test: the IDX reader's faults in-process (test_data.py), bad data
def test_bad_data_leaves_nothing_on_disk(tmp_path):  # in a real process (test_userdata.py)
    """Checked before anything is made: no runs/<time>-... folder per failed attempt (a real
    process: the data is read once the devices are configured)."""
    data_dir = tmp_path / "idx"
    data_dir.mkdir()
    bad = data_dir / "train-images-idx3-ubyte.gz"
    bad.write_bytes(b"garbage")
    result = tfmulti("--dataset=fashion_mnist", f"--data_dir={data_dir}", "--epochs=1",
                     cwd=tmp_path)
    assert_one_line_error(result, str(bad))
    assert sorted(os.listdir(tmp_path)) == ["idx"]


def test_no_tfds_warning_before_the_download_error(tmp_path, caplog):
    """A TFDS folder left by an earlier failed download made TFDS log "Variant folder ... has
    no dataset_info.json" before tfmulti's own line."""
    from tfmulti.errors import DataError

    (tmp_path / "fashion_mnist" / "3.0.1").mkdir(parents=True)

    def offline(url):
        raise OSError("unreachable")

    with pytest.raises(DataError, match="cannot download Fashion-MNIST"):
        tfds_sets.load_tfds(str(tmp_path), check_network=offline)
    assert not [r for r in caplog.records if "Variant folder" in r.getMessage()]


def test_the_book_flagfiles_ask_for_gpus(tool, tmp_path, monkeypatch):
    """Where no GPU is visible (the tests hide them) they stop at once, naming the GPU count
    they need."""
    monkeypatch.chdir(ROOT)
    for name, count in (("one_gpu.cfg", 1), ("two_gpus.cfg", 2)):
        code, _, err = tool("main", f"--flagfile=flags/{name}", f"--model_dir={tmp_path}/{count}")
        assert_one_line(code, err, f"asks for {count} GPU")


HELPED = ("--num_gpus", "--cpu_replicas", "--per_replica_batch_size", "--base_lr",
          "--lr_scaling", "--dataset", "--[no]sync_batchnorm", "--[no]show_replicas")


def test_help_is_readable_from_the_console_script():
    """`tfmulti --help`, the script pip made: a real process, nothing of TensorFlow's
    start-up. And the scratch lesson's own default rate, listed without its tool's module."""
    script = os.path.join(os.path.dirname(sys.executable), "tfmulti")
    assert os.path.exists(script), "pip install -e . should have made the tfmulti script"
    result = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=120,
                            env={k: v for k, v in os.environ.items()
                                 if k != "TF_CPP_MIN_LOG_LEVEL"})
    assert result.stderr == ""  # absl exits 1 after help; what matters is what it printed
    assert "Trains the book" in result.stdout
    for flag in HELPED:
        assert flag in result.stdout
    scratch = subprocess.run([script, "scratch", "--help"], capture_output=True, text=True,
                             timeout=120).stdout
    assert "--base_lr" in scratch and "(default: '0.2')" in scratch.split("--base_lr")[1]


@pytest.mark.parametrize("tool", ["main", "tune", "bench"])
def test_help_comes_at_once_without_tensorflow(tool):
    """Every flag is defined without TensorFlow, so --help imports neither it nor Keras (it
    took 4-5 s of their start-up on 2 cores), in a real process."""
    shown = ("import sys; from tfmulti import cli\ntry: cli.main(sys.argv[1])\n"
             "except SystemExit: pass\n"
             "print(sorted({m.split('.')[0] for m in sys.modules} & {'tensorflow', 'keras'}))")
    result = subprocess.run([sys.executable, "-c", shown, tool, "--help"], capture_output=True,
                            text=True, timeout=120)
    assert "Try --helpfull" in result.stdout and result.stdout.endswith("\n[]\n"), result


def test_help_is_asked_by_a_help_flag_not_by_a_flags_value():
    """`--model_dir --help` names a folder (absl's two-word form): the run goes on as before,
    not to the help that would print nothing."""
    from tfmulti import cli

    asked = [["--help"], ["--epochs", "2", "-?"], ["--show_replicas", "--helpfull"],
             ["--nosync_batchnorm", "--helpshort"], ["--flagfile", "f.cfg", "--help"]]
    not_asked = [["--model_dir", "--help"], ["--model_dir=--help"], ["--flagfile", "--help"],
                 ["--workers=2", "--", "--help"], ["--epochs=2"]]
    assert [cli.wants_help(["tfmulti", *args]) for args in asked] == [True] * len(asked)
    assert [cli.wants_help(["tfmulti", *args]) for args in not_asked] == [False] * len(not_asked)


def test_helpfull_is_readable(tool):
    """In this process (its usage text is pytest's: absl prints __main__'s docstring)."""
    _, out, err = tool("main", "--helpfull")
    assert err == "" and "--[no]helpfull" in out
    for flag in HELPED:
        assert flag in out


def test_smoke_flagfile_trains_and_reports(smoke_run):
    """The whole job end to end, started as make run starts it: TCMalloc preloaded where it
    is installed (and the report says which malloc the run had). (The same command again on
    a finished run: test_batchsize.py's auto run, through the real tfmulti.main.)"""
    result, model_dir, malloc = smoke_run
    out = result.stdout.splitlines()
    values = [line.split(": ", 1)[1] for line in out if line.startswith("  CPU:")]
    assert len(values) == 2 and values[0] == values[1]  # one copy on each replica
    line = next(line for line in out if line.startswith("test acc: "))
    assert "sec/epoch on [CPU:0, CPU:1]" in line and "not Fashion-MNIST" in line
    metrics = json.loads((model_dir / "metrics.json").read_text())
    assert metrics["config"]["cpu_replicas"] == 2 and len(metrics["epochs"]) == 2
    assert metrics["command"].endswith("--show_replicas") and metrics["workers"] == 1
    assert metrics["versions"]["malloc"] == malloc
    assert (model_dir / "accuracy.png").exists() and (model_dir / "model.keras").exists()
    # the CPU kernels and threads it ran, said before the first step and kept in run.json
    chosen = json.loads((model_dir / "run.json").read_text())["cpu_kernels"]
    assert kernels.line(chosen) in out and chosen == metrics["cpu_kernels"]
    assert (chosen["intra_op_threads"], chosen["inter_op_threads"]) == devices.cpu_thread_pools(2)
    assert chosen["chosen_by"] == kernels.chosen_by()  # the suite's environment, as the run's
    assert chosen["cpu_avx512"] == kernels.cpu_has_avx512()
    # TCMalloc preloaded: nothing said of the malloc; else glibc's, its buffers kept by the
    # start-up (unless the environment sets glibc's thresholds)
    kept = sys.platform == "linux" and not allocator.tuned_by_you(os.environ)
    said = allocator.run_line(os.environ, lambda: malloc, kept)
    assert [line for line in out if line.startswith("malloc: ")] == ([said] if said else [])
    assert ("buffers kept" in said) == (malloc == "system" and kept)


def test_a_cpu_run_without_tcmalloc_says_which_malloc_it_has(tool, one_replica, tmp_path):
    """A run on the CPU in this process (make test preloads nothing: the system's malloc)
    says which malloc it has in its first lines, and how to get TCMalloc where glibc's
    thresholds were not set (an injected strategy: no start-up set them); nothing where
    TCMalloc is preloaded."""
    code, out, err = tool("main", "--model=lenet", "--dataset=synthetic", "--epochs=1",
                          "--synthetic_train_size=128", "--synthetic_test_size=64",
                          "--global_batch_size=64", f"--model_dir={tmp_path}/run",
                          strategy=one_replica)
    assert code == 0, err
    said = allocator.run_line()
    assert [line for line in out.splitlines() if line.startswith("malloc: ")] == (
        [said] if said else [])
    assert bool(said) == (allocator.loaded_malloc() == "system")


def test_a_short_run_learns_and_reports(smoke_run, tmp_path):
    """The suite's end-to-end run (flags/cpu_smoke.cfg: width 8, 2 epochs, 2 replicas of 32,
    base_lr 0.4): it learns, and every report file says what it did."""
    result, model_dir, _ = smoke_run
    model_dir = str(model_dir)
    dataset = sources.load("synthetic", synthetic_train_size=1024, synthetic_test_size=300, seed=0)
    with open(os.path.join(model_dir, names.METRICS_FILE)) as f:
        metrics = json.load(f)
    history, line = metrics["epochs"], metrics["summary"]
    assert history[-1]["test_acc"] > 0.5  # chance is 0.1
    assert line.startswith(f"test acc: {history[-1]['test_acc']:.2f}, ") and line in result.stdout
    assert "sec/epoch on [CPU:0, CPU:1]" in line and line.endswith(
        "%, synthetic Fashion-like data (not Fashion-MNIST)") and "images/s, MFU " in line
    # model FLOPs utilization: the FLOPs counted from the graph at the epoch's speed over the
    # peak measured at the start (tests/test_flops.py checks the count against a hand count)
    for r in history:
        assert r["mfu"] == pytest.approx(metrics["flops_per_example"] * r["images_per_sec"]
                                         / (metrics["peak_gflops"] * 1e9), rel=1e-6)
    assert metrics["dataset"] == "synthetic Fashion-like data (not Fashion-MNIST)"
    assert metrics["devices"] == ["CPU:0", "CPU:1"] and metrics["global_batch_size"] == 64
    assert metrics["learning_rate"] == pytest.approx(0.1)
    assert metrics["command"] == ("python -m tfmulti.main --flagfile=flags/cpu_smoke.cfg "
                                  f"--model_dir={model_dir} --show_replicas")  # runnable
    assert metrics["config"]["width"] == 8 and metrics["config"]["base_lr"] == 0.4
    assert [e["epoch"] for e in metrics["epochs"]] == [1, 2]
    assert all(e["test_examples"] == 300 and e["images_per_sec"] > 0 for e in metrics["epochs"])
    assert metrics["summary"] == line and "tensorflow" in metrics["versions"]
    with open(os.path.join(model_dir, names.PLOT_FILE), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    for part in ("train", "test"):
        assert any(name.startswith("events.out.tfevents") for name in os.listdir(
            os.path.join(model_dir, names.TENSORBOARD_DIR, part)))
    # TensorBoard's epoch figures are metrics.json's: speed, utilization, where the time went
    from test_report import scalars

    for tag, key in (("epoch_images_per_sec", "images_per_sec"), ("epoch_mfu", "mfu"),
                     *((f"epoch_{k}_share", f"{k}_share")
                       for k in ("input_wait", "compute", "allreduce"))):
        assert scalars(model_dir, "train", tag) == [
            (r["epoch"], pytest.approx(r[key], rel=1e-6)) for r in history], tag
    assert sum(history[-1][f"{k}_share"] for k in ("input_wait", "compute", "allreduce")) <= 1
    assert os.listdir(os.path.join(model_dir, "checkpoints"))
    # model.keras (ResNet-18's batch norm as Keras's own) and the SavedModel, where tfmulti is not
    used = plain_consumer.consume(model_dir, dataset.test_features, dataset.test_targets, tmp_path)
    assert used["keras_acc"] == pytest.approx(history[-1]["test_acc"], abs=1e-6), used
    assert used["saved_acc"] == pytest.approx(history[-1]["test_acc"], abs=1e-6), used
    assert not used["tfmulti_imported"] and used["batch_dimension"] is None
    with open(os.path.join(model_dir, names.CLASS_NAMES_FILE)) as f:
        assert f.read().splitlines() == list(dataset.class_names)


def test_evaluate_gives_the_runs_accuracy_and_a_confusion_matrix(smoke_run, tool):
    """python -m tfmulti.evaluate on the smoke run's folder, its own data set (run.json says
    which): the run's last test accuracy and loss, a confusion matrix of every test image,
    per-class accuracy, a PNG."""
    _, model_dir, _ = smoke_run
    code, out, err = tool("evaluate", f"--model_dir={model_dir}")
    assert code == 0, err
    with open(os.path.join(model_dir, names.METRICS_FILE)) as f:
        last = json.load(f)["epochs"][-1]
    with open(os.path.join(model_dir, "evaluation-synthetic.json")) as f:
        result = json.load(f)
    assert result["accuracy"] == pytest.approx(last["test_acc"], abs=1e-6)
    assert result["loss"] == pytest.approx(last["test_loss"], rel=1e-4)
    assert sum(map(sum, result["confusion"])) == result["examples"] == 300
    assert list(result["per_class"]) == list(dataset.FASHION_MNIST_CLASSES)
    assert f"test acc {last['test_acc']:.4f} (300 images)" in out and "per class: " in out
    # which model was evaluated, and precision, recall, F1 and support per class
    assert result["evaluated"] == os.path.join(str(model_dir), names.MODEL_FILE)
    assert result["after_step"] == last["step"]
    assert out.startswith(f"evaluated {result['evaluated']}, the run's model after step "
                          f"{last['step']}\n")
    scores = result["per_class_scores"]
    assert sum(s["support"] for s in scores.values()) == 300
    confusion = np.array(result["confusion"])
    for i, s in enumerate(scores.values()):
        assert s["recall"] == pytest.approx(confusion[i, i] / confusion[i].sum())
    assert "precision" in out and "support" in out
    with open(os.path.join(model_dir, "confusion-synthetic.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args, words", [
    ([], "give --model_dir=RUN"),
    (["--model_dir={tmp}"], "holds no run.json: not the folder of a tfmulti run"),
    (["--model_dir={run}", "--epochs=3"], "not flags of python -m tfmulti.evaluate: --epochs"),
])
def test_evaluate_refuses_in_one_line(tool, tmp_path, smoke_run, args, words):
    args = [a.format(tmp=tmp_path, run=smoke_run[1]) for a in args]
    code, _, err = tool("evaluate", *args)
    assert code == 1 and len(err.strip().splitlines()) == 1 and words in err, err


def test_evaluate_imports_no_code_a_run_folder_names_unless_it_is_the_recorded_file(
        tool, tmp_path, smoke_run, monkeypatch):
    """run.json is a file anyone could have written: evaluate of such a folder does not
    import (run) the MODULE:FUNCTION it names unless the file found here has the hash the
    run recorded; --dataset given by the user is the user's choice."""
    import hashlib

    run = tmp_path / "theirs"
    shutil.copytree(smoke_run[1], run)
    evil = tmp_path / "evil.py"
    evil.write_text("import pathlib\npathlib.Path('imported').write_text('ran')\n"
                    "def load():\n    raise RuntimeError('not data')\n")
    recorded = json.loads((run / "run.json").read_text())
    recorded["config"]["dataset"] = "evil:load"
    recorded["your_code"] = {"dataset": {"module": "evil", "function": "load",
                                         "file": "evil.py", "sha256": "0" * 16}}
    (run / "run.json").write_text(json.dumps(recorded))
    monkeypatch.chdir(tmp_path)
    code, _, err = tool("evaluate", f"--model_dir={run}")
    assert code == 1 and err.strip().splitlines() == [
        f"tfmulti: error: --model_dir={run}: its run.json names the data function evil:load, "
        "and the evil found here is not the file the run recorded (another hash, or none); "
        "give --dataset=evil:load yourself to run it"]
    assert not (tmp_path / "imported").exists()  # nothing of it ran
    # in a package: finding evilpkg.data the usual way imports evilpkg (its __init__ ran)
    (tmp_path / "evilpkg").mkdir()
    (tmp_path / "evilpkg" / "__init__.py").write_text(
        "import pathlib\npathlib.Path('package imported').write_text('ran')\n")
    (tmp_path / "evilpkg" / "data.py").write_text(evil.read_text())
    packaged = {**recorded, "config": {**recorded["config"], "dataset": "evilpkg.data:load"}}
    (run / "run.json").write_text(json.dumps(packaged))
    code, _, err = tool("evaluate", f"--model_dir={run}")
    assert code == 1 and "the evilpkg.data found here is not the file the run recorded" in err
    assert not (tmp_path / "package imported").exists() and not (tmp_path / "imported").exists()
    recorded["your_code"]["dataset"]["sha256"] = hashlib.sha256(
        evil.read_bytes()).hexdigest()[:16]  # the recorded file: imported as the run's code
    (run / "run.json").write_text(json.dumps(recorded))
    code, _, err = tool("evaluate", f"--model_dir={run}")
    assert code == 1 and "--dataset=evil:load raised RuntimeError: not data" in err, err
    assert (tmp_path / "imported").read_text() == "ran"


def test_a_flagfile_that_cannot_be_read_is_one_plain_line(tool, tmp_path):
    code, _, err = tool("main", f"--flagfile={tmp_path / 'nope.cfg'}")
    assert code == 1 and err.strip().splitlines() == [
        "tfmulti: error: a --flagfile cannot be read: [Errno 2] No such file or directory: "
        f"'{tmp_path / 'nope.cfg'}'"]


def test_the_recorded_command_runs_as_written():
    """metrics.json's command: python -m for a tool (not the path of tfmulti/main.py), every
    word quoted as the shell needs it; another program's command as it was."""
    from tfmulti.run import flagdefs

    main_py = os.path.join(os.path.dirname(flagdefs.__file__), "..", "main.py")
    assert flagdefs.command_line([main_py, "--flagfile=my flags.cfg", "--epochs=2"]) == (
        "python -m tfmulti.main '--flagfile=my flags.cfg' --epochs=2")
    assert flagdefs.command_line(["/usr/bin/tfmulti", "--epochs=2"]) == (
        "/usr/bin/tfmulti --epochs=2")
