"""The one process supervisor: the launcher's workers, the tuning workers, the benchmarks'.

A child is started with the malloc chosen for it preloaded (allocator.child_environment), in
a session of its own (a Ctrl-C on the terminal reaches only the supervisor, which stops the
children in order), and told to die with this process (child.PARENT_VARIABLE: a tfmulti entry
point, or a program calling child.die_with_parent_from_environment, then dies when this
process does, even by kill -9). Its output is streamed line by line with a prefix, or
appended to a log file.

Every child is polled every time (a later child's exit is seen as soon as the first's). When
one fails, the others get a grace to stop by themselves (workers of a group usually do: they
lose contact), then SIGTERM, then SIGKILL after a bound. SIGTERM or SIGINT to this process
stops them the same way, and a second one kills them. No wait is unbounded.
"""
from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

from tfmulti import waits
from tfmulti.distribution import allocator, storage
from tfmulti.processes import child

POLL_SECONDS = 0.2  # how often every child is polled
KILL_AFTER_SECONDS = 10.0  # longest wait between SIGTERM and SIGKILL after a failure
REAP_SECONDS = 10.0  # longest wait for a killed child to be reaped
READER_SECONDS = 5.0  # longest wait for a child's last output lines once it ended


def shell_code(code: int | None) -> int | None:
    """An exit code as a shell reports it: 128 + the signal for a child a signal killed."""
    return 128 - code if code is not None and code < 0 else code


class Child:
    """One supervised process: its command, what it adds to the environment, where its
    output goes, and the process of its latest start."""

    def __init__(self, name, command, env, prefix, log, cwd):
        self.name, self.command, self.env = name, list(command), dict(env or {})
        self.prefix, self.log, self.cwd = prefix, log, cwd
        self.process, self.reader, self.reported = None, None, False

    @property
    def pid(self):
        return self.process.pid

    def poll(self):
        return self.process.poll() if self.process else None

    def alive(self):
        return self.process is not None and self.process.poll() is None

    def last_line(self):
        """The last non-empty line of the child's log ('' without one)."""
        try:
            with open(self.log, errors="replace") as f:
                lines = [line.strip() for line in f if line.strip()]
        except (OSError, TypeError):
            return ""
        return lines[-1] if lines else ""


def child_environment(additions):
    """This process's environment with `additions` (None unsets a variable), the chosen malloc
    preloaded, and this process named as the parent to die with. A bad TFMULTI_MALLOC raises
    allocator.AllocatorError, a UsageError: one line."""
    env = dict(os.environ)
    for name, value in additions.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = str(value)
    env = allocator.child_environment(env)
    env[child.PARENT_VARIABLE] = str(os.getpid())
    # Output is read line by line as it comes: a worker's last line before it hangs is seen.
    env["PYTHONUNBUFFERED"] = "1"
    return env


class Once:
    """The tfmulti lines already shown from any child: several workers that stop for the same
    reason each say the same line, which is shown once (the supervisor names each child that
    failed)."""

    MARK = "tfmulti: "

    def __init__(self):
        self.shown, self.lock = set(), threading.Lock()

    def first(self, line):
        if not line.startswith(self.MARK):
            return True
        with self.lock:
            if line in self.shown:
                return False
            self.shown.add(line)
            return True


def _stream(prefix, stream, once):
    for line in stream:
        if once.first(line):
            print(f"{prefix}{line}", end="", flush=True)


class Supervisor:
    """Starts and watches children; a context manager that, while open, turns SIGTERM and
    SIGINT into requests to stop (`signals`) and, on leaving, kills any child still there.

    say: where the supervisor's own lines go (None: nowhere); noun: what a child is called
    in them ("worker": "stopping 2 workers")."""

    def __init__(self, say=None, noun="process", poll=POLL_SECONDS):
        self.say, self.noun, self.poll_seconds = say or (lambda line: None), noun, poll
        self.children, self.signals, self._previous = [], [], {}
        self.once = Once()

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():  # only it may set handlers
            self._previous = {s: signal.signal(s, self._on_signal)
                              for s in (signal.SIGTERM, signal.SIGINT)}
        return self

    def __exit__(self, *exc):
        self.kill()
        deadline = time.monotonic() + READER_SECONDS
        for c in self.children:
            if c.reader is not None:
                c.reader.join(timeout=max(0.0, deadline - time.monotonic()))
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def _on_signal(self, signum, frame):
        self.signals.append(signum)

    def _plural(self, count):
        return f"{count} {self.noun}{'s' if count != 1 else ''}"

    # ----------------------------------------------------------------- starting

    def start(self, name, command, env=None, *, prefix=None, log=None, cwd=None):
        """Starts `command` as the child `name`: env is what it adds to this process's
        environment; its output goes to stdout line by line after `prefix`, or is appended
        to the file `log`, or (neither) to this process's own output. A tfmulti line that
        another child's stream showed already is not shown again."""
        c = Child(name, command, env, prefix, log, cwd)
        self.restart(c)
        self.children.append(c)
        return c

    def restart(self, c):
        """Starts child `c` (again): the same command, environment and output."""
        options = dict(env=child_environment(c.env), cwd=c.cwd, start_new_session=True)
        if c.log is not None:
            with os.fdopen(storage.own_file(c.log, os.O_WRONLY | os.O_APPEND), "a") as log:
                c.process = subprocess.Popen(c.command, stdout=log, stderr=subprocess.STDOUT,
                                             **options)
        elif c.prefix is not None:
            c.process = subprocess.Popen(c.command, stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT, text=True, errors="replace",
                                         **options)
            c.reader = threading.Thread(target=_stream,
                                        args=(c.prefix, c.process.stdout, self.once),
                                        daemon=True)
            c.reader.start()
        else:
            c.process = subprocess.Popen(c.command, **options)
        c.reported = False

    # ----------------------------------------------------------------- watching

    def live(self):
        return [c for c in self.children if c.alive()]

    def ended(self):
        """The children that ended since the last call, each with its exit code (negative:
        the signal that killed it), in the order they were started; every child is polled."""
        done = []
        for c in self.children:
            code = c.poll()
            if code is not None and not c.reported:
                c.reported = True
                done.append((c, code))
        return done

    def watch(self, grace, timeout=None):
        """Waits for every child to end, stopping them all on the first failure (after
        `grace` s) or a signal to this process (they get `grace` s to stop after SIGTERM), or
        once `timeout` s have passed. Returns (the first failed child or None, the signal
        that stopped them or None, whether the time ran out)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        failed, failed_at = None, None
        while True:
            if self.signals:
                signum = self.signals[0]
                self.stop(grace, f"{signal.Signals(signum).name} received")
                return failed, signum, False
            for c, code in self.ended():
                if code != 0 and failed is None:
                    failed, failed_at = c, time.monotonic()
                    self.say(f"{c.name} exited with code {shell_code(code)}; the others get "
                             f"{grace:g} s to stop")
                elif code != 0:  # its line may be the one shown already (Once)
                    self.say(f"{c.name} exited with code {shell_code(code)}")
            if not self.live():
                return failed, None, False
            if failed is not None and time.monotonic() - failed_at > grace:
                self.stop(min(grace, KILL_AFTER_SECONDS),
                          f"still running {grace:g} s after {failed.name} failed")
                return failed, None, False
            if deadline is not None and time.monotonic() > deadline:
                self.stop(min(grace, KILL_AFTER_SECONDS), f"still running after {timeout:g} s")
                return failed, None, True
            time.sleep(self.poll_seconds)

    # ----------------------------------------------------------------- stopping

    def stop(self, bound, why, children=None):
        """SIGTERM to every live child, then SIGKILL to those still there after `bound` s (a
        worker still forming its group ignores SIGTERM: TensorFlow holds it then), or at
        once when another SIGTERM or SIGINT arrives meanwhile."""
        live = [c for c in (self.children if children is None else children) if c.alive()]
        if live:
            self.say(f"{why}: stopping {self._plural(len(live))} (SIGTERM, SIGKILL after "
                     f"{bound:g} s)")
        for c in live:
            _send(c, signal.SIGTERM)
        signals_before = len(self.signals)
        waits.until(lambda: not any(c.alive() for c in live)
                    or len(self.signals) > signals_before, bound)
        if len(self.signals) > signals_before and any(c.alive() for c in live):
            self.say(f"interrupted again: killing the {self.noun}s")
        self.kill(live)

    def kill(self, children=None):
        """SIGKILL to every live child's process group (its own session: what it started
        without a die-with-parent of its own goes too), each then reaped within a bound."""
        live = [c for c in (self.children if children is None else children) if c.alive()]
        for c in live:
            try:
                os.killpg(c.pid, signal.SIGKILL)  # still unreaped: the group is still its own
            except OSError:
                _send(c, signal.SIGKILL)
        deadline = time.monotonic() + REAP_SECONDS
        for c in live:
            try:
                c.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.say(f"{c.name} (pid {c.pid}) did not end {REAP_SECONDS:g} s after SIGKILL")


def _send(c, signum):
    try:
        c.process.send_signal(signum)
    except OSError:  # ended meanwhile
        pass
