"""The one bounded wait (tfmulti/waits.py) and a lock taken through it by another process."""
import os
import subprocess
import sys
import time

from tfmulti import waits
from tfmulti.distribution import storage


def test_a_wait_returns_the_first_answer_and_gives_up_at_its_limit():
    asked = []
    assert waits.until(lambda: asked.append(1) or (len(asked) >= 3 and "here"), 5,
                       poll_s=0.01) == "here"
    assert len(asked) == 3
    started = time.monotonic()
    assert waits.until(lambda: "", 0.3, poll_s=0.05) == ""
    assert 0.3 <= time.monotonic() - started < 2
    once = []
    assert waits.until(lambda: once.append(1), 0) is None and once == [1]  # asked once


def test_a_lock_another_process_holds_is_waited_for_within_its_limit(tmp_path):
    """A real second process holds the flock for 1 s: a wait of 0.2 s gives up, a wait of
    10 s takes it once the holder lets go."""
    path = str(tmp_path / "held.lock")
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'a'); "
         "fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); time.sleep(1)", path],
        stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "held\n"
    fd = storage.own_file(path)
    try:
        assert not storage.try_lock(fd, 0.2)
        started = time.monotonic()
        assert storage.try_lock(fd, 10)
        assert time.monotonic() - started < 5
    finally:
        os.close(fd)
        holder.wait(10)


def test_make_soak_stops_a_check_at_its_limit_with_the_processes_it_started():
    """A check's process (here a shell and the sleep it started) past its limit is killed
    with its children, and the check gets its output with a line that says so: make soak
    then goes on to its other checks."""
    from testing import soak

    process = subprocess.Popen(["sh", "-c", "echo begun; sleep 60 & wait"], text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert waits.until(lambda: soak.descendants(process.pid), 30, poll_s=0.05)
    [sleeper] = soak.descendants(process.pid)
    started = time.monotonic()
    code, out = soak.finish(process, timeout=1)
    assert time.monotonic() - started < 10 and code == -9
    assert out.startswith("begun") and out.endswith("its time limit, 1 s")
    time.sleep(0.2)
    try:  # gone, or a zombie until its new parent reaps it
        with open(f"/proc/{sleeper}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        state = "gone"
    assert state in ("gone", "Z", "X")


def test_make_soak_gives_up_the_output_a_process_outside_the_check_holds(tmp_path):
    """A check whose shell left a sleep outside its tree (a double fork: not its
    descendant, so not killed) holding the output pipe: after the kill, the output is waited
    for `reread_s` more seconds, then given up, and the check still ends with its line."""
    from testing import soak

    escaped = tmp_path / "escaped.pid"
    process = subprocess.Popen(
        ["sh", "-c", f"echo begun; (sleep 60 & echo $! > {escaped}); sleep 60"], text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    sleeper = None
    try:
        assert waits.until(lambda: escaped.exists() and escaped.read_text().strip(), 30,
                           poll_s=0.05)
        sleeper = int(escaped.read_text())
        assert sleeper not in soak.descendants(process.pid)
        started = time.monotonic()
        code, out = soak.finish(process, timeout=1, reread_s=2)
        took = time.monotonic() - started
        assert code == -9 and out.endswith("\nsoak: stopped with kill -9 at its time limit, 1 s")
        assert 3 <= took < 10  # the limit, then the reread's bound: not the sleep's 60 s
    finally:
        process.kill()
        process.wait(30)
        if sleeper is not None:
            os.kill(sleeper, 9)


def test_make_soak_reads_a_pytest_run_on_two_workers_as_pytest_says_it():
    """The suite part runs on pytest-xdist, whose last line names no deselected tests: 166
    passed was read as a failure once."""
    from testing import soak

    assert soak.pytest_passed(0, "166 passed, 383 warnings in 2365.95s (0:39:25)")
    assert soak.pytest_passed(0, "12 passed, 3 deselected in 9.1s")
    assert not soak.pytest_passed(1, "164 passed, 1 failed, 383 warnings in 2424.10s")
    assert not soak.pytest_passed(1, "3 passed, 2 errors in 5.0s")
    assert not soak.pytest_passed(5, "no tests ran in 0.5s")
    assert not soak.pytest_passed(0, "0 passed in 0.1s")
    assert not soak.pytest_passed(0, "no output")


def test_make_soak_shows_a_failed_suites_failures_not_its_warnings():
    """A failed suite part records pytest's FAILURES section: its last 3000 characters were
    the warnings summary, and the failure's assertion was lost."""
    from testing import soak

    def heading(title):
        return f"{'=' * 30} {title} {'=' * 30}\n"

    out = ("...F..\n" + heading("FAILURES") + "___ test_x ___\n    assert [1, 0] == [0, 0]\n"
           "E   worker 1 crashed: double free\n" + heading("warnings summary")
           + "UserWarning: Skipping variable loading\n" * 200 + heading("short test summary info")
           + "FAILED tests/test_x.py::test_x\n1 failed, 5 passed in 9.0s\n")
    shown = soak.failures_of(out)
    assert "E   worker 1 crashed: double free" in shown and "UserWarning" not in shown
    assert soak.failures_of("1 passed\n") == "1 passed\n"
