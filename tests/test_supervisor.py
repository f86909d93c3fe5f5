"""The process supervisor with real processes: a child killed with kill -9 is seen within a
poll; a failure gives the others their grace, then SIGTERM, then SIGKILL for one that ignores
SIGTERM; the children die with a supervisor killed with kill -9; every child gets the malloc
TFMULTI_MALLOC chooses preloaded. Every wait has a time limit; children say when they are
ready (a file), nothing waits a fixed time for them.
"""
import os
import signal
import subprocess
import sys
import time

import pytest
from processes import alive, gone_within

from tfmulti.distribution import allocator
from tfmulti.errors import UsageError
from tfmulti.processes import supervisor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A child: dies with its parent, writes "<pid> <time>" to its ready file once its SIGTERM
# handling is in place, then waits for `wait_for` (a file) if given and exits with `code`
# (-1: runs until stopped). on_term: "log" writes the time of each SIGTERM to <ready>.term
# and goes on (as TensorFlow holds a worker forming its group), "exit" exits 75.
CHILD = """
import os, signal, sys, time
from tfmulti.processes import child
child.die_with_parent_from_environment()
ready, code, on_term, wait_for = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]

def log_term(signum, frame):
    with open(ready + ".term", "a") as f:
        f.write(f"{time.time()}\\n")

signal.signal(signal.SIGTERM, log_term if on_term == "log" else lambda *a: sys.exit(75))
with open(ready + ".tmp", "w") as f:
    f.write(f"{os.getpid()} {time.time()}")
os.replace(ready + ".tmp", ready)
deadline = time.monotonic() + 120
while wait_for != "-" and not os.path.exists(wait_for) and time.monotonic() < deadline:
    time.sleep(0.01)
if code >= 0:
    sys.exit(code)
while True:
    time.sleep(0.1)
"""


def stand_in(ready, code=-1, on_term="exit", wait_for=None):
    return [sys.executable, "-c", CHILD, str(ready), str(code), on_term, str(wait_for or "-")]


def ready_pid(path, timeout=60):
    """The pid a child wrote once ready."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return int(path.read_text().split()[0])
        time.sleep(0.02)
    raise AssertionError(f"{path.name}: the child did not start within {timeout} s")


class Lines:
    """The supervisor's lines, each with the time it was said."""

    def __init__(self):
        self.said = []

    def __call__(self, line):
        self.said.append((time.time(), line))

    def when(self, words):
        return next(t for t, line in self.said if words in line)


def test_a_child_killed_with_kill_9_is_seen_within_a_poll(tmp_path):
    said = Lines()
    with supervisor.Supervisor(said, noun="worker") as group:
        group.start("worker 0", stand_in(tmp_path / "w0"), cwd=ROOT)
        victim = group.start("worker 1", stand_in(tmp_path / "w1"), cwd=ROOT)
        pids = [ready_pid(tmp_path / "w0"), ready_pid(tmp_path / "w1")]
        killed_at = time.time()
        os.kill(pids[1], signal.SIGKILL)
        failed, signum, timed_out = group.watch(grace=0.5, timeout=60)
    assert (failed, signum, timed_out) == (victim, None, False)
    assert supervisor.shell_code(victim.poll()) == 137
    seen = said.when("worker 1 exited with code 137; the others get 0.5 s to stop")
    assert seen - killed_at < supervisor.POLL_SECONDS + 1.0  # a poll, and a margin for load
    assert gone_within(pids, 1)


def test_a_failure_gives_the_others_their_grace_then_sigterm_then_sigkill(tmp_path):
    """The other child ignores SIGTERM (it logs it): it gets SIGTERM once the grace is over,
    and SIGKILL a bound after that."""
    grace = 1.5
    said = Lines()
    with supervisor.Supervisor(said, noun="worker") as group:
        stubborn = group.start("worker 0", stand_in(tmp_path / "w0", on_term="log"), cwd=ROOT)
        group.start("worker 1", stand_in(tmp_path / "w1", code=3, wait_for=tmp_path / "w0"),
                    cwd=ROOT)
        pid = ready_pid(tmp_path / "w0")
        failed, signum, _ = group.watch(grace=grace, timeout=60)
        ended = time.time()
    assert failed.name == "worker 1" and supervisor.shell_code(failed.poll()) == 3
    assert stubborn.poll() == -signal.SIGKILL
    noticed = said.when("worker 1 exited with code 3; the others get 1.5 s to stop")
    stopping = said.when("still running 1.5 s after worker 1 failed: stopping 1 worker "
                         "(SIGTERM, SIGKILL after 1.5 s)")
    terms = [float(t) for t in (tmp_path / "w0.term").read_text().split()]
    assert len(terms) == 1
    # (0.1 s: the clocks are read a little before or after the events they time)
    assert grace - 0.1 <= terms[0] - noticed < grace + 2  # the grace first, then SIGTERM
    assert stopping <= terms[0]
    assert grace - 0.1 <= ended - terms[0] < grace + 2  # SIGKILL the bound after SIGTERM
    assert not alive(pid)


# A supervisor in a process of its own: starts two children, says READY once both are.
SUPERVISOR = """
import os, sys, time
from tfmulti.processes import supervisor
child, ready = sys.argv[1], sys.argv[2:]
with supervisor.Supervisor() as group:
    for i, path in enumerate(ready):
        group.start(f"child {i}", [sys.executable, "-c", child, path, "-1", "exit", "-"])
    deadline = time.monotonic() + 60
    while not all(os.path.exists(p) for p in ready) and time.monotonic() < deadline:
        time.sleep(0.02)
    print("READY", flush=True)
    group.watch(grace=60)
    print("STOPPED", flush=True)
"""


def start_supervisor(tmp_path):
    ready = [tmp_path / "c0", tmp_path / "c1"]
    process = subprocess.Popen([sys.executable, "-c", SUPERVISOR, CHILD, *map(str, ready)],
                               cwd=ROOT, stdout=subprocess.PIPE, text=True,
                               env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        assert process.stdout.readline().strip() == "READY"
    except BaseException:
        process.kill()
        process.wait(10)
        raise
    return process, [ready_pid(p) for p in ready]


def test_the_children_die_with_a_supervisor_killed_with_kill_9(tmp_path):
    process, pids = start_supervisor(tmp_path)
    try:
        process.kill()
        process.wait(10)
        assert gone_within(pids, 10)
    finally:
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_or_sigint_to_the_supervisor_stops_the_children(tmp_path, sig):
    process, pids = start_supervisor(tmp_path)
    try:
        process.send_signal(sig)
        out, _ = process.communicate(timeout=30)
        assert process.returncode == 0 and out.strip() == "STOPPED"
        assert gone_within(pids, 1)
    finally:
        process.kill()
        process.wait(10)
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


REPORT_MALLOC = "from tfmulti.distribution import allocator; print(allocator.loaded_malloc())"


def child_output(tmp_path, monkeypatch, setting):
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    if setting is None:
        monkeypatch.delenv(allocator.SETTING, raising=False)
    else:
        monkeypatch.setenv(allocator.SETTING, setting)
    log = tmp_path / "child.log"
    with supervisor.Supervisor() as group:
        c = group.start("child", [sys.executable, "-c", REPORT_MALLOC], log=str(log), cwd=ROOT)
        failed, _, _ = group.watch(grace=0, timeout=60)
    assert failed is None and c.poll() == 0, log.read_text()
    return log.read_text().splitlines()


@pytest.mark.parametrize("setting", [None, "auto"])
def test_a_child_has_tcmalloc_preloaded_when_it_is_installed(tmp_path, monkeypatch, setting):
    """With TCMalloc installed, the child has it mapped from its start; without it, the
    system's malloc and no line from the dynamic loader."""
    expected = "tcmalloc" if allocator.find_tcmalloc() else "system"
    assert child_output(tmp_path, monkeypatch, setting) == [expected]


def test_a_child_keeps_the_system_malloc_on_request(tmp_path, monkeypatch):
    assert child_output(tmp_path, monkeypatch, "system") == ["system"]


def test_a_bad_malloc_setting_is_one_line_before_any_child_starts(tmp_path, monkeypatch):
    monkeypatch.setenv(allocator.SETTING, "fast")
    with supervisor.Supervisor() as group:
        with pytest.raises(UsageError, match="TFMULTI_MALLOC=fast: give auto, tcmalloc, system"):
            group.start("child", [sys.executable, "-c", "pass"])
        assert not group.live()


def _report_malloc(send):
    from tfmulti.distribution import allocator as in_child

    send.send(in_child.loaded_malloc())


def test_a_spawned_child_gets_the_malloc_and_the_parent_keeps_its_environment(monkeypatch):
    """child.run (tuning trials, the doctor's probes) starts its process with the malloc
    TFMULTI_MALLOC chooses, like the supervisor's children; this process's own environment
    is left as it was."""
    from tfmulti.processes import child

    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.delenv(allocator.SETTING, raising=False)
    before = dict(os.environ)
    got = child.run(_report_malloc, (), timeout=120)
    assert got == ("tcmalloc" if allocator.find_tcmalloc() else "system")
    assert dict(os.environ) == before
    # TFMULTI_MALLOC=system: nothing preloaded for the child (the environment it would start
    # with; a second spawned child cost the suite 10 s).
    monkeypatch.setenv(allocator.SETTING, "system")
    with child._preloaded_environment():
        assert "LD_PRELOAD" not in os.environ
    assert dict(os.environ) == {**before, allocator.SETTING: "system"}


def test_a_line_several_children_say_is_shown_once_and_each_failure_named(capfd):
    """Two workers that stop for the same reason each print the same tfmulti line (and one
    its own progress line): the prefixed output shows the tfmulti line once, every other line
    as printed, and the supervisor names both failures."""
    said = []
    line = "tfmulti: error: lost contact with another worker (the chief)"
    script = ("import sys, time; print(sys.argv[1], flush=True); "
              "time.sleep(float(sys.argv[2])); print({!r}, flush=True); sys.exit(1)")
    with supervisor.Supervisor(said.append, noun="worker", poll=0.05) as workers:
        for i, delay in enumerate((0.0, 0.5)):
            workers.start(f"worker {i}", [sys.executable, "-c", script.format(line),
                                          f"step {i}", str(delay)], prefix=f"[worker {i}] ")
        failed, signum, _ = workers.watch(grace=5)
    out = capfd.readouterr().out.splitlines()
    assert sorted(out) == sorted(["[worker 0] step 0", "[worker 1] step 1",
                                  f"[worker 0] {line}"]), out
    assert failed.name == "worker 0" and signum is None
    assert said[0].startswith("worker 0 exited with code 1") and said[1:] == [
        "worker 1 exited with code 1"], said
