"""Several workers on localhost: real processes, real gRPC collectives."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import keras
import numpy as np
import pytest

from tfmulti import errors
from tfmulti.distribution import workers
from tfmulti.errors import UsageError
from tfmulti.processes import launcher
from tfmulti.rundir import lifecycle, names

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = ["--dataset=synthetic", "--synthetic_train_size=1024", "--synthetic_test_size=200",
       "--model=resnet18", "--width=4", "--per_replica_batch_size=16", "--epochs=2",
       "--deterministic", "--intra_op_threads=1"]


def environment():
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CPP_MIN_LOG_LEVEL", "TF_CONFIG")}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def start_workers(args, count=2):
    """`count` workers of the main job with these flags, worker i with --task_index=i."""
    return [subprocess.Popen([sys.executable, "-m", "tfmulti.main", *args, f"--task_index={i}"],
                             cwd=ROOT, env=environment(), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for i in range(count)]


def weights(model_dir):
    import keras

    import tfmulti.models.zoo  # noqa: F401  (registers the batch-norm layer)

    return keras.saving.load_model(os.path.join(model_dir, names.MODEL_FILE)).get_weights()


def training_workers(tmp_path, *flags):
    """Two workers on 16384 images in tmp_path/run, returned once the chief trains."""
    hosts = ",".join(f"localhost:{p}" for p in launcher.free_ports(2))
    args = [*RUN, "--synthetic_train_size=16384", *flags, f"--worker_hosts={hosts}",
            f"--model_dir={tmp_path}/run"]
    workers = start_workers(args)
    for line in workers[0].stdout:
        if line.startswith("Epoch 1/"):
            break
    return args, workers


def test_cluster_config():
    config = workers.cluster_config("localhost:1234,otherhost:5678", 1)
    assert config == {"cluster": {"worker": ["localhost:1234", "otherhost:5678"]},
                      "task": {"type": "worker", "index": 1}}
    assert not workers.is_chief(config)
    assert workers.is_chief(workers.cluster_config("a:1,b:2", 0))
    assert workers.cluster_config(None, 0, tf_config=json.dumps(config)) == config
    assert workers.cluster_config(None, 0, tf_config=None) is None
    one = {"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 0}}
    assert workers.cluster_config(None, 0, tf_config=json.dumps(one)) is None


def test_the_tasks_share_work_chief_first_and_agree_on_the_smallest(two_replicas):
    """task_place numbers the tasks as MultiWorkerMirroredStrategy does (a chief replica
    first); smallest_across is one SUM all-reduce (across processes: make soak's folder
    test), here over the 2 replicas of one process."""
    assert workers.task_place(None) == (0, 1)
    assert workers.task_place(workers.cluster_config("a:1,b:2,c:3", 2)) == (2, 3)
    with_chief = {"cluster": {"chief": ["c:1"], "worker": ["w:1", "w:2"]},
                  "task": {"type": "worker", "index": 0}}
    assert workers.task_place(with_chief) == (1, 3)
    assert workers.task_place({**with_chief, "task": {"type": "chief", "index": 0}}) == (0, 3)
    smallest = workers.smallest_across(two_replicas, (0, 1))
    assert [smallest(v) for v in (7, 0, 123456789)] == [7, 0, 123456789]


def test_each_workers_numbers_are_gathered_exactly_and_the_chief_says_if_weights_differ(
        two_replicas):
    """gathered: a row per worker (one here, two in the two-worker test's metrics.json),
    whole numbers up to 2**52 exact; the fingerprint survives its 16-bit chunks."""

    assert workers.gathered(two_replicas, [2 ** 52, 0, 65535]) == [[2 ** 52, 0, 65535]]
    with two_replicas.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    assert workers.every_workers_fingerprint(two_replicas, model) == [
        workers.weights_fingerprint(model)]
    assert "the same on all 2 workers (fingerprint ab" in workers.fingerprint_line(["ab", "ab"])
    assert workers.fingerprint_line(["ab", "cd"]).startswith(
        "weights DIFFER between the workers (a defect; please report it): fingerprints "
        "worker 0: ab, worker 1: cd")


@pytest.mark.parametrize("hosts, index, tf_config, words", [
    ("localhost", 0, None, "is not host:port"),
    ("h:70000,h:2", 0, None, "'h:70000': a port is 1 to 65535"),
    ("h:0,h:2", 0, None, "'h:0': a port is 1 to 65535"),
    ("a:1,b:2", 2, None, "--task_index=2 is not one of the 2 workers"),
    (None, 0, "{not json", "TF_CONFIG is set but is not a cluster"),
    (None, 0, '{"cluster": {}}', "TF_CONFIG is set but is not a cluster"),
])
def test_bad_cluster_config(hosts, index, tf_config, words):
    with pytest.raises(UsageError, match=words):
        workers.cluster_config(hosts, index, tf_config=tf_config)


def test_worker_commands_share_the_cores():
    commands = launcher.worker_commands(2, ["--epochs=1"], [1111, 2222], cores=2)
    assert commands[1][-3:] == ["--intra_op_threads=1", "--worker_hosts=localhost:1111,"
                                "localhost:2222", "--task_index=1"]
    assert len(set(launcher.free_ports(3))) == 3


def refused_everywhere(port):
    """Whether nothing outside the workers' network reaches `port`: on 127.0.0.1, on another
    loopback address (a server bound to 0.0.0.0 takes both), and on every other address of
    the machine. [(address, reached)]"""
    import socket

    from tfmulti.processes import netns

    tried = []
    for address in ["127.0.0.1", "127.0.0.2", *netns.machine_addresses()]:
        try:
            socket.create_connection((address, port), timeout=2).close()
            tried.append((address, True))
        except OSError:
            tried.append((address, False))
    return tried


def test_the_probe_reaches_a_server_that_listens_on_every_interface():
    """The check below can fail: a server bound to 0.0.0.0, as TensorFlow's, is reached on
    every address the check tries."""
    import socket

    with socket.socket() as server:
        server.bind(("0.0.0.0", 0))
        server.listen()
        tried = refused_everywhere(server.getsockname()[1])
    assert len(tried) >= 2 and all(reached for _, reached in tried), tried


def test_two_workers_equal_a_two_replica_process(tmp_path, two_replicas):
    """2 epochs of 16 steps (512 images, global batch 32) of LeNet (a faster run; ResNet-18's
    batch norm on 2 workers: make cluster-test and container-test). The 2-replica run, the
    same flags with --cpu_replicas=2, trains in this process (train_and_evaluate, as
    tfmulti.main calls it; the two workers are real processes). While the launcher's workers
    train, their servers are reached from nowhere outside their own network."""
    from tfmulti.data import sources
    from tfmulti.run import config, flagdefs
    from tfmulti.training import train

    run = [*RUN, "--synthetic_train_size=512", "--model=lenet", "--width=4", "--base_lr=0.4"]
    try:
        flagdefs.FLAGS(["tfmulti.main", *run, "--cpu_replicas=2"])
        single = config.from_flags(flagdefs.FLAGS)
    finally:
        flagdefs.FLAGS.unparse_flags()
    with lifecycle.in_use(str(tmp_path / "single")) as model_dir:  # as tfmulti.main opens it
        train.train_and_evaluate(two_replicas, sources.load_for(single), single, verbose=0,
                                 model_dir=model_dir)
    os.makedirs(tmp_path / "workers")  # an existing empty folder: both workers probe it at once
    launched = subprocess.Popen([sys.executable, "-m", "tfmulti.launch", "--workers=2", "--",
                                 *run, f"--model_dir={tmp_path}/workers"],
                                cwd=ROOT, env=environment(), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    seen, tried = [], None
    for line in launched.stdout:
        seen.append(line)
        if line.startswith("[worker 0] Epoch 1/"):  # both servers up: the group has formed
            pid, command = workers_command(launched.pid)
            ports = [int(h.rsplit(":", 1)[1]) for h in re.search(
                r"--worker_hosts=(\S+)", command).group(1).split(",")]
            tried = [refused_everywhere(port) for port in ports]
            os.kill(pid, 0)  # the worker still lives: its server was there to be refused
    launched.wait(timeout=300)
    out = "".join(seen)
    assert launched.returncode == 0, out[-3000:]
    assert ("[launch] the workers have a network of their own: their servers are reachable "
            "only by each other") in out
    assert tried and not any(reached for each in tried for _, reached in each), tried
    assert "[worker 0] test acc: " in out and "on [worker0/CPU:0, worker1/CPU:0]" in out
    prints = json.loads((tmp_path / "workers" / "metrics.json").read_text())[
        "weights_fingerprints"]
    assert len(prints) == 2 and prints[0] == prints[1], prints  # the same weights on both
    assert f"[worker 0] weights: the same on all 2 workers (fingerprint {prints[0]}" in out
    assert out.count("weights: the same") == 1  # said once, by the chief
    assert "E0000" not in out and "Failed to send RPC" not in out  # no shutdown noise
    for a, b in zip(weights(tmp_path / "single"), weights(tmp_path / "workers")):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    assert not [n for n in os.listdir(tmp_path / "workers")
                if n.startswith(lifecycle.SCRATCH_PREFIX)]


def workers_command(launcher_pid):
    """(pid, command line) of one of the launcher's workers (its children), from /proc."""
    with open(f"/proc/{launcher_pid}/task/{launcher_pid}/children") as f:
        children = f.read().split()
    for child in children:
        with open(f"/proc/{child}/cmdline", "rb") as f:
            line = " ".join(part.decode() for part in f.read().split(b"\0") if part)
        if "--worker_hosts=" in line:
            return int(child), line
    raise AssertionError(f"no worker among the launcher's children {children}")


@pytest.mark.soak  # two real workers waiting out their limit (make soak)
def test_a_worker_that_never_comes_stops_the_others_within_worker_timeout(tmp_path):
    """Worker 0 of two alone (its peer never started) and worker 1 of two alone (its chief is
    gone, as after a restart): each stops after --worker_timeout with one line naming who did
    not answer. Without the limit both waited for ever."""
    timeout = 6
    alone = {}
    for index in (0, 1):
        ports = launcher.free_ports(2)
        hosts = ",".join(f"localhost:{p}" for p in ports)
        alone[index] = (ports, time.monotonic(), subprocess.Popen(
            [sys.executable, "-m", "tfmulti.main", *RUN, f"--worker_hosts={hosts}",
             f"--task_index={index}", f"--worker_timeout={timeout}",
             f"--model_dir={tmp_path}/run{index}"], cwd=ROOT, env=environment(),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for index, (ports, started, process) in alone.items():
        _, stderr = process.communicate(timeout=120)
        took = time.monotonic() - started
        lines = stderr.strip().splitlines()
        assert process.returncode == 1, stderr[-2000:]
        assert timeout < took < timeout + 30  # it waited, then stopped (+ TensorFlow's start)
        if index == 0:
            assert lines[-1] == (
                f"tfmulti: error: worker 1 (localhost:{ports[1]}) did not join within "
                f"--worker_timeout={timeout} s; check that every worker was started with the "
                "same --worker_hosts and can reach the others")
        else:
            assert lines[-1].startswith(
                f"tfmulti: error: the chief, worker 0 (localhost:{ports[0]}), did not answer "
                f"within --worker_timeout={timeout} s")


@pytest.mark.soak  # make soak: two workers started to be refused, 14 s
def test_a_run_the_chief_refuses_stops_every_worker_in_one_line(tmp_path):
    """Only the chief reads run.json; the others follow its decision, a refusal included."""
    run = tmp_path / "run"
    run.mkdir()
    other = {"config": {"model": "lenet"}, "global_batch_size": 32, "image_dtype": "uint8",
             "class_names": [str(i) for i in range(10)], "image_shape": [28, 28, 1]}
    (run / lifecycle.RUN_FILE).write_text(json.dumps(other))
    hosts = ",".join(f"localhost:{p}" for p in launcher.free_ports(2))
    workers = start_workers([*RUN, f"--worker_hosts={hosts}", f"--model_dir={run}"])
    outputs = [p.communicate(timeout=120) for p in workers]
    assert [p.returncode for p in workers] == [1, 1]
    last = [err.strip().splitlines()[-1] for _, err in outputs]
    assert last[0].startswith(f"tfmulti: error: --model_dir={run} holds a different run")
    assert last[1] == "tfmulti: error: the chief (worker 0) refused the run; its output says why"
    assert json.loads((run / lifecycle.RUN_FILE).read_text()) == other  # untouched


@pytest.mark.soak  # 31 s: make soak; make test keeps the divergence both workers stop at
def test_sigterm_to_one_worker_stops_both_at_the_same_step_and_they_resume(tmp_path):
    """A cluster preempts one host: every worker must stop after the same call, or the one
    still training waits in an all-reduce the other never joins. Both save, exit 75, and
    restarting both resumes."""
    args, workers = training_workers(tmp_path, "--epochs=1", "--steps_per_call=2",
                                     "--checkpoint_steps=8")
    deadline = time.monotonic() + 120  # trained a while: its first periodic checkpoint is there
    while time.monotonic() < deadline and not os.path.exists(
            tmp_path / "run" / lifecycle.CHECKPOINT_DIR / "ckpt-8.index"):
        time.sleep(0.05)
    workers[1].send_signal(signal.SIGTERM)
    outputs = [p.communicate(timeout=120) for p in workers]
    assert [p.returncode for p in workers] == [75, 75], outputs[1][1][-3000:]
    # The stop line, not the last line: gRPC may log a peer's shutdown after it.
    # worker 1 got the SIGTERM; worker 0 stops at the same step on its vote
    said = [[line for line in out[1].splitlines() if line.startswith("tfmulti: stopped by ")]
            for out in outputs]
    assert [len(lines) for lines in said] == [1, 1], said
    assert said[1][0].startswith("tfmulti: stopped by SIGTERM at step ")
    assert said[0][0].startswith("tfmulti: stopped by another worker's stop request at step ")
    steps = {line.split(" at step ")[1].split(",")[0] for lines in said for line in lines}
    assert len(steps) == 1, said  # the same step on both
    step = int(steps.pop())
    saved = sorted(int(n[5:-6]) for n in os.listdir(tmp_path / "run" / "checkpoints")
                   if n.endswith(".index"))
    assert saved[-1] == step and 0 < step < 512
    restarted = start_workers(args)
    seen = []
    for line in restarted[0].stdout:
        seen.append(line)
        if line.startswith("Epoch 1/1"):
            break
    for p in restarted:  # no need to train it all: it resumed where it stopped
        p.send_signal(signal.SIGTERM)
    outputs = [p.communicate(timeout=120) for p in restarted]
    assert [p.returncode for p in restarted] == [75, 75], outputs[0][1][-2000:]
    assert f"Resuming the run in {tmp_path}/run at step {step + 1}\n" in seen


@pytest.mark.soak
def test_two_workers_stopped_then_resumed_as_one_process_end_as_the_uninterrupted_run(tmp_path):
    """Elastic resume across processes: 2 workers (1 replica each) stopped by SIGTERM to the
    launcher, then the same run on 1 process with 1 replica at the same global batch. Its
    final weights are the uninterrupted 2-replica run's (measured difference 3e-8)."""
    from test_config import ELASTIC, newest_checkpoint

    whole, elastic = tmp_path / "whole", tmp_path / "elastic"
    reference = subprocess.Popen([sys.executable, "-m", "tfmulti.main", *ELASTIC,
                                  "--cpu_replicas=2", f"--model_dir={whole}"], cwd=ROOT,
                                 env=environment(), stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
    launcher = subprocess.Popen([sys.executable, "-m", "tfmulti.launch", "--workers=2", "--",
                                 *ELASTIC, f"--model_dir={elastic}"], cwd=ROOT,
                                env=environment(), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 180
    while time.time() < deadline and launcher.poll() is None and newest_checkpoint(elastic) == 0:
        time.sleep(0.02)
    launcher.send_signal(signal.SIGTERM)
    out, _ = launcher.communicate(timeout=120)
    assert launcher.returncode == 75, out[-3000:]
    step = newest_checkpoint(elastic)
    assert 0 < step < 64
    alone = subprocess.run([sys.executable, "-m", "tfmulti.main", *ELASTIC, "--cpu_replicas=1",
                            f"--model_dir={elastic}"], cwd=ROOT, env=environment(),
                           capture_output=True, text=True, timeout=300)
    assert alone.returncode == 0, alone.stderr[-2000:]
    assert (f"at step {step + 1} on 1 replica, was 2; on 1 worker, was 2 (global batch 32, 32 "
            "per replica)") in alone.stdout
    assert reference.wait(300) == 0, reference.stderr.read()[-2000:]
    worst = max(np.abs(a - b).max() for a, b in zip(weights(whole), weights(elastic)))
    assert worst < 1e-5, worst


# One epoch of 64 steps (2048 images, global batch 32), a checkpoint every 4 steps
RESUMED = [*(flag for flag in RUN if not flag.startswith("--per_replica_batch_size=")),
           "--global_batch_size=32", "--model=lenet", "--synthetic_train_size=2048",
           "--epochs=1", "--steps_per_call=2", "--checkpoint_steps=4"]


def last_epoch(model_dir):
    return json.loads((model_dir / names.METRICS_FILE).read_text())["epochs"][-1]


@pytest.mark.soak  # make soak: 2 workers 3 times, 1 process once (about 90 s)
def test_an_epoch_two_workers_resume_mid_way_reports_its_whole_training(tmp_path):
    """The epoch's training metrics so far are in every checkpoint, summed over the
    replicas of every worker in the call's all-reduce (a save reads nothing of another
    worker's: a worker that saved on SIGTERM once crashed its peer with the metrics' own
    collective). Two workers killed with kill -9 after a checkpoint, run again as two
    workers; two workers stopped by SIGTERM (both save where they stopped), run again as one
    process on one replica: each resumed epoch's training loss and accuracy are the
    uninterrupted two workers' over all 64 steps (they covered only those after the resume)."""
    from test_resume import checkpoint_steps

    def launched(model_dir, *flags):
        return subprocess.Popen([sys.executable, "-m", "tfmulti.launch", "--workers=2", "--",
                                 *RESUMED, *flags, f"--model_dir={model_dir}"], cwd=ROOT,
                                env=environment(), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)

    def when_saved(model_dir, process, wanted):
        """Waits for a checkpoint mid-epoch past `wanted` steps (the run still going)."""
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and process.poll() is None:
            if max(checkpoint_steps(model_dir), default=0) >= wanted:
                return
            time.sleep(0.01)
        raise AssertionError(f"no checkpoint at step {wanted} while the run went on")

    whole = launched(tmp_path / "whole")
    out, _ = whole.communicate(timeout=300)
    assert whole.returncode == 0, out[-3000:]
    wanted = last_epoch(tmp_path / "whole")

    # kill -9 to both workers once a checkpoint is listed; run again as two workers
    hosts = ",".join(f"localhost:{p}" for p in launcher.free_ports(2))
    args = [*RESUMED, f"--worker_hosts={hosts}", f"--model_dir={tmp_path}/killed"]
    killed = start_workers(args)
    when_saved(tmp_path / "killed", killed[0], 20)
    for p in killed:
        p.kill()
    for p in killed:
        p.communicate(timeout=60)
    step = checkpoint_steps(tmp_path / "killed")[-1]
    again = launched(tmp_path / "killed")
    out, _ = again.communicate(timeout=300)
    assert again.returncode == 0, out[-3000:]
    assert f"at step {step + 1} of 64" in out

    # SIGTERM to the launcher (both workers save); run again as one process on one replica
    stopped = launched(tmp_path / "stopped")
    when_saved(tmp_path / "stopped", stopped, 28)
    stopped.send_signal(signal.SIGTERM)
    out, _ = stopped.communicate(timeout=120)
    assert stopped.returncode == 75, out[-3000:]
    alone = subprocess.run([sys.executable, "-m", "tfmulti.main", *RESUMED, "--num_gpus=0",
                            f"--model_dir={tmp_path}/stopped"], cwd=ROOT, env=environment(),
                           capture_output=True, text=True, timeout=300)
    assert alone.returncode == 0, alone.stderr[-3000:]

    assert last_epoch(tmp_path / "killed")["resumed_at_step"] == step + 1
    for model_dir in ("killed", "stopped"):
        resumed = last_epoch(tmp_path / model_dir)
        assert 20 < resumed["resumed_at_step"] < 64, (model_dir, resumed)
        assert resumed["loss"] == pytest.approx(wanted["loss"], rel=1e-5), model_dir
        assert resumed["train_acc"] == pytest.approx(wanted["train_acc"], rel=1e-5), model_dir


@pytest.mark.soak  # 25 s; the suite keeps the overflow two workers agree on, and one
def test_divergence_stops_both_workers_naming_the_same_step(tmp_path):  # process's divergence
    """The loss reaches every worker once per call (with the batch-norm statistics and the stop
    votes, in one all-reduce): a NaN at step k must stop both workers at that call, with the
    same step named, not leave one waiting in the next call's all-reduce."""
    launched = subprocess.run([sys.executable, "-m", "tfmulti.launch", "--workers=2", "--",
                               *RUN, "--base_lr=1e12", "--steps_per_call=4",
                               f"--model_dir={tmp_path}/run"], cwd=ROOT, env=environment(),
                              capture_output=True, text=True, timeout=300)
    assert launched.returncode == 1, launched.stdout[-3000:]
    diverged = [line for line in launched.stdout.splitlines()
                if "training diverged: loss is " in line]
    # both stopped on the same value at the same step: one line, shown once by the launcher
    assert len(diverged) == 1, launched.stdout[-3000:]
    said = [line for line in launched.stdout.splitlines() if line.startswith("[launch] ")]
    assert any("worker 0 exited with code 1" in line for line in said), said
    assert any("worker 1 exited with code 1" in line for line in said), said
    assert "still running" not in launched.stdout  # neither had to be stopped by the launcher
    assert "E0000" not in launched.stdout and "Traceback" not in launched.stdout


def _traced_collectives(allreduce_dtype):
    hosts = ",".join(f"localhost:{p}" for p in launcher.free_ports(2))
    workers = [subprocess.Popen([sys.executable, os.path.join(ROOT, "tests",
                                                              "collectives_worker.py"),
                                 str(i), hosts, allreduce_dtype], cwd=ROOT, env=environment(),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for i in range(2)]
    outputs = [p.communicate(timeout=300) for p in workers]
    assert [p.returncode for p in workers] == [0, 0], outputs[0][1][-2000:]
    return [json.loads(out.split("COLLECTIVES ", 1)[1]) for out, _ in outputs]


@pytest.mark.soak
def test_a_training_step_has_one_collective_and_a_call_one_more():
    """Across workers, each step all-reduces its gradients and nothing else; the losses,
    stop votes and batch-norm statistics go together once per call. (There were three a step:
    also the loss, and tf.distribute's "has every worker a batch?" before each step, which it
    adds when it cannot see that the input is endless.) With --allreduce_dtype=float16 that
    one crosses between the processes in 16 bits, and both workers keep the same weights."""
    for allreduce_dtype in ("float32", "float16"):
        chief, other = _traced_collectives(allreduce_dtype)
        assert {k: chief[k] for k in ("per_step", "per_call", "step_dtypes")} == {
            "per_step": 1, "per_call": 1, "step_dtypes": [allreduce_dtype]}
        assert chief["weights"] == other["weights"]


# 16 s: make soak (make test keeps an overflow on one replica of two, test_engine and test_xla)
@pytest.mark.soak
def test_an_overflow_on_one_worker_is_skipped_by_both_workers():
    """float16 loss scaling across processes: Keras's LossScaleOptimizer lets each worker
    skip on its own gradients, so a worker that overflowed skipped while the other waited in
    the gradient all-reduce. The engine sums the gradients before the check, so both see the
    overflow, skip the step and halve the scale together; tested with the overflow on the
    other worker (step 1) and on the chief (step 3), each followed by an ordinary step that
    both apply."""
    hosts = ",".join(f"localhost:{p}" for p in launcher.free_ports(2))
    workers = [subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "overflow_worker.py"),
                                 str(i), hosts], cwd=ROOT, env=environment(),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for i in range(2)]
    try:
        outputs = [p.communicate(timeout=120) for p in workers]
    finally:
        for p in workers:  # a worker left waiting in an all-reduce never ends by itself
            p.kill()
            p.wait()
    assert [p.returncode for p in workers] == [0, 0], outputs[0][1][-2000:] + outputs[1][1][-2000:]
    chief, other = ([json.loads(line.split("STEP ", 1)[1]) for line in out.splitlines()
                     if line.startswith("STEP ")] for out, _ in outputs)
    assert chief == other  # the same steps, scale and weights on both workers
    assert [s["step"] for s in chief] == [0, 1, 2, 3, 4]
    assert [s["applied"] for s in chief] == [0, 0, 1, 1, 2]  # steps 1 and 3 skipped
    assert [s["scale"] for s in chief] == [2.0 ** 15, 2.0 ** 14, 2.0 ** 14, 2.0 ** 13, 2.0 ** 13]
    assert all(s["finite"] for s in chief)
    start, first, second, third, fourth = (s["weights"] for s in chief)
    assert first == start and second != first and third == second and fourth != third


def test_the_lost_contact_line_keeps_the_cause_without_tensorflows_graph_tags():
    """The survivor's one line (make soak kills a worker for real) quoted TensorFlow's line
    with its function tag first: `lost contact with another worker ({{function_node __wra...`."""
    message = ("{{function_node __wrapped__CollectiveReduceV2_Nordering_token_1_device_/job:worker"
               "/replica:0/task:0/device:CPU:0}} Collective ops is aborted by: failed to connect "
               "to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:4242: Connection refused\n"
               "The error could be from a previous operation. Restart your program to reset.\n"
               "\t [[{{node CollectiveReduceV2}}]] [Op:__inference_train_steps_1234]")
    assert errors.lost_contact_cause(message) == (
        "Collective ops is aborted by: failed to connect to all addresses; last error: UNKNOWN: "
        "ipv4:127.0.0.1:4242: Connection refused")
    assert errors.lost_contact_cause("[[{{node x}}]] Task /job:worker/task:1 is unreachable") == (
        "Task /job:worker/task:1 is unreachable")
    long = errors.lost_contact_cause("aborted by: " + "x" * 500)
    assert len(long) == 200 and long.endswith("...")
    assert errors.lost_contact_cause("Deadline exceeded") == ""
    # a killed worker, as TensorFlow 2.21 says it to the survivor (a real kill -9, make soak)
    silent = ("Collective ops is aborted by: Error reported from /job:worker/task:1: The "
              "following tasks are unhealthy (stopped sending heartbeats):\n"
              "/job:worker/replica:0/task:1\nThe tasks have crashed. Check the task logs for an "
              "earlier error [type.googleapis.com/tensorflow.CoordinationServiceError='']")
    assert errors.lost_contact_cause(silent) == (
        "worker 1 stopped sending heartbeats: killed, or its machine is gone")
