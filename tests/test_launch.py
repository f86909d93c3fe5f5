"""tfmulti.launch watches every worker and stops them all, whatever ends first.

Stand-in workers (small Python programs) make each case happen for real and fast: a worker
that fails at once while another waits for ever (as a worker of a group that will never
form does, ignoring SIGTERM the way TensorFlow does then), SIGTERM and Ctrl-C to the
launcher, and the launcher killed with kill -9.
"""
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from processes import gone_within

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A worker: writes its pid, then fails with `code` after `delay` s, or waits for ever.
# on_term: "ignore" (TensorFlow forming a group), "save" (exit 75, as the main job does).
WORKER = """
import os, signal, sys, time
from tfmulti.processes import child
child.die_with_parent_from_environment()
pid_file, code, delay, on_term = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
if on_term == "ignore":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
elif on_term == "save":
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(75))
open(pid_file, "w").write(str(os.getpid()))
if code >= 0:
    time.sleep(delay)
    sys.exit(code)
while True:
    time.sleep(0.1)
"""

# The launcher, on those workers: prints its exit code's reason through its own output.
LAUNCHER = """
import json, sys
from tfmulti.processes import launcher
commands, grace = json.loads(sys.argv[1]), float(sys.argv[2])
sys.exit(launcher.launch(commands, grace=grace))
"""


def worker(tmp_path, name, code=-1, delay=0.0, on_term="ignore"):
    return [sys.executable, "-c", WORKER, str(tmp_path / f"{name}.pid"), str(code), str(delay),
            on_term]


STARTED = []  # launchers and worker pids, killed after each test whatever its outcome


@pytest.fixture(autouse=True)
def nothing_left_running():
    yield
    for launcher in STARTED:
        if isinstance(launcher, int):  # a worker's pid
            try:
                os.kill(launcher, signal.SIGKILL)
            except ProcessLookupError:
                pass
        elif launcher.poll() is None:
            launcher.kill()
    STARTED.clear()


def start_launcher(commands, grace):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONUNBUFFERED="1")
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, json.dumps(commands),
                                 str(grace)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    STARTED.append(launcher)
    return launcher


def pids(tmp_path, names, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all((tmp_path / f"{n}.pid").exists() and (tmp_path / f"{n}.pid").read_text()
               for n in names):
            found = [int((tmp_path / f"{n}.pid").read_text()) for n in names]
            STARTED.extend(found)
            return found
        time.sleep(0.1)
    raise AssertionError(f"workers {names} did not start")


# the first and the last worker in make soak (5 s each)
@pytest.mark.parametrize("failing", [pytest.param(0, marks=pytest.mark.soak), 1,
                                     pytest.param(2, marks=pytest.mark.soak)])
def test_any_workers_exit_is_noticed_and_the_others_stopped(tmp_path, failing):
    """Whichever worker fails, the launcher sees it, gives the rest `grace` seconds, then
    stops them (SIGKILL for those that ignore SIGTERM) and exits with the failure's code.
    It used to poll only up to the first live worker, so a later worker's exit went unseen."""
    names = ["w0", "w1", "w2"]
    commands = [worker(tmp_path, n, code=3 if i == failing else -1, delay=1.0)
                for i, n in enumerate(names)]
    launcher = start_launcher(commands, grace=2)
    workers = pids(tmp_path, names)
    failed = time.monotonic()
    out, _ = launcher.communicate(timeout=60)
    assert launcher.returncode == 3, out
    assert time.monotonic() - failed < 1.0 + 2 + 2 + 3  # delay + grace + kill + margin
    assert f"[launch] worker {failing} exited with code 3; the others get 2 s" in out
    assert all(gone_within([pid], 5) for pid in workers)


def test_sigterm_to_the_launcher_stops_every_worker_and_passes_on_their_save(tmp_path):
    """Workers that save and exit 75 on SIGTERM: the launcher exits 75 too."""
    commands = [worker(tmp_path, n, on_term="save") for n in ("w0", "w1")]
    launcher = start_launcher(commands, grace=30)
    workers = pids(tmp_path, ["w0", "w1"])
    launcher.send_signal(signal.SIGTERM)
    out, _ = launcher.communicate(timeout=30)
    assert launcher.returncode == 75, out
    assert "[launch] SIGTERM received: stopping 2 workers" in out
    assert all(gone_within([pid], 5) for pid in workers)


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_stopped_launcher_kills_workers_that_do_not_stop(tmp_path, sig, code):
    commands = [worker(tmp_path, n) for n in ("w0", "w1")]
    launcher = start_launcher(commands, grace=2)
    workers = pids(tmp_path, ["w0", "w1"])
    launcher.send_signal(sig)
    out, _ = launcher.communicate(timeout=30)
    assert launcher.returncode == code, out
    assert all(gone_within([pid], 5) for pid in workers)


def test_workers_die_with_a_killed_launcher(tmp_path):
    """kill -9 of the launcher: its workers do not live on as orphans."""
    commands = [worker(tmp_path, n) for n in ("w0", "w1")]
    launcher = start_launcher(commands, grace=60)
    workers = pids(tmp_path, ["w0", "w1"])
    launcher.kill()
    launcher.wait()
    assert all(gone_within([pid], 10) for pid in workers)


# ----------------------------------------------------------------------------- GPU shares

@pytest.mark.parametrize("workers, per_worker, available, visible, wanted", [
    (2, None, 4, None, ["0,1", "2,3"]),           # split evenly
    (2, None, 3, None, ["0", "1"]),               # the odd GPU left out
    (4, 2, 8, None, ["0,1", "2,3", "4,5", "6,7"]),
    (2, 1, 4, ["3", "5", "6", "7"], ["3", "5"]),  # through the user's CUDA_VISIBLE_DEVICES
])
def test_each_worker_gets_gpus_of_its_own(workers, per_worker, available, visible, wanted):
    from tfmulti.processes import launcher
    shares = launcher.worker_shares(workers, per_worker, available, visible)
    assert [env["CUDA_VISIBLE_DEVICES"] for _, env in shares] == wanted
    each = len(wanted[0].split(","))
    assert all(flags == [f"--num_gpus={each}", "--cpu_replicas=0"] for flags, _ in shares)


def test_cpu_workers_see_no_gpu_or_are_left_alone():
    from tfmulti.processes import launcher
    assert launcher.worker_shares(3, 0, 8) == [([], {"CUDA_VISIBLE_DEVICES": ""})] * 3
    assert launcher.worker_shares(3, None, 0) == [([], {})] * 3  # no GPU: as before


@pytest.mark.parametrize("workers, per_worker, available, args, words", [
    (3, None, 2, (), "--workers=3 on 2 GPUs: each worker needs a GPU of its own"),
    (2, 3, 4, (), "--workers=2 x --gpus_per_worker=3 needs 6 GPUs; TensorFlow sees 4"),
    (2, -1, 4, (), "--gpus_per_worker=-1: give 0 (the CPU) or more"),
    (2, 1, 4, ("--num_gpus=2",), "--num_gpus: the launcher gives each worker its GPUs"),
    (2, None, 4, ("--cpu_replicas=2",), "--cpu_replicas: the launcher gives each worker"),
])
def test_gpu_shares_refused(workers, per_worker, available, args, words):
    from tfmulti.errors import UsageError
    from tfmulti.processes import launcher
    with pytest.raises(UsageError, match=re.escape(words)):
        launcher.worker_shares(workers, per_worker, available, None, args)


SHOW_ENV = "import os, sys; print(sys.argv[1], repr(os.environ.get('CUDA_VISIBLE_DEVICES')))"

LAUNCHER_WITH_ENVS = """
import json, sys
from tfmulti.processes import launcher
commands, envs = json.loads(sys.argv[1]), json.loads(sys.argv[2])
sys.exit(launcher.launch(commands, grace=5, envs=envs))
"""


def test_the_launcher_hands_each_worker_its_share():
    """Real worker processes report the CUDA_VISIBLE_DEVICES they were started with: before,
    every worker inherited the launcher's (all GPUs)."""
    from tfmulti.processes import launcher
    shares = launcher.worker_shares(2, None, 4)
    commands = [[sys.executable, "-c", SHOW_ENV, str(i), *flags]
                for i, (flags, _) in enumerate(shares)]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="0,1,2,3", TF_CPP_MIN_LOG_LEVEL="3")
    out = subprocess.run([sys.executable, "-c", LAUNCHER_WITH_ENVS, json.dumps(commands),
                          json.dumps([e for _, e in shares])], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = sorted(line for line in out.stdout.splitlines() if line.startswith("[worker"))
    assert lines == ["[worker 0] 0 '0,1'", "[worker 1] 1 '2,3'"]


def test_the_launcher_library_loads_no_tensorflow():
    """The launcher starts workers and trains nothing: importing it must not load TensorFlow
    or Keras (seconds of start-up and hundreds of MB in every launcher process)."""
    code = ("import sys; from tfmulti.processes import launcher; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('tensorflow', 'keras')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("visible, nodes, none", [
    ("", [], True), ("-1", ["nvidia0", "nvidiactl"], True),  # hidden, whatever is there
    (None, ["null", "tty"], True),  # no driver's node: CUDA finds no GPU
    (None, ["nvidiactl", "nvidia0"], False), (None, ["dxg"], False),  # WSL2's GPU
    ("0,1", ["nvidia0"], False)])
def test_no_gpu_is_known_without_tensorflow_where_none_can_be_seen(tmp_path, visible, nodes,
                                                                   none):
    from tfmulti.distribution import devices

    for name in nodes:
        (tmp_path / name).touch()
    environ = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    assert devices.no_gpu_visible(environ, dev=str(tmp_path)) is none


def test_a_launch_where_no_gpu_can_be_seen_never_imports_tensorflow():
    """The launcher counts GPUs to share them out: with CUDA_VISIBLE_DEVICES empty it knows 0
    without TensorFlow's import; with it unset, likewise where the machine has no NVIDIA
    device node (this one), and with one it asks TensorFlow."""
    code = ("import sys; from tfmulti.processes import launcher; "
            "print(launcher.gpus_seen_quietly(), "
            "'tensorflow' in sys.modules)")
    nodes = [n for n in os.listdir("/dev") if n.startswith("nvidia") or n == "dxg"]
    for visible in (None, ""):
        env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
        env.update({} if visible is None else {"CUDA_VISIBLE_DEVICES": visible})
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=60)
        count, imported = out.stdout.split()
        assert imported == str(visible is None and bool(nodes)), out.stderr[-2000:]
        assert count == "0" or nodes, out.stdout


def test_more_gpus_per_worker_than_the_machine_has_is_one_line(tool):
    """Where no GPU is visible (the tests hide them); in-process through cli.main."""
    code, _, err = tool("launch", "--workers=2", "--gpus_per_worker=1", "--", "--dataset=synthetic")
    assert code == 1
    assert err.strip().splitlines() == [
        "tfmulti: error: --workers=2 x --gpus_per_worker=1 needs 2 GPUs; TensorFlow sees 0"]


def test_a_bad_malloc_setting_is_one_line():
    """TFMULTI_MALLOC is read where the workers are started: a bad one stops the launcher
    with one line before any worker starts."""
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    out = subprocess.run([sys.executable, "-m", "tfmulti.launch", "--workers=2", "--",
                          "--dataset=synthetic"], cwd=ROOT, env=dict(env, TFMULTI_MALLOC="fast"),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [
        "tfmulti: error: TFMULTI_MALLOC=fast: give auto, tcmalloc, system or the absolute path "
        "of a malloc library"]
    assert "[worker" not in out.stdout


# ----------------------------------------------------------------------------- own network

def test_a_holders_network_is_joined_by_its_workers_and_only_by_them(tmp_path):
    """Real namespaces: a holder's network; a process that joins it (as a worker does,
    through the environment) serves on 0.0.0.0 there; another joiner reaches it, a process
    outside (this one) reaches nothing on that port."""
    from test_multiworker import refused_everywhere

    from tfmulti.processes import netns

    holder = netns.Holder(1)
    assert holder.why == "" and len(holder.ports) == 1, holder.why
    port = holder.ports[0]
    serve = (f"from tfmulti.processes import netns; netns.join_from_environment()\n"
             f"import socket; s = socket.socket(); s.bind(('0.0.0.0', {port})); s.listen()\n"
             "print('up', flush=True); c, _ = s.accept(); c.sendall(b'hi'); c.close()")
    reach = (f"from tfmulti.processes import netns; netns.join_from_environment()\n"
             f"import socket; print(socket.create_connection(('localhost', {port}), 5).recv(2))")
    env = {**os.environ, **holder.env}
    try:
        server = subprocess.Popen([sys.executable, "-c", serve], cwd=ROOT, env=env,
                                  stdout=subprocess.PIPE, text=True)
        assert server.stdout.readline().strip() == "up"
        assert not any(reached for _, reached in refused_everywhere(port))  # from outside
        inside = subprocess.run([sys.executable, "-c", reach], cwd=ROOT, env=env,
                                capture_output=True, text=True, timeout=60)
        assert inside.stdout.strip() == "b'hi'", inside.stderr
        server.wait(timeout=30)
    finally:
        holder.close()
    assert holder.process.poll() is not None


def test_a_worker_that_cannot_join_its_network_stops_in_one_line():
    """A holder already gone (its pid now nobody's): the worker does not train on the
    machine's network instead; one line, exit 1, before TensorFlow loads."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    out = subprocess.run([sys.executable, "-m", "tfmulti.main", "--dataset=synthetic"],
                         cwd=ROOT, env={**os.environ, "TFMULTI_NETWORK_OF": str(gone.pid)},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert re.fullmatch(r"tfmulti: error: could not join the workers' network \(\[Errno 2\] "
                        r"No such file or directory: '/proc/\d+/ns/user'\)",
                        out.stderr.strip()), out.stderr


def test_a_process_with_threads_cannot_make_a_network_and_says_why():
    """The kernel moves only a single-threaded process (EINVAL otherwise): the reason, not a
    network half made; the launcher then says its workers' servers are open."""
    code = ("import threading, time; from tfmulti.processes import netns\n"
            "threading.Thread(target=time.sleep, args=(5,), daemon=True).start()\n"
            "print(netns.enter_private_network())")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.stdout.strip() == "this process already runs threads", out.stderr


def test_the_launcher_takes_the_machines_network_only_when_asked():
    """Remote storage (the workers' own network cannot reach it) is refused in one line
    naming --network=host, nothing started; with --network=host the servers are open, and
    the line says so."""
    from tfmulti.errors import UsageError
    from tfmulti.processes import launcher

    with pytest.raises(UsageError, match="^--model_dir is remote storage, which the workers' "
                                         "own network cannot reach; .* pass --network=host "):
        launcher.worker_network("private", ["--model_dir=gs://b/run"], 2)
    line, ports, holder = launcher.worker_network("host", ["--model_dir=gs://b/run"], 2)
    assert holder is None and len(ports) == 2
    assert line.startswith("--network=host: the workers' servers listen")


def test_where_the_kernel_refuses_a_network_of_their_own_the_launcher_stops_in_one_line(
        tmp_path):
    """The kernel really refusing user namespaces (max_user_namespaces=0 in the namespace the
    launcher runs in, as a container's profile or a distribution's rule would): one line
    that says why and names --network=host, exit 1, no worker started, no run folder."""
    script = ('echo 0 > /proc/sys/user/max_user_namespaces && exec "$0" -m tfmulti.launch '
              '--workers=2 --gpus_per_worker=0 -- --dataset=synthetic --model=lenet '
              f'--model_dir={tmp_path / "run"}')
    done = subprocess.run(["unshare", "--user", "--map-root-user", "sh", "-c", script,
                           sys.executable], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1, done.stderr
    assert re.fullmatch(r"tfmulti: error: the workers cannot have a network of their own here "
                        r"\(.+\); their servers would listen on every interface and run code "
                        r"for whoever reaches them: pass --network=host .*", lines[0]), lines
    assert "Training" not in done.stdout and not (tmp_path / "run").exists()


def test_the_doctor_says_where_a_worker_listens():
    from tfmulti.distribution import workers
    from tfmulti.processes import netns

    cluster = workers.cluster_config("localhost:2222,localhost:2223", 1)
    line = netns.listening_line(cluster)
    assert line.startswith("this worker's server (localhost:2223) will listen on every "
                           "interface, 0.0.0.0:2223 (127.0.0.1:2223")
    assert all(f"{a}:2223" in line for a in netns.machine_addresses())
    assert line.endswith("on one machine, python -m tfmulti.launch (--program=doctor for the "
                         "doctor) gives the workers a network of their own")
    across = netns.listening_line(workers.cluster_config("n1:2222,n2:2222", 0))
    assert across.endswith("keep the workers on the job's own network "
                           "(docs/faults-and-workers.md)")
    netns.JOINED = True  # a worker the launcher started in its network
    try:
        assert netns.listening_line(cluster) == (
            "this worker's server (localhost:2223) listens in the launcher's network of its "
            "own (--network=private): only the other workers reach it")
    finally:
        netns.JOINED = False


def test_a_holder_that_never_answers_is_given_up_within_its_bound():
    """The launcher waits for the holder's 'ready' at most its bound, then goes on without a
    network of their own (said), and the silent holder is stopped."""
    from tfmulti.processes import netns

    start = time.monotonic()
    holder = netns.Holder(2, timeout=1, program="import time; time.sleep(600)")
    assert time.monotonic() - start < 1 + 5 + 3  # the bound, close()'s wait, a margin
    assert holder.ports == [] and holder.env == {}
    assert holder.why == "the holder process did not answer in 1 s"
    assert holder.process.poll() is not None


def test_the_runtimes_own_logs_are_off_in_the_workers_unless_the_user_set_the_level():
    from tfmulti.processes import launcher

    assert launcher.runtime_logging({}) == {"TF_CPP_MIN_LOG_LEVEL": "3",
                                            "GRPC_VERBOSITY": "NONE"}
    assert launcher.runtime_logging({"GRPC_VERBOSITY": "debug"})["GRPC_VERBOSITY"] == "debug"
    assert launcher.runtime_logging({"TF_CPP_MIN_LOG_LEVEL": "0"}) == {}  # theirs, inherited
