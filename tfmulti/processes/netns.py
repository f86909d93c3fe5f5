"""A network of their own for the workers one machine starts: nobody else can reach them.

TensorFlow's gRPC server binds 0.0.0.0:PORT whatever host the cluster names
(grpc_server_lib.cc builds "0.0.0.0:" + port, and no setting changes it), and it runs what
any caller asks, as the user who started it. So a worker of a cluster of `localhost:PORT`s
would serve everyone who can reach the machine, and every local user. The launcher therefore
starts a holder process that makes a new user and network namespace (Linux
unshare(CLONE_NEWUSER | CLONE_NEWNET); no root needed where user namespaces are on): a
network with only its own loopback. Each worker joins it first thing (setns, before it loads
TensorFlow: the kernel moves only a single-threaded process), named by the environment
(VARIABLE). The workers reach each other on localhost; from outside the namespace nothing
reaches their ports, neither another address of the machine nor another process of the
machine (another user's included).

The user id is mapped to itself, so files keep their owner and the workers run unprivileged,
as before. The price: the workers have no other network either (no gs:// model_dir, no
tensorflow-datasets download): `--network=host` keeps the machine's, with the servers open;
the launcher takes it only when asked (launcher.worker_network).
"""
from __future__ import annotations

import ctypes
import fcntl
import os
import select
import socket
import struct
import subprocess
import sys
import threading
from typing import TYPE_CHECKING, Any

from tfmulti.processes import child

if TYPE_CHECKING:
    from collections.abc import Mapping

VARIABLE = "TFMULTI_NETWORK_OF"  # the holder's pid, for the workers that join its network
JOINED = False  # whether this process joined a launcher's network (join_from_environment)
HOLDER_SECONDS = 30.0  # longest wait for the holder to say its network is ready
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
SIOCGIFFLAGS, SIOCSIFFLAGS = 0x8913, 0x8914
IFF_UP = 0x1


def enter_private_network():
    """Moves this process into a network of its own (its children follow); '' when it did,
    else why not, in a few words (user namespaces off, a container's seccomp, threads)."""
    if _threads() > 1:  # the kernel refuses a multithreaded process (EINVAL)
        return "this process already runs threads"
    uid, gid = os.getuid(), os.getgid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) != 0:
        return f"unshare: {os.strerror(ctypes.get_errno())}"
    try:
        _write("/proc/self/setgroups", "deny")  # required before an unprivileged gid_map
        _write("/proc/self/uid_map", f"{uid} {uid} 1")
        _write("/proc/self/gid_map", f"{gid} {gid} 1")
        loopback_up()
    except OSError as e:
        return f"setting up its loopback: {e.strerror or e}"
    return ""


def hold(count):
    """The holder process's work: makes the network, picks `count` free ports in it, prints
    'ready P0,P1,...' (or 'refused <why>'), then lives until its parent (the launcher) ends."""
    child.die_with_parent(os.getppid())
    why = enter_private_network()
    if why:
        print(f"refused {why}", flush=True)
        return
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    print("ready " + ",".join(str(s.getsockname()[1]) for s in sockets), flush=True)
    for s in sockets:
        s.close()
    sys.stdin.read()  # until the launcher closes it or dies


class Holder:
    """A running holder of a private network: its ports, the environment that makes a
    worker join it; close() ends it (the workers that joined keep the network alive)."""

    def __init__(self, count, timeout=HOLDER_SECONDS, program=None):
        program = program or f"from tfmulti.processes import netns; netns.hold({count})"
        self.process = subprocess.Popen([sys.executable, "-c", program],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        line = self.process.stdout.readline().strip() if ready else ""
        self.why, self.ports = "", []
        if line.startswith("ready "):
            self.ports = [int(p) for p in line.split()[1].split(",")]
        else:
            self.why = (line.removeprefix("refused ") if line else
                        f"the holder process did not answer in {timeout:g} s")
            self.close()

    @property
    def env(self):
        return {VARIABLE: str(self.process.pid)} if self.ports else {}

    def close(self):
        """Ends the holder: its stdin closed, then killed if it has not ended in 5 s."""
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)


def join_from_environment() -> None:
    """Joins the network VARIABLE names (a worker started by the launcher), first thing:
    before anything starts a thread. Raises OSError saying why it cannot."""
    global JOINED
    holder = os.environ.pop(VARIABLE, None)
    if not holder:
        return
    if _threads() > 1:
        raise OSError("this process already runs threads")
    libc = ctypes.CDLL(None, use_errno=True)
    for kind, flag in (("user", CLONE_NEWUSER), ("net", CLONE_NEWNET)):
        fd = os.open(f"/proc/{holder}/ns/{kind}", os.O_RDONLY)
        try:
            if libc.setns(fd, flag) != 0:
                raise OSError(f"setns {kind}: {os.strerror(ctypes.get_errno())}")
        finally:
            os.close(fd)
    JOINED = True


def _threads():
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def _write(path, text):
    with open(path, "w") as f:
        f.write(text)


def loopback_up():
    """Brings `lo` up (a new network namespace starts with it down)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        request = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s, SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))


def machine_addresses():
    """The machine's IPv4 addresses other than loopback, from /proc/net/fib_trie ([] if
    none): where another machine would reach a server that listens on every interface."""
    try:
        with open("/proc/net/fib_trie") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    found = []
    for previous, line in zip(lines, lines[1:]):
        if "/32 host LOCAL" in line:
            address = previous.split()[-1]
            if not address.startswith("127.") and address not in found:
                found.append(address)
    return found


def listening_line(cluster: Mapping[str, Any]) -> str:
    """Where this worker's server will listen, and what that means: TensorFlow binds every
    interface whatever host the cluster names (see above), unless this process is in the
    launcher's network of its own (JOINED). cluster: workers.cluster_config's dict."""
    task = cluster["task"]
    mine = cluster["cluster"][task["type"]][task["index"]]
    port = mine.rsplit(":", 1)[1]
    if JOINED:
        return (f"this worker's server ({mine}) listens in the launcher's network of its own "
                "(--network=private): only the other workers reach it")
    where = ", ".join([f"{a}:{port}" for a in ["127.0.0.1", *machine_addresses()]])
    hosts = [h.rsplit(":", 1)[0] for job in cluster["cluster"].values() for h in job]
    keep = ("on one machine, python -m tfmulti.launch (--program=doctor for the doctor) gives "
            "the workers a network of their own" if all(
                h in ("localhost", "127.0.0.1") for h in hosts) else
            "keep the workers on the job's own network (docs/faults-and-workers.md)")
    return (f"this worker's server ({mine}) will listen on every interface, 0.0.0.0:{port} "
            f"({where}), whatever host the cluster names, and runs code for whoever reaches "
            f"it: {keep}")
