"""`make container-test`: builds the project's Dockerfile and runs the image as users do.

    sudo .venv/bin/python -m testing.container [--checks=quickstart,doctor,...] [--base=IMAGE]

Needs root (it may install and start the Docker engine, and it makes the base image from
Debian's packages). Steps, one line each:
  engine      a running Docker engine; installs Debian's docker.io and starts dockerd if needed
  base        the stand-in for tensorflow/tensorflow:2.21.0-gpu, made once and cached as an
              image: Debian bookworm (debootstrap), its Python 3.11, the pinned TensorFlow from
              PyPI installed system-wide, as in the official image (--base=IMAGE skips this)
  build       the Dockerfile with --build-arg BASE=..., offline: the wheels it needs beyond the
              base are downloaded here and handed over in wheels/ with PIP_NO_INDEX=1
  checks      each `docker run ... --init` as the image's user (uid 1000), with a time limit
Containers get the label tfmulti.container-test and are removed at the end, whatever happened;
so are the temporary folders mounted into them. Exit code 0 only if every step passed.
"""
import argparse
import glob
import gzip
import hashlib
import io
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tarfile
import tempfile
import time

from testing.harness import Failed, say, step

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CACHE = os.environ.get("TFMULTI_CONTAINER_CACHE",
                       os.path.join(os.path.expanduser("~"), ".cache", "tfmulti", "container"))
TF_PIN = "tensorflow==2.21.0"  # the official base image's TensorFlow
SUITE = "bookworm"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
STANDIN = "tfmulti-standin:tf2.21.0-bookworm-tcmalloc"
IMAGE = "tfmulti:container-test"
LABEL = "tfmulti.container-test"
BUILD_REQUIREMENTS = ("setuptools", "wheel")  # pip builds tfmulti itself in an isolated env
CHECKS = ("quickstart", "doctor", "tune", "launch", "stop", "idx", "host_user", "your_project",
          "your_task")
IMAGE_USER = 1000
READER = 65534  # "nobody": reads the report back, so any host user can
CHECK_TIMEOUT = 600
ENGINE_TIMEOUT = 60


def sh(args, timeout=None, check=True, **kwargs):
    """Runs args; on failure raises Failed with the last line it printed."""
    try:
        result = subprocess.run(args, capture_output=True, text=True, timeout=timeout, **kwargs)
    except FileNotFoundError:
        raise Failed(f"{args[0]} not found")
    except subprocess.TimeoutExpired:
        raise Failed(f"`{' '.join(args[:3])} ...` did not finish within {timeout:.0f} s")
    if check and result.returncode != 0:
        raise Failed(f"`{' '.join(args[:3])} ...` exit {result.returncode}: "
                     f"{last_line(result.stderr + result.stdout)}")
    return result


def last_line(text):
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if re.search(r"error|denied|failed|not found", line, re.I)]
    return (errors or lines or ["(no output)"])[-1][:300]


# --- the engine ------------------------------------------------------------------------------

def engine_running():
    try:
        return subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"],
                              capture_output=True, text=True, timeout=20).returncode == 0
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return False


def ensure_engine(timeout):
    """A running engine: installs docker.io with apt-get and starts dockerd when needed."""
    if engine_running():
        return "running (" + server_version() + ")"
    if shutil.which("dockerd") is None or shutil.which("docker") is None:
        if shutil.which("apt-get") is None:
            raise Failed("no Docker engine running, and none can be installed here "
                         "(no apt-get): install Docker and start it")
        if os.geteuid() != 0:
            raise Failed("no Docker engine running; installing one needs root (sudo)")
        sh(["apt-get", "update", "-qq"], timeout=600)
        sh(["apt-get", "install", "-y", "-qq", "docker.io"], timeout=900,
           env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"))
    if os.geteuid() != 0:
        raise Failed("the Docker engine is not running; starting dockerd needs root (sudo)")
    os.makedirs(CACHE, exist_ok=True)
    log = open(os.path.join(CACHE, "dockerd.log"), "ab")
    process = subprocess.Popen(["dockerd"], stdout=log, stderr=log, start_new_session=True)
    deadline = time.monotonic() + timeout
    while not engine_running():
        if process.poll() is not None:
            raise Failed(f"dockerd exited {process.returncode}; see {log.name}")
        if time.monotonic() > deadline:
            process.kill()
            raise Failed(f"dockerd did not answer within {timeout:.0f} s; see {log.name}")
        time.sleep(0.5)
    return f"started dockerd (pid {process.pid}, {server_version()}, log {log.name})"


def server_version():
    return "Docker " + sh(["docker", "info", "--format", "{{.ServerVersion}}"],
                          timeout=20).stdout.strip()


def image_exists(name):
    return sh(["docker", "image", "inspect", name], timeout=30, check=False).returncode == 0


# --- wheels from PyPI, on the host -----------------------------------------------------------

def download_wheels(what, folder):
    """Wheels for `what` (pip requirement or a project folder) into folder; sdists become
    wheels so the image installs without building anything."""
    complete = os.path.join(folder, ".complete")
    if os.path.exists(complete):
        return sorted(glob.glob(os.path.join(folder, "*.whl")))
    os.makedirs(folder, exist_ok=True)
    sh([sys.executable, "-m", "pip", "download", "--quiet", "--dest", folder, what], timeout=1800)
    for sdist in (glob.glob(os.path.join(folder, "*.tar.gz"))
                  + glob.glob(os.path.join(folder, "*.zip"))):
        sh([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", folder,
            sdist], timeout=600)
        os.remove(sdist)
    open(complete, "w").close()
    return sorted(glob.glob(os.path.join(folder, "*.whl")))


def distribution(wheel_path):
    """The normalised project name of a wheel file."""
    return re.sub(r"[-_.]+", "-", os.path.basename(wheel_path).split("-")[0]).lower()


def needed_wheels(wheels, installed):
    """The wheels a base with `installed` distributions lacks, and pip's build requirements."""
    keep = set(BUILD_REQUIREMENTS)
    return [w for w in wheels if distribution(w) not in installed or distribution(w) in keep]


def setup_digest():
    with open(os.path.join(ROOT, "setup.py"), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:12]


# --- the stand-in base -----------------------------------------------------------------------

def make_standin(tag):
    """Debian bookworm with Python 3.11 and TensorFlow installed system-wide, imported as tag."""
    if shutil.which("debootstrap") is None:
        sh(["apt-get", "install", "-y", "-qq", "debootstrap"], timeout=600,
           env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"))
    wheels = download_wheels(TF_PIN, os.path.join(CACHE, "base-wheels"))
    with tempfile.TemporaryDirectory(prefix="standin-", dir=CACHE) as work:
        rootfs = os.path.join(work, "rootfs")
        sh(["debootstrap", "--variant=minbase",
            "--include=python3,python3-pip,python3-venv,libtcmalloc-minimal4",
            SUITE, rootfs, DEBIAN_MIRROR], timeout=1800)
        inside = os.path.join(rootfs, "tmp", "wheels")
        os.makedirs(inside)
        for wheel in wheels:
            shutil.copy(wheel, inside)
        # The official image's pip installs into the system Python; Debian's refuses (PEP 668).
        for marker in glob.glob(os.path.join(rootfs, "usr/lib/python3*/EXTERNALLY-MANAGED")):
            os.remove(marker)
        sh(["chroot", rootfs, "python3", "-m", "pip", "install", "--quiet", "--no-cache-dir",
            "--no-index", "--find-links", "/tmp/wheels", TF_PIN], timeout=1800,
           env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root", "LANG": "C.UTF-8"})
        shutil.rmtree(inside)
        shutil.rmtree(os.path.join(rootfs, "var/cache/apt/archives"), ignore_errors=True)
        tar = subprocess.Popen(["tar", "--numeric-owner", "-C", rootfs, "-c", "."],
                               stdout=subprocess.PIPE)
        sh(["docker", "import",
            "--change", "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "--change", "ENV LANG=C.UTF-8", "--change", 'CMD ["bash"]', "-", tag],
           stdin=tar.stdout, timeout=1800)
        tar.wait()
    return tag


def describe_base(tag):
    """What the base has: (a line naming Python and TensorFlow, the set of distributions)."""
    out = sh(["docker", "run", "--rm", "--label", f"{LABEL}=1", "--entrypoint", "python3", tag,
              "-c", "import sys, json, importlib.metadata as m; print(json.dumps([sys.version."
              "split()[0], sorted({d.metadata['Name'] for d in m.distributions()})]))"],
             timeout=120).stdout
    version, names = json.loads(out)
    installed = {re.sub(r"[-_.]+", "-", name).lower() for name in names}
    tf = [m for m in names if m.lower() == "tensorflow"]
    tf_version = sh(["docker", "run", "--rm", "--label", f"{LABEL}=1", "--entrypoint", "python3",
                     tag, "-c", "import importlib.metadata as m; print(m.version('tensorflow'))"],
                    timeout=120).stdout.strip() if tf else "missing"
    return f"Python {version}, TensorFlow {tf_version}", installed


# --- the image ------------------------------------------------------------------------------

def build_context(wheels):
    """The project folder as a tar stream, with `wheels` as its wheels/ folder. Docker applies
    .dockerignore to it as to any context. GNU format: docker does not take Python's default
    (PAX) stream for an archive and reads it as a Dockerfile."""
    buffer = io.BytesIO()
    skip = {".git", ".venv", "runs", "wheels", ".pytest_cache"}
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for name in sorted(os.listdir(ROOT)):
            if name not in skip:
                tar.add(os.path.join(ROOT, name), arcname=name)
        tar.add(os.path.join(ROOT, "wheels", "README.md"), arcname="wheels/README.md")
        for wheel in wheels:
            tar.add(wheel, arcname="wheels/" + os.path.basename(wheel))
    return buffer.getvalue()


def image_id(tag):
    result = sh(["docker", "image", "inspect", "--format", "{{.Id}}", tag], timeout=30,
                check=False)
    return result.stdout.strip() if result.returncode == 0 else None


def build_image(base, wheels, tag, log_path):
    """Builds tag; the image it replaces is removed (else every rebuild leaves 3 GB behind)."""
    context = build_context(wheels)
    previous = image_id(tag)
    with open(log_path, "wb") as log:
        result = subprocess.run(
            ["docker", "build", "--force-rm", "--build-arg", f"BASE={base}",
             "--build-arg", "PIP_NO_INDEX=1", "-t", tag, "-"],
            input=context, stdout=log, stderr=subprocess.STDOUT, timeout=1800)
    if result.returncode != 0:
        with open(log_path, errors="replace") as f:
            raise Failed(f"docker build exit {result.returncode}: {build_failure(f.read())} "
                         f"(log: {log_path})")
    if previous and previous != image_id(tag):
        sh(["docker", "image", "rm", previous], timeout=120, check=False)  # kept if in use
    return image_size(tag), len(context)


def build_failure(log):
    """'step N/M (INSTRUCTION): the error it printed' from a docker build log."""
    log = re.sub(r"\x1b\[[0-9;]*m", "", log)
    steps = list(re.finditer(r"^Step (\d+/\d+) : (\S+)", log, re.M))
    if not steps:
        return last_line(log)
    after = [line for line in log[steps[-1].end():].splitlines()[1:]
             if line.strip() and not line.startswith((" --->", "The command ", "Removing "))]
    return f"step {steps[-1][1]} ({steps[-1][2]}): {last_line(chr(10).join(after))}"


def image_size(tag):
    return int(sh(["docker", "image", "inspect", "--format", "{{.Size}}", tag],
                  timeout=30).stdout.strip())


def wheels_layer_size(tag):
    """Bytes of the layer `COPY wheels/ /tmp/wheels/` made (an online build has ~0 there)."""
    out = sh(["docker", "history", "--human=false", "--no-trunc", "--format",
              "{{.CreatedBy}}\t{{.Size}}", tag], timeout=30).stdout
    sizes = [int(line.rsplit("\t", 1)[1]) for line in out.splitlines()
             if "COPY" in line and "in /tmp/wheels/" in line]
    return sum(sizes)


# --- running the image ----------------------------------------------------------------------

def docker_run(name, args, mounts=(), entrypoint=None, timeout=None, detach=False, user=None,
               env=()):
    """`docker run --init` of the image, as its own user unless `user` is given, with the
    environment variables `env` (NAME=value); returns (exit code, output)."""
    timeout = timeout or CHECK_TIMEOUT
    command = ["docker", "run", "--init", "--name", name, "--label", f"{LABEL}=1"]
    for variable in env:
        command += ["-e", variable]
    command += ["--user", user] if user else []
    command += [] if detach else ["--rm"]
    command += ["-d"] if detach else []
    for host, inside, mode in mounts:
        command += ["-v", f"{host}:{inside}:{mode}"]
    if entrypoint:
        command += ["--entrypoint", entrypoint]
    command += [IMAGE] + list(args)
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        remove_container(name)
        raise Failed(f"no exit within {timeout:.0f} s; container removed")
    return result.returncode, result.stdout + result.stderr


def remove_container(name):
    subprocess.run(["docker", "rm", "-f", name], capture_output=True, timeout=60)


def remove_labelled_containers():
    ids = sh(["docker", "ps", "-aq", "--filter", f"label={LABEL}"], timeout=30).stdout.split()
    if ids:
        sh(["docker", "rm", "-f", "--volumes"] + ids, timeout=120)
    return len(ids)


def expect(code, output, wanted=0):
    if code != wanted:
        raise Failed(f"exit {code} (wanted {wanted}): {last_line(output)}")


def test_acc_line(output):
    lines = [line for line in output.splitlines() if "test acc:" in line]
    if not lines:
        raise Failed(f"no 'test acc:' line: {last_line(output)}")
    return lines[-1].strip()


def runs_volume(work, name, owner=IMAGE_USER):
    """A host folder for /work/runs, owned by the image's user as `chown 1000 runs` makes it."""
    path = os.path.join(work, name)
    os.makedirs(path)
    os.chown(path, owner, owner)
    return path


def host_user():
    """The user who called sudo, or a uid no image has (as a host user's often is not 1000)."""
    uid = int(os.environ.get("SUDO_UID", "0"))
    return uid if uid not in (0, IMAGE_USER) else 4242


def read_as(uid, path):
    """The bytes of path read by a process with only uid's rights (not root's)."""
    result = subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                             "cat", path], capture_output=True, timeout=30)
    if result.returncode != 0:
        raise Failed(f"uid {uid} cannot read {path}: {result.stderr.decode().strip()}")
    return result.stdout


def check_quickstart(work):
    runs = runs_volume(work, "runs-quickstart")
    code, output = docker_run("tfmulti-ct-quickstart", ["--flagfile=flags/quickstart.cfg"],
                              mounts=[(runs, "/work/runs", "rw")])
    expect(code, output)
    line = test_acc_line(output)
    [run] = glob.glob(os.path.join(runs, "*-resnet18-synthetic")) or [None]
    if run is None:
        raise Failed(f"no run folder in the mounted runs/: {os.listdir(runs)}")
    owners = {os.stat(os.path.join(d, f)).st_uid for d, _, fs in os.walk(run) for f in fs}
    metrics = json.loads(read_as(READER, os.path.join(run, "metrics.json")))
    png = read_as(READER, os.path.join(run, "accuracy.png"))
    if not png.startswith(b"\x89PNG") or "test_acc" not in json.dumps(metrics):
        raise Failed("metrics.json or accuracy.png is not what the job writes")
    return (f"{line} | report in runs/{os.path.basename(run)}, files owned by uid "
            f"{sorted(owners)}, read back by uid {READER}")


def check_doctor(work):
    code, output = docker_run("tfmulti-ct-doctor", ["-m", "tfmulti.doctor", "--cpu_replicas=2",
                                                   "--dataset=synthetic"],
                              entrypoint="python3")
    expect(code, output)
    verdict = [line for line in output.splitlines() if line.startswith("tfmulti doctor:")]
    if verdict != ["tfmulti doctor: no problems; these flags would run"]:
        raise Failed(f"the doctor did not pass: {last_line(output)}")
    if "malloc: tcmalloc (preloaded)" not in output:
        raise Failed("the image's entry point did not preload TCMalloc: "
                     + next((line.strip() for line in output.splitlines()
                             if "malloc:" in line), "no malloc line"))
    kernels = [line.strip() for line in output.splitlines() if line.strip().startswith("kernels:")]
    return f"{verdict[0]} | malloc: tcmalloc | {(kernels or ['no kernels line'])[0]}"


def check_tune(work):
    runs = runs_volume(work, "runs-tune")
    code, output = docker_run(
        "tfmulti-ct-tune", ["-m", "tfmulti.tune", "--flagfile=flags/tune_smoke.cfg",
                            "--max_trials=2", "--model_dir=runs/tune"],
        mounts=[(runs, "/work/runs", "rw")], entrypoint="python3")
    expect(code, output)
    with open(os.path.join(runs, "tune", "trials.csv")) as f:
        rows = [line for line in f.read().splitlines()[1:] if line.strip()]
    if len(rows) != 2 or not os.path.exists(os.path.join(runs, "tune", "best.cfg")):
        raise Failed(
            f"{len(rows)} trials in trials.csv, best.cfg "
            f"{'written' if os.path.exists(os.path.join(runs, 'tune', 'best.cfg')) else 'missing'}")
    best = [line for line in output.splitlines() if line.startswith("best: ")]
    return f"2 trials in trials.csv, best.cfg written; {(best or ['no best: line'])[-1].strip()}"


def check_launch(work):
    runs = runs_volume(work, "runs-launch")
    code, output = docker_run(
        # Docker's seccomp profile refuses user namespaces: the launcher asks for the open
        # network, which in a container is the container's own
        "tfmulti-ct-launch", ["-m", "tfmulti.launch", "--workers=2", "--network=host", "--",
                              "--flagfile=flags/cpu_smoke.cfg", "--cpu_replicas=1",
                              "--model_dir=runs/launch"],
        mounts=[(runs, "/work/runs", "rw")], entrypoint="python3")
    expect(code, output)
    with open(os.path.join(runs, "launch", "metrics.json")) as f:
        metrics = json.load(f)
    prints = metrics.get("weights_fingerprints", [])
    if metrics.get("workers") != 2 or len(prints) != 2 or len(set(prints)) != 1:
        raise Failed(f"metrics.json: {metrics.get('workers')} workers, weights {prints}; "
                     "wanted 2 workers with the same weights")
    if "[worker 0] weights: the same on all 2 workers" not in output:
        raise Failed("the chief did not say that both workers hold the same weights")
    return f"workers 0 and 1, the same weights {prints[0]}; {test_acc_line(output)}"


def wait_for_log(name, pattern, timeout, what):
    """Waits until the container's output matches pattern (`what` it shows); returns it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        logs = subprocess.run(["docker", "logs", name], capture_output=True, text=True,
                              timeout=30)
        if re.search(pattern, logs.stdout + logs.stderr):
            return logs.stdout + logs.stderr
        state = sh(["docker", "inspect", "--format", "{{.State.Running}}", name], timeout=30)
        if state.stdout.strip() != "true":
            raise Failed(f"the container ended before {what}: "
                         f"{last_line(logs.stdout + logs.stderr)}")
        time.sleep(0.5)
    raise Failed(f"no {what} in the container's output within {timeout:.0f} s")


def stop_and_wait(name, timeout):
    sh(["docker", "stop", "--time", str(int(timeout)), name], timeout=timeout + 30)
    code = int(sh(["docker", "wait", name], timeout=60).stdout.strip())
    output = sh(["docker", "logs", name], timeout=30)
    remove_container(name)
    return code, output.stdout + output.stderr


def check_stop(work):
    """docker stop at three moments: while Python starts (it ends at once, 143: nothing to
    save), in epoch 1 and in a resumed run (each saves and exits 75); then the same docker run
    resumes and finishes."""
    runs = runs_volume(work, "runs-stop")
    args = ["--flagfile=flags/cpu_smoke.cfg", "--epochs=4", "--steps_per_call=4",
            "--model_dir=runs/stop"]
    mounts = [(runs, "/work/runs", "rw")]
    name = "tfmulti-ct-stop"
    code, output = docker_run(name, args, mounts=mounts, detach=True, timeout=120)
    expect(code, output)
    start = time.monotonic()
    code, output = stop_and_wait(name, timeout=30)
    early = time.monotonic() - start
    if code != 143 or early > 10:
        raise Failed(f"stopped while starting: exit {code} after {early:.0f} s (wanted 143 "
                     f"at once): {last_line(output)}")
    seen = []
    for moment in ("Epoch 1/4", "Epoch 3/4"):
        code, output = docker_run(name, args, mounts=mounts, detach=True, timeout=120)
        expect(code, output)
        wait_for_log(name, re.escape(moment) + r".*\n.*\d+/\d+", min(300, CHECK_TIMEOUT),
                     what=f"progress in '{moment}'")
        code, output = stop_and_wait(name, timeout=60)
        expect(code, output, wanted=75)
        saved = re.search(r"stopped by SIGTERM at step (\d+), checkpoint saved", output)
        if not saved:
            raise Failed(f"exit 75 without the checkpoint line: {last_line(output)}")
        seen.append(int(saved[1]))
    code, output = docker_run("tfmulti-ct-stop", args, mounts=mounts)
    expect(code, output)
    resumed = re.search(r"Epoch \d/4 \(resumed at step \d+", output) or \
        not re.search(r"Epoch 1/4", output)
    if not resumed:
        raise Failed("the rerun started again from epoch 1")
    return (f"docker stop while starting: exit 143 in {early:.1f} s; in training: saved at "
            f"steps {seen[0]} and {seen[1]}, exit 75 both times; the same docker run resumed "
            f"and finished: {test_acc_line(output)}")


def write_idx(path, array):
    """An IDX file as Fashion-MNIST ships them: magic with the type and rank, sizes, bytes."""
    header = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I",
                                                                     *array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype("uint8").tobytes())


def idx_folder(work):
    from tfmulti.data import synthetic
    (train_images, train_labels), (test_images, test_labels) = synthetic.make_dataset(
        train_size=2048, test_size=512, seed=3)
    folder = os.path.join(work, "idx")
    os.makedirs(folder)
    names = {"train-images-idx3-ubyte.gz": train_images,
             "train-labels-idx1-ubyte.gz": train_labels,
             "t10k-images-idx3-ubyte.gz": test_images,
             "t10k-labels-idx1-ubyte.gz": test_labels}
    for name, array in names.items():
        write_idx(os.path.join(folder, name), array)
    return folder


def folder_digest(folder):
    digest = hashlib.sha256()
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name), "rb") as f:
            digest.update(name.encode() + f.read())
        digest.update(str(os.stat(os.path.join(folder, name)).st_mtime_ns).encode())
    return digest.hexdigest()


def check_idx(work):
    data = idx_folder(work)
    before = folder_digest(data)
    runs = runs_volume(work, "runs-idx")
    code, output = docker_run(
        "tfmulti-ct-idx", ["--dataset=fashion_mnist", "--data_dir=data", "--cpu_replicas=2",
                           "--width=8", "--per_replica_batch_size=32", "--epochs=2",
                           "--model_dir=runs/idx"],
        mounts=[(data, "/work/data", "ro"), (runs, "/work/runs", "rw")])
    expect(code, output)
    line = test_acc_line(output)
    with open(os.path.join(runs, "idx", "metrics.json")) as f:
        source = json.load(f).get("dataset_source")
    if source != "IDX files in data":
        raise Failed(f"metrics.json names the data source {source!r}, not the mounted IDX files")
    if folder_digest(data) != before:
        raise Failed("the read-only data folder changed")
    return f"{line} | read from {source} (mounted :ro, unchanged)"


def check_host_user(work):
    """`docker run --user "$(id -u):$(id -g)"`: the report belongs to the host user."""
    uid = host_user()
    runs = runs_volume(work, "runs-user", owner=uid)
    code, output = docker_run("tfmulti-ct-user", ["--flagfile=flags/cpu_smoke.cfg",
                                                  "--model_dir=runs/user"],
                              mounts=[(runs, "/work/runs", "rw")], user=f"{uid}:{uid}")
    expect(code, output)
    run = os.path.join(runs, "user")
    owners = {os.stat(os.path.join(d, f)).st_uid for d, _, fs in os.walk(run) for f in fs}
    if owners != {uid}:
        raise Failed(f"files owned by {sorted(owners)}, not by --user {uid}")
    json.loads(read_as(uid, os.path.join(run, "metrics.json")))
    return f"--user {uid}:{uid}: {test_acc_line(output)} | every file owned by uid {uid}"


def check_your_project(work):
    """examples/your_project mounted read-only and put on PYTHONPATH, as its README shows:
    the user's model and data function train in the image, the report in a mounted runs/."""
    project = os.path.join(ROOT, "examples", "your_project")
    runs = runs_volume(work, "runs-project")
    code, output = docker_run(
        "tfmulti-ct-project", ["--model=my_models:small_cnn", "--dataset=my_data:shapes",
                               "--cpu_replicas=2", "--global_batch_size=64", "--base_lr=0.4",
                               "--momentum=0.9", "--epochs=2", "--model_dir=runs/container"],
        mounts=[(project, "/project", "ro"), (runs, "/work/runs", "rw")],
        env=["PYTHONPATH=/project"])
    expect(code, output)
    line = test_acc_line(output)
    saved = os.path.join(runs, "container", "saved_model", "saved_model.pb")
    if not os.path.exists(saved):
        raise Failed("no saved_model/ in the mounted runs/container")
    return f"{line} | my_models:small_cnn on my_data:shapes from /project (:ro), SavedModel written"


def check_your_task(work):
    """examples/your_task mounted read-only, as its README shows: a regression on named
    inputs, compiled with its own loss and metric, trains in the image and reports its test
    mae; a tuning session of the text classifier chooses on the validation part."""
    project = os.path.join(ROOT, "examples", "your_task")
    runs = runs_volume(work, "runs-task")
    mounts = [(project, "/project", "ro"), (runs, "/work/runs", "rw")]
    code, output = docker_run(
        "tfmulti-ct-task", ["--model=my_models:price_regression", "--dataset=my_data:houses",
                            "--cpu_replicas=2", "--global_batch_size=64", "--base_lr=0.4",
                            "--epochs=2", "--model_dir=runs/houses"],
        mounts=mounts, env=["PYTHONPATH=/project"])
    expect(code, output)
    mae = [line.strip() for line in output.splitlines() if "test mae:" in line]
    if not mae or not os.path.exists(os.path.join(runs, "houses", "model.keras")):
        raise Failed(f"no 'test mae:' line or no model.keras: {last_line(output)}")
    code, tuned = docker_run(
        "tfmulti-ct-task-tune", ["-m", "tfmulti.tune", "--model=my_models:tunable_text",
                                 "--dataset=my_data:reviews", "--cpu_replicas=2", "--epochs=2",
                                 "--max_trials=2", "--tune_batch_sizes=64",
                                 "--model_dir=runs/tune-reviews"],
        mounts=mounts, env=["PYTHONPATH=/project"], entrypoint="python3")
    expect(code, tuned)
    best = [line for line in tuned.splitlines() if line.startswith("best: val_accuracy")]
    if not best:
        raise Failed(f"no 'best: val_accuracy' line: {last_line(tuned)}")
    return f"{mae[-1][:70]} | text classifier's session: {best[-1][:60]}"


CHECK_FUNCTIONS = {"your_task": check_your_task, "your_project": check_your_project,
                   "host_user": check_host_user,
                   "quickstart": check_quickstart, "doctor": check_doctor, "tune": check_tune,
                   "launch": check_launch, "stop": check_stop, "idx": check_idx}


# --- main -----------------------------------------------------------------------------------

def prepare(base, prepared):
    """The base image (made once) and the wheels the build needs beyond it, into prepared."""
    if base is None:
        base = STANDIN
        if image_exists(base):
            made = "cached"
        else:
            make_standin(base)
            made = "made"
        detail = f"{base} {made} (Debian {SUITE}, "
    elif not image_exists(base):
        raise Failed(f"no image {base} (docker pull it, or leave out --base for the stand-in)")
    else:
        detail = f"{base} ("
    versions, installed = describe_base(base)
    wheels = download_wheels(ROOT, os.path.join(CACHE, "project-wheels-" + setup_digest()))
    prepared.update(base=base, wheels=needed_wheels(wheels, installed))
    return detail + versions + ")"


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checks", default=",".join(CHECKS),
                        help=f"comma-separated, of {', '.join(CHECKS)}; 'none' to only build")
    parser.add_argument("--base", default=None, help="an existing base image instead of the "
                        "Debian stand-in")
    parser.add_argument("--reuse_image", action="store_true",
                        help=f"run the checks on the {IMAGE} an earlier run built")
    parser.add_argument("--check_timeout", type=float, default=CHECK_TIMEOUT,
                        help="seconds each check may take")
    parser.add_argument("--engine_timeout", type=float, default=ENGINE_TIMEOUT,
                        help="seconds to wait for a dockerd it started")
    args = parser.parse_args(argv)
    args.checks = [] if args.checks == "none" else args.checks.split(",")
    unknown = [c for c in args.checks if c not in CHECKS]
    if unknown:
        parser.error(f"unknown check(s) {', '.join(unknown)}; known: {', '.join(CHECKS)}")
    return args


def main(argv=None):
    args = parse(sys.argv[1:] if argv is None else argv)
    global CHECK_TIMEOUT
    CHECK_TIMEOUT = args.check_timeout
    start = time.monotonic()
    if step("engine", ensure_engine, args.engine_timeout) is None:
        return 1
    failed = []
    try:
        if args.reuse_image and not image_exists(IMAGE):
            say(False, "build", f"--reuse_image: there is no {IMAGE}; run without it first")
            return 1
        if not args.reuse_image and not build(args.base):
            return 1
        with tempfile.TemporaryDirectory(prefix="checks-") as work:
            os.chmod(work, 0o755)  # the image's user and the reader walk through it
            for name in args.checks:
                if step(name, CHECK_FUNCTIONS[name], work) is None:
                    failed.append(name)
    finally:
        left = remove_labelled_containers()
        if left:
            print(f"     cleanup: removed {left} container(s)", flush=True)
    verdict = f"{len(args.checks) - len(failed)}/{len(args.checks)} checks passed"
    print(f"{'ok  ' if not failed else 'FAIL'} container-test: {verdict}"
          + (f" (failed: {', '.join(failed)})" if failed else "")
          + f" in {time.monotonic() - start:.0f} s", flush=True)
    return 1 if failed else 0


def build(base):
    """The base and build steps; True when both passed."""
    prepared = {}
    if step("base", prepare, base, prepared) is None:
        return False
    os.makedirs(CACHE, exist_ok=True)
    return step("build", describe_build, prepared["base"], prepared["wheels"]) is not None


def describe_build(base, wheels):
    size, context = build_image(base, wheels, IMAGE, os.path.join(CACHE, "build.log"))
    base_size, handed = image_size(base), wheels_layer_size(IMAGE)
    return (f"{IMAGE}: {size / 1e9:.2f} GB = base {base_size / 1e9:.2f} GB + tfmulti and its "
            f"dependencies {(size - base_size - handed) / 1e6:.0f} MB + the wheels/ layer "
            f"{handed / 1e6:.0f} MB ({len(wheels)} wheels; an online build has none); context "
            f"{context / 1e6:.0f} MB")


if __name__ == "__main__":
    sys.exit(main())
