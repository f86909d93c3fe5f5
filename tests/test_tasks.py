"""Tuning across srun's tasks (tune/tasks.py): the roles read from a step's variables, the
beat files several processes write and read, and each wait's limit with real processes. The
3-task sessions with a task killed run in make soak (simulated step) and make cluster-test
(a real srun)."""
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from tfmulti.distribution import slurm
from tfmulti.errors import UsageError, UserError
from tfmulti.tune import parallel_trials, secret, tasks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A Python process that beats as `tuner_id` every 0.1 s, and says "done" on SIGTERM.
WRITER = """
import signal, sys, threading
from tfmulti.tune import tasks
beats = tasks.Beats(sys.argv[1], sys.argv[2], sys.argv[3], period=0.1).start()
stop = threading.Event()
signal.signal(signal.SIGTERM, lambda *_: stop.set())
print("beating", flush=True)
stop.wait(60)
beats.done()
"""


def step_environ(procid, tasks_count=3, job=7, restarts=None):
    return {"SLURM_JOB_ID": str(job), "SLURM_STEP_ID": "0", "SLURM_PROCID": str(procid),
            "SLURM_STEP_NODELIST": "localhost", "SLURM_STEP_TASKS_PER_NODE": str(tasks_count),
            "SLURMD_NODENAME": "localhost", "SLURM_NTASKS": str(tasks_count),
            **({"SLURM_RESTART_COUNT": str(restarts)} if restarts is not None else {})}


def test_task_0_serves_the_search_at_its_own_address_and_the_others_run_trials():
    configs = [slurm.cluster(step_environ(i)) for i in range(3)]
    roles = [tasks.roles(c) for c in configs]
    assert [r["KERASTUNER_TUNER_ID"] for r in roles] == ["chief", "tuner1", "tuner2"]
    address = configs[0]["cluster"]["worker"][0]
    assert {f"{r['KERASTUNER_ORACLE_IP']}:{r['KERASTUNER_ORACLE_PORT']}" for r in roles} == {
        address}
    assert tasks.worker_ids(configs[0]) == ["tuner1", "tuner2"]
    # A requeued job keeps its id; its restart count makes it another incarnation.
    assert tasks.incarnation(step_environ(0)) != tasks.incarnation(step_environ(0, restarts=1))


def writer(folder, tuner_id, incarnation="7.0.0"):
    process = subprocess.Popen([sys.executable, "-c", WRITER, str(folder), tuner_id,
                                incarnation], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline() == "beating\n"
    return process


def test_beats_of_several_processes_a_kill_9_falls_silent_a_done_is_seen(tmp_path):
    """Two worker processes beat into one folder while this one reads: both seen alive; one
    killed with kill -9 falls silent; the other's SIGTERM leaves a last beat saying done."""
    reader = tasks.Beats(str(tmp_path), "chief", "7.0.0")
    one, two = writer(tmp_path, "tuner1"), writer(tmp_path, "tuner2")
    try:
        for _ in range(5):  # reads while both rename their beats into place: never torn
            time.sleep(0.15)
            assert reader.silent_for("tuner1") < 0.5 and reader.silent_for("tuner2") < 0.5
        one.kill()
        one.wait(10)
        time.sleep(1.0)
        assert reader.silent_for("tuner1") >= 0.8 and reader.silent_for("tuner2") < 0.5
        assert not reader.is_done("tuner1")
        two.send_signal(signal.SIGTERM)
        assert two.wait(10) == 0
        assert reader.is_done("tuner2") and not reader.is_done("tuner3")
        assert reader.silent_for("tuner3") > 0  # never seen: counts from the reader's start
    finally:
        for p in (one, two):
            p.kill()
            p.wait()


def test_an_earlier_run_of_the_job_is_no_sign_of_life(tmp_path):
    """Beats a requeued job's earlier run left (another incarnation) are not taken as alive,
    nor as done."""
    old = tasks.Beats(str(tmp_path), "tuner1", "7.0.0")
    old.beat()
    old.done()
    now = tasks.Beats(str(tmp_path), "chief", "7.0.1")
    assert now.read("tuner1") is None and not now.is_done("tuner1")
    time.sleep(0.3)
    assert now.silent_for("tuner1") >= 0.3


def environment(procid, tasks_count=3, job=7):
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    return {**env, **step_environ(procid, tasks_count, job), "PYTHONUNBUFFERED": "1"}


def tune_task(tmp_path, procid, *flags, job=7):
    return subprocess.Popen(
        [sys.executable, "-m", "tfmulti.tune", "--flagfile=flags/tune_smoke.cfg",
         "--cpu_replicas=1", "--max_trials=2", f"--model_dir={tmp_path}/session", *flags],
        cwd=ROOT, env=environment(procid, job=job), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)


# Small trials for a task that runs them here (task 0 runs trials too)
SMALL = ("--model=lenet", "--width=2", "--synthetic_train_size=512", "--epochs=1")


# 28 s: make soak (make test keeps the main job's worker_timeout, test_multiworker.py)
@pytest.mark.soak
def test_a_chief_whose_workers_never_come_runs_the_trials_and_waits_for_them_so_long(tmp_path):
    """Task 0 of a 3-task step whose workers never start: it runs the session's trials on its
    own devices, then waits --worker_timeout for the workers (so a late one still finds it),
    says each one in a line and ends 0 with the session complete."""
    timeout = 4
    process = tune_task(tmp_path, 0, f"--worker_timeout={timeout}", "--max_trials=1", *SMALL)
    stdout, stderr = process.communicate(timeout=240)
    assert process.returncode == 0, stderr[-2000:]
    lines = stdout.splitlines()
    assert [x for x in lines if x.startswith("chief: trial")] == [
        "chief: trial 0 COMPLETED"], stdout[-2000:]
    for worker in ("tuner1", "tuner2"):
        assert any(x.startswith(f"{worker}: no beat for ") and "not waited for" in x
                   for x in lines), stdout[-2000:]
    assert (tmp_path / "session" / "trials.csv").read_text().count("COMPLETED") == 1
    assert "tfmulti: error" not in stderr


# a worker whose chief never comes: make soak (make test keeps it for the main job, in
# test_multiworker.py, through the same start-up)
@pytest.mark.soak
def test_a_worker_whose_chief_never_comes_stops_within_worker_timeout(tmp_path):
    """A worker of a 3-task step whose chief never starts stops after --worker_timeout
    (keras-tuner's own limit is an hour) with one line, non-zero."""
    timeout = 4
    started = time.monotonic()
    process = tune_task(tmp_path, 1, f"--worker_timeout={timeout}")
    _, stderr = process.communicate(timeout=120)
    took = time.monotonic() - started
    errors = [line for line in stderr.splitlines() if line.startswith("tfmulti: error:")]
    assert process.returncode == 1 and len(errors) == 1, stderr[-2000:]
    assert "the tuning chief (localhost:" in errors[0] and "--worker_timeout" in errors[0]
    assert timeout < took < timeout + 60  # the start of TensorFlow, then the limit


def oracle_state(tmp_path):
    import json

    try:
        with open(tmp_path / "session" / "trials" / "oracle.json") as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def wait_for(condition, what, timeout=180):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout} s: {what}")


@pytest.mark.soak  # about 2 minutes: make soak; make cluster-test does it on a real srun
def test_a_killed_worker_and_a_killed_chief_then_the_job_rerun_finish_every_trial_once(tmp_path):
    """A simulated 3-task step (the variables srun sets, on localhost), 4 trials: a worker
    killed with kill -9 during its trial (the others go on: its trial goes to the other worker
    after --worker_timeout), then the chief killed (the workers stop within --worker_timeout,
    one line), then the whole step run again: every trial completed exactly once."""
    flags = ("--max_trials=4", "--worker_timeout=5")
    step = [tune_task(tmp_path, i, *flags, job=8) for i in range(3)]
    wait_for(lambda: "tuner1" in oracle_state(tmp_path).get("ongoing_trials", {}),
             "tuner1 has a trial")
    step[1].kill()
    wait_for(lambda: len(oracle_state(tmp_path).get("end_order", [])) >= 2, "2 trials ended")
    step[0].kill()
    outputs = [p.communicate(timeout=120) for p in step]
    for out, err in outputs[2:]:
        errors = [line for line in err.splitlines() if line.startswith("tfmulti: error:")]
        assert len(errors) == 1 and "the tuning chief (localhost:" in errors[0], err[-2000:]
    assert [p.returncode for p in step] == [-signal.SIGKILL, -signal.SIGKILL, 1]
    assert "tuner1: no beat for " in outputs[0][0]  # the chief put its trial back
    rerun = [tune_task(tmp_path, i, *flags, job=8) for i in range(3)]
    again = [p.communicate(timeout=300) for p in rerun]
    assert [p.returncode for p in rerun] == [0, 0, 0], again[0][1][-2000:]
    completed = [line.split()[2] for out, _ in outputs + again for line in out.splitlines()
                 if line.startswith(("chief:", "tuner")) and line.endswith(" COMPLETED")]
    assert sorted(completed) == ["0", "1", "2", "3"], completed
    assert sorted(oracle_state(tmp_path)["end_order"]) == ["0", "1", "2", "3"]
    table = (tmp_path / "session" / "trials.csv").read_text()
    assert table.count("COMPLETED") == 4
    # The step once more on the finished session, task 2 started only after task 1 was told
    # the search is over: the chief still serves it, and every task exits 0.
    late = [tune_task(tmp_path, i, "--max_trials=4", "--worker_timeout=120", job=9)
            for i in range(2)]
    assert late[1].wait(120) == 0, late[1].stderr.read()[-2000:]
    assert late[0].poll() is None  # the chief waits for the worker it has not heard from
    late.append(tune_task(tmp_path, 2, "--max_trials=4", "--worker_timeout=120", job=9))
    ended = [p.communicate(timeout=120) for p in late]
    assert [p.returncode for p in late] == [0, 0, 0], ended[0][1][-2000:]
    assert "no beat" not in ended[0][0]


@pytest.mark.soak  # make soak: 30 s (make test keeps under its 8 minutes)
def test_a_trial_left_by_a_silent_worker_is_run_by_the_chief(tmp_path, tiny_synthetic,
                                                             monkeypatch):
    """The chief in this process (lead), with a real oracle, gRPC server, beat files and its
    own trials: of 2 trials it takes one, tuner1 takes the other and falls silent, tuner2 is
    told the search is over and says done. The chief puts tuner1's trial back and runs it
    itself: both trials end COMPLETED, each once. (Before task 0 ran trials, the session
    stopped here with the trial left unfinished.)"""
    from keras_tuner.src.distribute import oracle_client
    from test_tune import hypermodel_of

    from tfmulti.processes import launcher
    from tfmulti.run.config import RunConfig
    from tfmulti.tune import keras_tuner_fixes, search

    address = f"localhost:{launcher.free_ports(1)[0]}"
    monkeypatch.setenv(secret.VARIABLE, "")  # set by require_secret, unset after the test
    keras_tuner_fixes.require_secret(str(tmp_path), make=True)  # the chief and client send it
    monkeypatch.setenv("KERASTUNER_ORACLE_IP", "localhost")
    monkeypatch.setenv("KERASTUNER_ORACLE_PORT", address.split(":")[1])
    monkeypatch.setenv("KERASTUNER_TUNER_ID", "chief")  # this process: the chief
    hypermodel = hypermodel_of(tiny_synthetic, RunConfig(model="lenet", width=2, epochs=1))
    tuner = search.make_tuner("random", hypermodel, str(tmp_path), max_trials=2)
    folder = str(tmp_path / "workers")
    chief = tasks.Beats(folder, "chief", "7.0.0")
    raised, silent = [], []

    def lead():
        # A worker is silent after 5 s: the calls below come sooner, even on a loaded machine
        try:
            silent.append(tasks.lead(tuner, address, ["tuner1", "tuner2"], chief,
                                     timeout=5.0, poll=0.1))
        except BaseException as e:  # noqa: BLE001 - said by the assertion, not lost in a thread
            raised.append(repr(e))

    thread = threading.Thread(target=lead, daemon=True)
    thread.start()
    wait_for(lambda: "chief" in tuner.oracle.ongoing_trials, "the chief has a trial", 60)
    monkeypatch.setenv("KERASTUNER_TUNER_ID", "tuner1")
    monkeypatch.setattr(oracle_client, "TIMEOUT", 30)  # a call never waits for ever
    client = oracle_client.OracleClient(tuner.oracle)
    assert client.create_trial("tuner1").status == "RUNNING"  # then never heard of again
    assert client.create_trial("tuner2").status == "STOPPED"  # both trials are taken
    tasks.Beats(folder, "tuner2", "7.0.0").done()
    thread.join(180)
    assert not thread.is_alive() and not raised, raised
    assert silent == [{"tuner1"}]
    trials = tuner.oracle.trials.values()
    assert sorted(str(t.status) for t in trials) == ["COMPLETED", "COMPLETED"]
    assert sorted(tuner.oracle.end_order) == ["0", "1"]
    assert chief.is_done("chief")  # its last beat: the late workers are told


def test_a_chief_waiting_for_its_workers_stops_when_asked_and_is_not_done(
        tmp_path, tiny_synthetic, monkeypatch):
    """lead() after its own trials, waiting for a worker that still runs the last trial: a
    SIGTERM (stop_check raising, as the session's stopper does) ends the wait at once, the
    server stops, and the chief's beat does not say done (its workers see it fall silent)."""
    from test_tune import hypermodel_of

    from tfmulti.processes import launcher
    from tfmulti.run.config import RunConfig
    from tfmulti.tune import keras_tuner_fixes, search, stopping

    address = f"localhost:{launcher.free_ports(1)[0]}"
    monkeypatch.setenv(secret.VARIABLE, "")
    keras_tuner_fixes.require_secret(str(tmp_path), make=True)
    monkeypatch.setenv("KERASTUNER_ORACLE_IP", "localhost")
    monkeypatch.setenv("KERASTUNER_ORACLE_PORT", address.split(":")[1])
    monkeypatch.setenv("KERASTUNER_TUNER_ID", "chief")
    hypermodel = hypermodel_of(tiny_synthetic, RunConfig(model="lenet", width=2, epochs=1))
    tuner = search.make_tuner("random", hypermodel, str(tmp_path), max_trials=1)
    assert tuner.oracle.create_trial("tuner1").status == "RUNNING"  # the only trial
    chief = tasks.Beats(str(tmp_path / "workers"), "chief", "7.0.0")
    asked = []

    def stop_check():
        asked.append(time.monotonic())
        raise stopping.SessionStopped("SIGTERM", ", between trials")

    started = time.monotonic()
    with pytest.raises(stopping.SessionStopped):
        tasks.lead(tuner, address, ["tuner1"], chief, timeout=600, poll=0.1,
                   stop_check=stop_check)
    assert len(asked) == 1 and asked[0] - started < 30  # not the 600 s worker timeout
    assert chief.read("chief")[1] == "running"  # not done
    with socket.socket() as probe:  # the server let go of its port
        probe.bind(("localhost", int(address.split(":")[1])))


def test_a_planted_secret_is_refused_in_one_line(tmp_path):
    """A secret already in the session's folder is used only if it is the user's alone: a
    readable one (0644), a link to one of the user's files, a hard link, a FIFO (read without
    waiting for a writer), and one another user
    owns (as root: a 0600 file given to uid 65534; otherwise, where no other user's file can
    be put in the folder, a link to root's /etc/hostname) are each refused in one line, and
    the file linked to is left as it was; the user's own 0600 secret is used."""
    import stat

    from tfmulti.errors import UsageError
    from tfmulti.tune import secret

    def planted(name, make):
        folder = tmp_path / name
        folder.mkdir()
        make(folder / secret.FILE)
        return folder

    target = tmp_path / "mine.txt"
    target.write_text("the user's own")
    os.chmod(target, 0o600)
    cases = {
        "readable": planted("readable", lambda p: (p.write_text("0" * 64), os.chmod(p, 0o644))),
        "symlink": planted("symlink", lambda p: p.symlink_to(target)),
        "hardlink": planted("hardlink", lambda p: os.link(target, p)),
        "fifo": planted("fifo", os.mkfifo),  # refused, not waited on
    }
    if os.geteuid() == 0:
        cases["another user's"] = planted(
            "owned", lambda p: (p.write_text("0" * 64), os.chmod(p, 0o600),
                                os.chown(p, 65534, 65534)))
    else:
        cases["another user's"] = planted("owned", lambda p: p.symlink_to("/etc/hostname"))
    for case, folder in cases.items():
        with pytest.raises(UsageError) as refused:
            secret.make(str(folder))
        line = str(refused.value)
        assert "\n" not in line and "remove it and run again for a new one" in line, (case, line)
    assert target.read_text() == "the user's own"
    own = planted("own", lambda p: (p.write_text("1" * 64), os.chmod(p, 0o600)))
    assert secret.read(secret.make(str(own))) == "1" * 64
    assert stat.S_IMODE(os.stat(own / secret.FILE).st_mode) == 0o600


def test_the_chief_serves_only_callers_with_the_sessions_secret(tmp_path, tiny_synthetic,
                                                                 monkeypatch):
    """A real oracle behind the chief's server: a caller without the secret, or with another
    session's, is refused (UNAUTHENTICATED) and changes nothing; the session's own worker is
    served. The secret file is the user's alone (the group's in a set-group-id folder)."""
    import stat

    import grpc
    from keras_tuner.src import protos
    from keras_tuner.src.distribute.oracle_chief import OracleServicer
    from test_tune import hypermodel_of

    from tfmulti.processes import launcher
    from tfmulti.run.config import RunConfig
    from tfmulti.tune import search, secret

    path = secret.make(str(tmp_path))
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and len(secret.read(path)) == 64
    assert secret.make(str(tmp_path)) == path and secret.read(path) == secret.read(path)
    shared = tmp_path / "group"
    shared.mkdir()
    os.chmod(shared, 0o2770)
    assert stat.S_IMODE(os.stat(secret.make(str(shared))).st_mode) == 0o640
    other = tmp_path / "other"
    other.mkdir()
    wrong = secret.make(str(other))

    tuner = search.make_tuner("random", hypermodel_of(tiny_synthetic, RunConfig(
        model="lenet", width=2)), str(tmp_path / "session"), max_trials=2)
    server = secret.server(path)
    protos.get_service_grpc().add_OracleServicer_to_server(OracleServicer(tuner.oracle), server)
    address = f"127.0.0.1:{launcher.free_ports(1)[0]}"
    server.add_insecure_port(address)
    server.start()
    service = protos.get_service()
    try:
        for channel in (grpc.insecure_channel(address), secret.channel(address, wrong)):
            stub = protos.get_service_grpc().OracleStub(channel)
            with pytest.raises(grpc.RpcError) as refused:
                stub.CreateTrial(service.CreateTrialRequest(tuner_id="forger"), timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        late = time.monotonic()  # a worker whose chief never writes the secret: bounded wait
        stub = protos.get_service_grpc().OracleStub(
            secret.channel(address, str(tmp_path / "never" / secret.FILE)))
        with pytest.raises(grpc.RpcError) as refused:
            stub.CreateTrial(service.CreateTrialRequest(tuner_id="late"), timeout=2)
        assert refused.value.code() in (grpc.StatusCode.UNAUTHENTICATED,
                                         grpc.StatusCode.DEADLINE_EXCEEDED)
        assert time.monotonic() - late < 2 + 3
        assert tuner.oracle.trials == {}  # nothing the forger asked for happened
        stub = protos.get_service_grpc().OracleStub(secret.channel(address, path))
        made = stub.CreateTrial(service.CreateTrialRequest(tuner_id="tuner0"), timeout=10)
        assert made.trial.trial_id in tuner.oracle.trials
    finally:
        server.stop(grace=1)


def test_a_port_taken_between_probe_and_bind_is_one_line_and_port_0_binds_a_free_one(tmp_path):
    """The chief's server binds without SO_REUSEPORT: another process's server that took the
    port since it was probed (gRPC's own sockets set SO_REUSEPORT, so without this the two
    would share it) makes one line; port 0 binds a free port (--parallel_trials)."""
    path = secret.make(str(tmp_path))
    other = socket.socket()  # what another gRPC server holds: SO_REUSEPORT set
    other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    other.bind(("127.0.0.1", 0))
    other.listen()
    taken = f"127.0.0.1:{other.getsockname()[1]}"
    try:
        with pytest.raises(UsageError, match="another process took the port") as e:
            secret.listen(secret.server(path), taken)
        assert "\n" not in str(e.value) and taken in str(e.value)
    finally:
        other.close()
    server = secret.server(path)
    port = secret.listen(server, "127.0.0.1:0")
    try:
        assert port > 0
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            with pytest.raises(OSError):
                probe.bind(("127.0.0.1", port))  # the chief holds it, and shares it with none
    finally:
        server.stop(grace=0)


def test_parallel_trials_wait_for_the_chief_to_listen_only_so_long():
    """Every wait is bounded: a chief whose server never listens is given up after the bound,
    a chief that failed is said in its own line, and one that listens lets the workers go."""
    event = threading.Event()
    stuck = threading.Thread(target=time.sleep, args=(30,), daemon=True)
    stuck.start()
    began = time.monotonic()
    with pytest.raises(UserError, match="did not start listening within 1 s"):
        parallel_trials.listening(stuck, [], event, 1)
    assert time.monotonic() - began < 1 + 2
    with pytest.raises(UserError) as failed:
        parallel_trials.listening(stuck, [UsageError("the tuning chief cannot listen on x")],
                                  event, 5)
    assert str(failed.value) == "the tuning chief cannot listen on x"
    event.set()
    parallel_trials.listening(stuck, [], event, 1)


def test_the_secret_never_crosses_the_wire_and_a_call_seen_there_cannot_be_replayed(tmp_path):
    """Under Slurm the chief's calls cross the nodes' network in clear gRPC: each carries a
    signature of its own (a keyed hash of the method, the time and a nonce), never the
    secret. A real server and channel: the metadata on the wire holds no secret; the same
    metadata sent again (a replay), a signature of another key, one 400 s old and none are
    refused; a hundred calls in a row pass."""
    import grpc

    from tfmulti.processes import launcher
    from tfmulti.tune import secret

    path = secret.make(str(tmp_path))
    token = secret.read(path)
    server = secret.server(path)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.Echo", {
        "Say": grpc.unary_unary_rpc_method_handler(lambda request, context: request)}),))
    address = f"127.0.0.1:{launcher.free_ports(1)[0]}"
    server.add_insecure_port(address)
    server.start()
    on_the_wire = []

    class Record(grpc.UnaryUnaryClientInterceptor):
        def intercept_unary_unary(self, continuation, details, request):
            on_the_wire.append(list(details.metadata or []))
            return continuation(details, request)

    raw = grpc.insecure_channel(address)
    try:
        signed = secret.channel(address, path, through=grpc.intercept_channel(raw, Record()))
        say = signed.unary_unary("/t.Echo/Say")
        assert [say(b"%d" % i, timeout=10) for i in range(100)] == [b"%d" % i for i in range(100)]
        sent = [value for metadata in on_the_wire for key, value in metadata if key == secret.KEY]
        assert len(set(sent)) == 100 and not any(token in value for value in sent)
        forged = [sent[-1],  # a replay of a call seen on the wire
                  secret.signed("0" * 64, "/t.Echo/Say"),  # another key
                  secret.signed(token, "/t.Echo/Say", now=time.time() - 400),  # too old
                  secret.signed(token, "/t.Other/Say"),  # another method's
                  ""]
        for given in forged:
            with pytest.raises(grpc.RpcError) as refused:
                raw.unary_unary("/t.Echo/Say")(b"x", metadata=[(secret.KEY, given)] if given
                                               else None, timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, given
    finally:
        raw.close()
        server.stop(grace=0)
