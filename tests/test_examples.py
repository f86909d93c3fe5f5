"""examples/: a user's projects (a model file, a data file), and the commands their READMEs
show, run as written in a copy of the folder through real processes: your_project (an image
classifier) and your_task (a text classifier on token ids, a regression on named inputs)."""
import csv
import json
import os
import shlex
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROJECT = os.path.join(ROOT, "examples", "your_project")
TASK_PROJECT = os.path.join(ROOT, "examples", "your_task")


def readme_commands(project=PROJECT):
    """The `python -m tfmulti.X ...` lines of the README's first code block, split."""
    with open(os.path.join(project, "README.md"), encoding="utf-8") as f:
        block = f.read().split("```")[1]
    return [shlex.split(line) for line in block.splitlines() if line.startswith("python -m")]


def command(tool):
    """The README's command for tool (tfmulti.main: the first one)."""
    return next(w for w in readme_commands() if w[2] == f"tfmulti.{tool}")


def run(folder, words, *extra):
    """words (python -> this interpreter) with extra flags, in folder, as a user runs it."""
    argv = [sys.executable if w == "python" else w for w in words] + list(extra)
    result = subprocess.run(argv, cwd=folder, env={**os.environ, "PYTHONPATH": ROOT},
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, (argv, result.stdout[-2000:], result.stderr[-2000:])
    return result.stdout


@pytest.fixture
def project(tmp_path):
    """A copy of the example folder, as a user would copy it."""
    folder = tmp_path / "your_project"
    shutil.copytree(PROJECT, folder, ignore=shutil.ignore_patterns("runs", "__pycache__"))
    return folder


def test_the_readme_shows_each_tool():
    assert [w[2] for w in readme_commands()] == [
        "tfmulti.doctor", "tfmulti.main", "tfmulti.evaluate", "tfmulti.tune", "tfmulti.main",
        "tfmulti.launch"]
    assert [w[2] for w in readme_commands(TASK_PROJECT)] == [
        "tfmulti.doctor", "tfmulti.main", "tfmulti.evaluate", "tfmulti.tune", "tfmulti.main",
        "tfmulti.main", "tfmulti.evaluate", "tfmulti.tune", "tfmulti.launch"]


@pytest.mark.soak
def test_the_example_trains_and_evaluates(project):
    """The README's main job (one epoch of its five) and evaluate on its folder (in make soak:
    test_userdata's real processes run the same paths on smaller data in make test)."""
    said = run(project, command("main"), "--epochs=1")
    assert ("Training my_models:small_cnn on my_data:shapes (3000 images, 3 classes) on "
            "[CPU:0, CPU:1]") in said
    said = run(project, command("evaluate"))
    assert "my_data:shapes: test loss " in said and "per class: " in said
    assert (project / "runs" / "shapes" / "saved_model").is_dir()


@pytest.mark.soak
def test_every_command_of_the_example_runs_as_written(project):
    """Every command of the README, in its order, as written: the doctor passes, the main job
    reaches the accuracy the README states, tuning's best.cfg reruns, 2 workers agree."""
    for words in readme_commands():
        said = run(project, words)
        if words[2] == "tfmulti.doctor":
            assert "no problems" in said
        if words[2] == "tfmulti.launch":
            folder = project / next(w.split("=", 1)[1] for w in words
                                    if w.startswith("--model_dir="))
            prints = json.loads((folder / "metrics.json").read_text())["weights_fingerprints"]
            assert len(prints) == 2 and len(set(prints)) == 1, said
    metrics = json.loads((project / "runs" / "shapes" / "metrics.json").read_text())
    assert metrics["epochs"][-1]["test_acc"] > 0.9, metrics["epochs"]
    assert (project / "runs" / "best" / "model.keras").exists()


@pytest.mark.soak
def test_every_command_of_the_task_example_runs_as_written(tmp_path):
    """examples/your_task's README, in its order, as written: the doctor passes, the text
    classifier and the regression reach what the README states, evaluate prints the
    regression's mae, tuning's best.cfg reruns, 2 workers agree."""
    project = tmp_path / "your_task"
    shutil.copytree(TASK_PROJECT, project, ignore=shutil.ignore_patterns("runs", "__pycache__"))
    for words in readme_commands(TASK_PROJECT):
        said = run(project, words)
        if words[2] == "tfmulti.doctor":
            assert "no problems" in said
        if words[2] == "tfmulti.evaluate" and "houses" in words[-1]:
            assert "my_data:houses: test loss " in said and ", test mae " in said, said
        if words[2] == "tfmulti.launch":
            folder = project / next(w.split("=", 1)[1] for w in words
                                    if w.startswith("--model_dir="))
            prints = json.loads((folder / "metrics.json").read_text())["weights_fingerprints"]
            assert len(prints) == 2 and len(set(prints)) == 1, said
    runs = project / "runs"
    reviews = json.loads((runs / "reviews" / "metrics.json").read_text())["epochs"][-1]
    assert reviews["test_acc"] > 0.9, reviews
    houses = json.loads((runs / "houses" / "metrics.json").read_text())["epochs"][-1]
    assert houses["test_mae"] < 0.06, houses
    assert (runs / "best-reviews" / "model.keras").exists()
    with open(runs / "tune-houses" / "trials.csv") as f:  # chosen on the validation mae
        assert [float(r["val_mae"]) < 0.2 for r in csv.DictReader(f)] == [True, True]
    assert "--validation_split=0.0" in (runs / "tune-houses" / "best.cfg").read_text()
