"""--data_service: the training batches made by a real tf.data service (a dispatcher and worker
servers, `python -m tfmulti.dataservice`, each its own process on localhost). Each epoch gives
each example at most once; the run says what it keeps of resume; a service worker killed
mid-run leaves the others serving; a dispatcher (or the only worker) killed stops the run
within its bound in one line, its checkpoints kept, and the same command resumes; the
servers stop at once with code 0."""
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import tensorflow as tf
from test_resume import environment

from tfmulti.data import service
from tfmulti.errors import UsageError
from tfmulti.processes import watchdog
from tfmulti.run import config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
START_BOUND = 60  # s a server may take to say it listens (TensorFlow's import included)


def free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


class Servers:
    """A dispatcher and `workers` worker servers on localhost, each a process."""

    def __init__(self, workers=1):
        self.port = free_port()
        self.dispatcher = self.start("dispatcher", f"--port={self.port}")
        self.workers = [self.start("worker", f"--dispatcher=localhost:{self.port}",
                                   "--advertise=localhost") for _ in range(workers)]

    @staticmethod
    def start(command, *flags):
        process = subprocess.Popen([sys.executable, "-m", "tfmulti.dataservice", command,
                                    *flags, "--trusted_network"], cwd=ROOT, env=environment(),
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        said = []
        reader = threading.Thread(target=lambda: said.append(process.stdout.readline()))
        reader.start()
        reader.join(START_BOUND)
        assert said and ("listening" in said[0] or "serving" in said[0]), (
            command, said, process.poll())
        process.said = said[0]
        return process

    @property
    def address(self):
        return f"localhost:{self.port}"

    def stop(self):
        for p in [self.dispatcher, *self.workers]:
            if p.poll() is None:
                p.kill()
            p.wait(30)


@pytest.fixture
def servers(request):
    made = []

    def make(workers=1):
        made.append(Servers(workers))
        return made[-1]

    yield make
    for s in made:
        s.stop()


def run_flags(model_dir, address, *extra, replicas=2):
    data = ([] if any(a.startswith("--dataset") for a in extra) else [
        "--dataset=synthetic", "--synthetic_train_size=512", "--synthetic_test_size=64"])
    return ["--model=lenet", "--width=4", *data, f"--cpu_replicas={replicas}",
            "--global_batch_size=32", "--epochs=2", "--steps_per_call=2",
            f"--data_service={address}", f"--model_dir={model_dir}", *extra]


def train(model_dir, address, *extra, replicas=2, timeout=300, wait=True):
    command = [sys.executable, "-m", "tfmulti.main",
               *run_flags(model_dir, address, *extra, replicas=replicas)]
    if not wait:
        return subprocess.Popen(command, cwd=ROOT, env=environment(), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    return subprocess.run(command, cwd=ROOT, env=environment(), capture_output=True, text=True,
                          timeout=timeout)


# ----------------------------------------------------------------------------- in process

def test_each_epoch_gives_each_example_at_most_once_whatever_the_layout():
    """The batches of every pipeline and replica of one epoch, made one by one from their
    numbers, are distinct examples (a permutation's slices), and the next epoch is another
    order of the same examples."""
    num_examples, per_replica = 1000, 8
    for replicas, pipelines in ((1, 1), (2, 1), (2, 2), (3, 2)):
        global_batch = per_replica * replicas * pipelines
        steps = num_examples // global_batch
        seen = {0: [], 1: []}
        for pipeline in range(pipelines):
            layout = (global_batch, replicas, pipeline, pipelines)
            for number in range(2 * steps * replicas):  # two epochs of this pipeline's batches
                got = service.examples_of_batch(tf.constant(number, tf.int64), layout,
                                                per_replica, steps, num_examples, seed=3)
                seen[number // (steps * replicas)].extend(got.numpy().tolist())
        for epoch in (0, 1):
            assert len(seen[epoch]) == steps * global_batch == len(set(seen[epoch]))
            assert all(0 <= i < num_examples for i in seen[epoch])
        assert seen[0] != seen[1]


def test_the_watchdog_stops_a_run_whose_calls_stop_within_its_bound(capsys):
    stopped = []
    dog = watchdog.Watchdog(0.5, "grpc://data-node:5050", exit=stopped.append,
                           checked_every=0.05)
    try:
        for step in range(1, 6):  # calls ending every 0.1 s: watched, not stopped
            time.sleep(0.1)
            dog.tick(step)
        assert stopped == []
        assert dog.bound() == pytest.approx(0.5 + 3 * 0.1, abs=0.1)
        start = time.monotonic()
        while not stopped and time.monotonic() - start < 5:
            time.sleep(0.02)
        assert stopped == [watchdog.STALLED_EXIT_CODE]
        assert 0.5 < time.monotonic() - start < 0.5 + 3 * 0.2 + 0.5
    finally:
        dog.stop()
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and said[0].startswith(
        "tfmulti: error: no batch from the tf.data service at data-node:5050")
    assert "after step 5" in said[0]


def test_the_watchdog_never_stops_a_checkpoint_being_written():
    stopped = []
    dog = watchdog.Watchdog(0.2, "grpc://h:1", exit=stopped.append, checked_every=0.05)
    try:
        dog.tick(1)
        dog.tick(2)
        with dog.paused():
            time.sleep(1.0)  # five times the bound
        assert stopped == []
        time.sleep(0.5)  # counted again from the save's end
        assert stopped == [watchdog.STALLED_EXIT_CODE]
    finally:
        dog.stop()


def test_the_first_call_may_take_longer():
    stopped = []
    dog = watchdog.Watchdog(0.3, "grpc://h:1", exit=stopped.append, checked_every=0.05)
    try:
        time.sleep(0.45)  # past the limit, within FIRST_CALL times it: compiling
        assert stopped == []
        time.sleep(watchdog.FIRST_CALL * 0.3)
        assert stopped == [watchdog.STALLED_EXIT_CODE]
    finally:
        dog.stop()


@pytest.mark.parametrize("value", ["data-node", "data-node:0", "data-node:70000", "a b:5050",
                                   "http://h:5050"])
def test_a_bad_service_address_is_one_line(value):
    with pytest.raises(UsageError) as refused:
        config.service_address(value)
    assert str(refused.value) == (f"--data_service={value}: give the dispatcher as HOST:PORT, "
                                  "like data-node:5050")
    assert config.service_address("grpc://data-node:5050") == "grpc://data-node:5050"
    assert config.service_address("[::1]:5050") == "grpc://[::1]:5050"


def test_no_dispatcher_there_is_one_line_and_nothing_made(tmp_path, tool, two_replicas):
    """The command in this process, as cli.main runs it, on the suite's 2 replicas."""
    port = free_port()
    code, _, err = tool("main", *run_flags(tmp_path / "run", f"localhost:{port}"),
                        strategy=two_replicas)
    assert code == 1
    line = err.strip()
    assert line.startswith(f"tfmulti: error: --data_service=localhost:{port}: no tf.data "
                           "service dispatcher answers there") and "\n" not in line
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------- real servers

@pytest.mark.soak  # 29 s: make soak (make test: real servers serve, a run in-process)
def test_trains_a_folder_through_a_real_service_and_says_what_resume_keeps(tmp_path, servers):
    """A folder of PNG files (the service's use: its workers read and decode them)."""
    from test_userdata import write_folder

    folder = write_folder(tmp_path / "images", per_class=(16, 4))
    running = servers(workers=1)
    done = train(tmp_path / "run", running.address, f"--dataset=folder:{folder}")
    assert done.returncode == 0, done.stderr
    assert (f"Training batches from the tf.data service at {running.address}: "
            f"{service.GUARANTEE}") in done.stdout
    assert "test acc:" in done.stdout
    with open(tmp_path / "run" / "run.json") as f:
        recorded = json.load(f)["data_service"]
    assert recorded == {"dispatcher": f"grpc://{running.address}",
                        "guarantee": service.GUARANTEE}
    with open(tmp_path / "run" / "metrics.json") as f:
        epochs = json.load(f)["epochs"]
    per_epoch = epochs[0]["step"]
    assert [e["step"] for e in epochs] == [per_epoch, 2 * per_epoch]
    assert np.isfinite(epochs[-1]["loss"])
    for p in [running.dispatcher, *running.workers]:  # the servers stop at once, code 0
        p.send_signal(signal.SIGTERM)
    for p in [running.dispatcher, *running.workers]:
        assert p.wait(10) == 0
        out, err = p.communicate()
        assert out.strip() == "stopped", (out, err)


def listening_addresses(port):
    """The local addresses of the sockets listening on `port`, from the kernel's socket
    table (/proc/net/tcp and tcp6)."""
    import ipaddress

    found = set()
    for table, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, hex_port = local.split(":")
                if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                    raw = bytes.fromhex(address)
                    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, width, 4))
                    found.add(str(ipaddress.ip_address(raw)))
    return found


@pytest.mark.parametrize("command", [  # make test: the dispatcher; the worker in make soak
    ["dispatcher", "--port=0"],
    pytest.param(["worker", "--dispatcher=localhost:5050"], marks=pytest.mark.soak)])
def test_a_server_started_by_hand_refuses_without_trusted_network(command):
    """A server open to every interface, without authentication, runs code for whoever
    reaches it: by hand it starts only with --trusted_network (the launcher's, in its
    workers' own network, and train.sbatch's give it); without, one line and nothing
    listens."""
    process = subprocess.Popen([sys.executable, "-m", "tfmulti.dataservice", *command],
                               cwd=ROOT, env=environment(), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 1 and not out, out
    assert err.strip().splitlines() == ["tfmulti: error: a tf.data service server listens on "
                                        "every interface of this machine and runs whatever "
                                        "dataset whoever reaches its port sends it, as you "
                                        "(TensorFlow's servers have no authentication): start "
                                        "it on a network your training machines alone reach, "
                                        "with --trusted_network (tfmulti.launch "
                                        "--data_service_workers=N starts the servers in its "
                                        "workers' own network)"], err
    text = open(os.path.join(ROOT, "deploy", "slurm", "train.sbatch")).read()
    # train.sbatch asks for it for its dispatcher and its workers, and says why
    assert text.count("--linger=120 \\\n        --trusted_network") == 2
    assert "whoever reaches the nodes' network can run code as you" in text


# 21 s of real servers: make soak (make test keeps the in-process service and the refusals)
@pytest.mark.soak
def test_real_servers_serve_and_a_lingering_one_serves_on_after_sigterm_then_exits_0():
    """A dispatcher and a worker server, each its own process, serve a dataset read here;
    the worker stops at once on SIGTERM with code 0; the dispatcher, with --linger=3
    (deploy/slurm/train.sbatch gives 120), serves 3 s more (a training job stopped by the
    same signal saves meanwhile), then exits 0; a bad --linger is one line."""
    dispatcher = Servers.start("dispatcher", f"--port={free_port()}", "--linger=3")
    port = int(dispatcher.said.split("port ")[1].split()[0])
    assert dispatcher.said.endswith(" (every interface, no authentication: --trusted_network)\n")
    # the socket table: it listens on every interface, as the line says
    assert listening_addresses(port) & {"0.0.0.0", "::"}, listening_addresses(port)
    worker = Servers.start("worker", f"--dispatcher=localhost:{port}", "--advertise=localhost")
    read = tf.data.Dataset.range(20).map(lambda x: x * x).apply(
        tf.data.experimental.service.distribute(
            processing_mode=tf.data.experimental.service.ShardingPolicy.OFF,
            service=f"grpc://localhost:{port}"))
    assert sorted(int(x) for x in read) == [x * x for x in range(20)]
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(10) == 0 and worker.communicate()[0].strip() == "stopped"
    dispatcher.send_signal(signal.SIGTERM)
    time.sleep(1.5)
    assert dispatcher.poll() is None
    socket.create_connection(("localhost", port), timeout=5).close()  # still listening
    start = time.monotonic()
    assert dispatcher.wait(10) == 0
    assert time.monotonic() - start < 3
    out, _ = dispatcher.communicate()
    assert out.split("\n")[:2] == ["SIGTERM: serving 3 s more", "stopped"], out
    refused = subprocess.run([sys.executable, "-m", "tfmulti.dataservice", "dispatcher",
                              "--linger=-1"], cwd=ROOT, env=environment(), capture_output=True,
                             text=True, timeout=120)
    assert refused.returncode == 1 and refused.stderr.strip().splitlines() == [
        "tfmulti: error: --linger=-1: give seconds, 0 or more"]


@pytest.mark.soak
def test_a_service_worker_killed_mid_run_leaves_the_others_serving(tmp_path, servers):
    running = servers(workers=2)
    run = train(tmp_path / "run", running.address, "--epochs=6", "--checkpoint_steps=4",
                wait=False)
    wait_for_checkpoint(tmp_path / "run", run)
    running.workers[0].kill()
    out, err = run.communicate(timeout=300)
    assert run.returncode == 0, err
    assert out.count("test acc:") == 1


@pytest.mark.soak
def test_two_training_workers_read_from_one_service(tmp_path, servers):
    """The launcher's 2 workers (the machine's network: the launcher's private one keeps
    them from a dispatcher outside it), each a job of its own on the one service."""
    running = servers(workers=2)
    done = subprocess.run([sys.executable, "-m", "tfmulti.launch", "--workers=2",
                           "--network=host", "--", *run_flags(tmp_path / "run", running.address,
                                                              replicas=1)],
                          cwd=ROOT, env=environment(), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    assert "test acc:" in done.stdout and "Training batches from the tf.data service" in (
        done.stdout)
    assert "weights: the same on all 2 workers" in done.stdout


@pytest.mark.soak
def test_the_launcher_starts_a_service_in_its_workers_network_and_stops_it(tmp_path):
    """--data_service_workers: a dispatcher and a worker server beside the 2 training workers,
    in their private network; the servers are gone when the launcher ends."""
    flags = [f for f in run_flags(tmp_path / "run", "unused", replicas=1)
             if not f.startswith("--data_service")]
    done = subprocess.run([sys.executable, "-m", "tfmulti.launch", "--workers=2",
                           "--data_service_workers=1", "--", *flags],
                          cwd=ROOT, env=environment(), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    assert "[launch] tf.data service dispatcher listening on port" in done.stdout
    assert "[launch] tf.data service worker localhost:" in done.stdout
    assert "Training batches from the tf.data service at localhost:" in done.stdout
    assert "weights: the same on all 2 workers" in done.stdout
    left = subprocess.run(["pgrep", "-f", "tfmulti.dataservice"], capture_output=True,
                          text=True).stdout.split()
    assert left == [], left


def test_the_launchers_wait_for_a_server_is_bounded_and_leaves_none_running():
    """A dispatcher that cannot say it serves within the bound (TensorFlow's import alone
    takes longer than 0.5 s): one line, and the server started is stopped."""
    from tfmulti.processes import launcher

    start = time.monotonic()
    with pytest.raises(UsageError, match=r"^the tf.data service's dispatcher did not start "
                                         r"within 0.5 s"):
        launcher.start_data_service(free_port(), 1, {}, timeout=0.5)
    assert time.monotonic() - start < 15  # the bound, and the stop's own (SIGTERM, 10 s)
    left = subprocess.run(["pgrep", "-f", "tfmulti.dataservice"], capture_output=True,
                          text=True).stdout.split()
    assert left == [], left


def test_the_launcher_sets_data_service_itself():
    from tfmulti.processes import launcher

    with pytest.raises(UsageError, match="leave that out"):
        launcher.run(launcher.LaunchOptions(data_service_workers=1),
                     ["--data_service=data-node:5050"])
    with pytest.raises(UsageError, match="give 0 or more"):
        launcher.run(launcher.LaunchOptions(data_service_workers=-1), [])


@pytest.mark.soak
@pytest.mark.parametrize("killed", ["dispatcher", "the only worker"])
def test_a_service_gone_stops_the_run_within_its_bound_and_the_same_command_resumes(
        tmp_path, servers, killed):
    running = servers(workers=1)
    timeout = 4
    flags = ("--epochs=12", "--checkpoint_steps=4", f"--worker_timeout={timeout}")
    run = train(tmp_path / "run", running.address, *flags, wait=False)
    saved = wait_for_checkpoint(tmp_path / "run", run)
    (running.dispatcher if killed == "dispatcher" else running.workers[0]).kill()
    gone = time.monotonic()
    out, err = run.communicate(timeout=300)
    took = time.monotonic() - gone
    lines = [line for line in err.splitlines() if line.strip()]
    assert run.returncode == watchdog.STALLED_EXIT_CODE, err
    assert len(lines) == 1 and lines[0].startswith(
        f"tfmulti: error: no batch from the tf.data service at {running.address} for ")
    assert took < 60, took  # the bound: timeout + 3 x the longest call, then the exit
    assert checkpoints(tmp_path / "run") and max(checkpoints(tmp_path / "run")) >= saved
    again_servers = servers(workers=1)  # a new service; the same command otherwise
    again = train(tmp_path / "run", again_servers.address, *flags)
    assert again.returncode == 0, again.stderr
    assert "Resuming the run" in again.stdout, again.stdout
    with open(tmp_path / "run" / "metrics.json") as f:
        assert json.load(f)["epochs"][-1]["step"] == 12 * 16  # to the end


def checkpoints(model_dir):
    folder = model_dir / "checkpoints"
    if not folder.exists():
        return []
    return [int(name.split("-")[1].split(".")[0]) for name in os.listdir(folder)
            if name.startswith("ckpt-") and name.endswith(".index")]


def wait_for_checkpoint(model_dir, run, bound=240):
    """The step of the first checkpoint the running `run` saved (bounded)."""
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline:
        assert run.poll() is None, run.communicate()
        found = checkpoints(model_dir)
        if found:
            return max(found)
        time.sleep(0.2)
    raise AssertionError("no checkpoint within the bound")
