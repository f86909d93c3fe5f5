"""`make container-test`, when things go wrong: each fault really happens (a build that fails,
a container killed at two moments, a check past its time limit, no engine and no way to get
one, an engine that never answers) and must give one FAIL line naming the step, a non-zero
exit, and no container, process or temporary folder left behind.

Needs root and a Docker engine, and the image the checks run on (`python -m testing.container` makes
it): run by `make container-test` after the checks, not by `make test`.
"""
import os
import re
import subprocess
import sys
import time

import pytest

from testing import container as driver

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def start(*args, env=None, tmp=None):
    environment = dict(os.environ, **(env or {}))
    if tmp is not None:
        environment["TMPDIR"] = str(tmp)
    return subprocess.Popen([sys.executable, "-m", "testing.container", *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=environment)


def finish(process, timeout=600):
    output, _ = process.communicate(timeout=timeout)
    return process.returncode, output


def fail_lines(output):
    return [line for line in output.splitlines() if line.startswith("FAIL")]


def labelled_containers():
    return subprocess.run(["docker", "ps", "-aq", "--filter", f"label={driver.LABEL}"],
                          capture_output=True, text=True, check=True).stdout.split()


def running(name):
    out = subprocess.run(["docker", "inspect", "--format", "{{.State.Running}}", name],
                         capture_output=True, text=True)
    return out.stdout.strip() == "true"


def logs(name):
    out = subprocess.run(["docker", "logs", name], capture_output=True, text=True)
    return out.stdout + out.stderr


def wait_until(condition, timeout, what):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} within {timeout} s"
        time.sleep(0.2)


@pytest.fixture(autouse=True)
def no_leftovers():
    assert driver.engine_running(), "no Docker engine: run python -m testing.container first"
    assert driver.image_exists(driver.IMAGE), "no image: run python -m testing.container first"
    yield
    left = labelled_containers() + exited_build_containers()
    if left:
        subprocess.run(["docker", "rm", "-f", *left], capture_output=True)
    assert not left, f"containers left behind: {left}"


def exited_build_containers():
    """Containers of build steps (a failed build leaves its step's container without
    --force-rm)."""
    out = subprocess.run(["docker", "ps", "-a", "--no-trunc", "--format", "{{.ID}}\t{{.Command}}"],
                         capture_output=True, text=True, check=True).stdout
    return [line.split("\t")[0] for line in out.splitlines() if "/bin/sh -c" in line]


def images_built_on(image):
    """Every image whose chain of parents reaches image (a failed build's cached steps)."""
    out = subprocess.run(["docker", "image", "ls", "-aq", "--no-trunc"], capture_output=True,
                         text=True, check=True).stdout.split()
    parents = {}
    for i in out:
        parents[i] = subprocess.run(["docker", "image", "inspect", "--format", "{{.Parent}}", i],
                                    capture_output=True, text=True).stdout.strip()
    root, found = driver.image_id(image), []
    for i in out:
        p = parents[i]
        while p and p != root:
            p = parents.get(p, "")
        if p == root:
            found.append(i)
    return found


@pytest.fixture
def base_without_pip():
    """The stand-in base with pip removed: the Dockerfile's install step fails in it."""
    tag = "tfmulti-test-nopip:1"
    context = "FROM {}\nRUN rm -rf /usr/lib/python3/dist-packages/pip\n".format(driver.STANDIN)
    subprocess.run(["docker", "build", "--force-rm", "-t", tag, "-"], input=context, text=True,
                   check=True, capture_output=True, timeout=300)
    yield tag
    for image in images_built_on(tag)[::-1]:
        subprocess.run(["docker", "rmi", image], capture_output=True)
    subprocess.run(["docker", "rmi", "-f", tag], capture_output=True)


def test_a_failing_build_is_one_line(base_without_pip, tmp_path):
    code, output = finish(start("--base", base_without_pip, "--checks=quickstart", tmp=tmp_path))
    assert code == 1
    [line] = fail_lines(output)
    assert line.startswith("FAIL build: docker build exit 1:") and "No module named pip" in line
    assert "quickstart" not in output  # nothing ran on an image that was not built
    assert os.listdir(tmp_path) == []


def test_a_missing_base_is_one_line(tmp_path):
    code, output = finish(start("--base", "tfmulti-no-such-base:0", "--checks=none",
                                tmp=tmp_path))
    assert code == 1
    assert fail_lines(output) == [line for line in output.splitlines()
                                  if line.startswith("FAIL base: no image tfmulti-no-such-base:0")]


@pytest.mark.parametrize("moment", ["just started", "training"])
def test_a_container_killed_during_a_check_fails_it(moment, tmp_path):
    """docker kill from outside, once right after the container starts, once in epoch 1."""
    name = "tfmulti-ct-quickstart"
    process = start("--reuse_image", "--checks=quickstart,doctor", tmp=tmp_path)
    wait_until(lambda: running(name), 120, "the quickstart container running")
    if moment == "training":
        wait_until(lambda: "Epoch 1/" in logs(name), 300, "epoch 1 in its output")
    subprocess.run(["docker", "kill", name], check=True, capture_output=True)
    code, output = finish(process)
    assert code == 1
    assert re.search(r"^FAIL quickstart: exit 137 \(wanted 0\)", output, re.M), output
    assert re.search(r"^ok   doctor: ", output, re.M), output  # the next check still runs
    assert "FAIL container-test: 1/2 checks passed (failed: quickstart)" in output
    assert os.listdir(tmp_path) == []  # the mounted runs/ folder went with it


def test_a_check_past_its_time_limit_is_removed(tmp_path):
    start_time = time.monotonic()
    code, output = finish(start("--reuse_image", "--checks=doctor", "--check_timeout=4",
                                tmp=tmp_path))
    assert code == 1 and time.monotonic() - start_time < 60
    [line] = fail_lines(output)[:1]
    assert line.startswith("FAIL doctor: no exit within 4 s; container removed")
    assert os.listdir(tmp_path) == []


def test_a_stop_check_whose_training_never_shows_is_given_up(tmp_path):
    """The stop check waits for training to show in the container's output at most
    --check_timeout seconds; the container it left running is removed."""
    start_time = time.monotonic()
    code, output = finish(start("--reuse_image", "--checks=stop", "--check_timeout=5",
                                tmp=tmp_path))
    assert code == 1 and time.monotonic() - start_time < 90
    assert re.search(r"^FAIL stop: no progress in 'Epoch 1/4' in the container's output "
                     r"within 5 s", output, re.M), output
    assert os.listdir(tmp_path) == []


def bin_folder(tmp_path, scripts):
    """A PATH holding python3 and the given executables, and nothing else."""
    folder = tmp_path / "bin"
    folder.mkdir()
    os.symlink(sys.executable, folder / "python3")
    for name, text in scripts.items():
        (folder / name).write_text("#!/bin/sh\n" + text)
        (folder / name).chmod(0o755)
    return str(folder)


def test_no_engine_and_no_way_to_install_one(tmp_path):
    path = bin_folder(tmp_path, {})
    code, output = finish(start("--checks=none", env={"PATH": path}))
    assert code == 1
    [line] = output.splitlines()
    assert re.fullmatch(r"FAIL engine: no Docker engine running, and none can be installed "
                        r"here \(no apt-get\): install Docker and start it \[\d+ s\]", line)


def test_an_engine_that_never_answers_is_given_up(tmp_path):
    """A dockerd that hangs (here: a script that sleeps) is waited for --engine_timeout
    seconds, then killed."""
    marker = tmp_path / "dockerd-pid"
    path = bin_folder(tmp_path, {"docker": "exit 1\n",
                                 "dockerd": f"echo $$ > {marker}\nexec sleep 1000\n"})
    cache = tmp_path / "cache"
    code, output = finish(start("--checks=none", "--engine_timeout=3",
                                env={"PATH": path + ":/usr/bin:/bin",
                                     "TFMULTI_CONTAINER_CACHE": str(cache)}), timeout=60)
    assert code == 1
    [line] = output.splitlines()
    assert line.startswith("FAIL engine: dockerd did not answer within 3 s; see ")
    pid = int(marker.read_text())
    wait_until(lambda: not os.path.exists(f"/proc/{pid}") or
               open(f"/proc/{pid}/stat").read().split()[2] == "Z", 10, "the hung dockerd gone")
