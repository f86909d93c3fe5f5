"""The session's secret: the tuning chief serves only callers that present it.

keras-tuner's chief serves its oracle over gRPC without authentication (add_insecure_port):
whoever reaches the port could create, end and score trials, and forged scores would reach
best.cfg. The chief makes a random secret in the session's folder (FILE, readable by the
user alone; by the folder's group too when the folder has its set-group-id bit, the usual
way to share a folder with a group), and the tuning workers read it from the same folder
(the machine's, or the shared file system srun's tasks see). The secret never crosses the
network: each call carries a signature of its own (signed()), a keyed hash (HMAC-SHA256) of
the method, the time and a random nonce, which the chief checks (accepts()): a call whose
signature is missing, wrong, older than WINDOW_S or seen before is refused
(UNAUTHENTICATED). Whoever reads the traffic (Slurm's nodes' network) learns no token and can
replay no call. (Whoever can alter the traffic in flight could change a signed call's
content: that needs TLS.)
"""
import collections
import hashlib
import hmac
import os
import secrets
import stat
import threading
import time
from concurrent import futures

from tfmulti import quiet, waits
from tfmulti.errors import UsageError

FILE = ".tfmulti-secret"
VARIABLE = "TFMULTI_SESSION_SECRET"  # the path of the session's secret file
KEY = "tfmulti-secret"  # gRPC metadata keys are lower case
WINDOW_S = 300.0  # how far a call's time may be from the chief's (clocks of several nodes)


def signed(token, method, now=None, nonce=None):
    """The signature a call of `method` carries: 'TIME:NONCE:HMAC' (the secret itself never
    sent)."""
    now = int(time.time() if now is None else now)
    nonce = nonce or secrets.token_hex(16)
    mac = hmac.new(token.encode(), f"{method}|{now}|{nonce}".encode(), hashlib.sha256)
    return f"{now}:{nonce}:{mac.hexdigest()}"


class Signatures:
    """The chief's check of the calls' signatures: each valid once, within WINDOW_S."""

    def __init__(self, token, window_s=WINDOW_S):
        self.token, self.window_s = token, window_s
        self.seen, self.lock = {}, threading.Lock()

    def accepts(self, given, method, now=None):
        now = time.time() if now is None else now
        try:
            when, nonce, _ = given.split(":")
            when = int(when)
        except ValueError:
            return False
        if abs(now - when) > self.window_s or not hmac.compare_digest(
                given, signed(self.token, method, when, nonce)):
            return False
        with self.lock:
            self.seen = {n: t for n, t in self.seen.items() if now - t <= self.window_s}
            if nonce in self.seen:  # a replay of a call seen on the wire
                return False
            self.seen[nonce] = when
        return True


def make(folder):
    """The path of the session's secret in `folder`, made if it is not there yet; one that
    is there (a session resumed) is used only if it is the user's own (check_own)."""
    path = os.path.join(folder, FILE)
    info = os.stat(folder)
    shared = info.st_mode & stat.S_ISGID
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
                     0o640 if shared else 0o600)
    except FileExistsError:
        check_own(path, info.st_gid if shared else None)
        return path
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    return path


def check_own(path, group=None):
    """Refuses (UsageError, one line) a secret anyone but the user could have made or read:
    a link, a file another user owns (or, in a set-group-id folder, one outside its group
    `group`), or one others may read or the group may write. A planted secret would give
    whoever planted it a token the chief accepts."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # a FIFO: no wait
    except OSError as e:
        raise UsageError(f"the session's secret {path} cannot be read as a file of its own "
                         f"({e.strerror}); remove it and run again for a new one") from None
    try:
        info = os.fstat(fd)
    finally:
        os.close(fd)
    mine = info.st_uid == os.geteuid() or (group is not None and info.st_gid == group)
    loose = info.st_mode & (0o027 if group is not None else 0o077)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1 or not mine or loose:
        raise UsageError(
            f"the session's secret {path} is not yours alone (owner uid {info.st_uid}, mode "
            f"{stat.S_IMODE(info.st_mode):04o}, {info.st_nlink} name(s)): someone else could "
            "know its token and call the session's chief; remove it and run again for a new "
            "one")


def read(path):
    with open(path) as f:
        return f.read().strip()


def _read_when_there(path, seconds):
    """The secret at `path`, waiting up to `seconds` for the chief to write it (srun's tasks
    start together); '' if it never comes (the chief then refuses the call)."""
    def there():
        try:
            return read(path)
        except FileNotFoundError:
            return ""

    return waits.until(there, seconds, poll_s=0.5)


def _grpc():
    import grpc

    return grpc


def server(path, max_workers=1):
    """A gRPC server that runs only the calls carrying the secret at `path`. It binds without
    SO_REUSEPORT (gRPC's default would share a port another process holds: two sessions'
    calls mixed), so a taken port fails to bind (listen)."""
    grpc = _grpc()
    signatures = Signatures(read(path))

    class Check(grpc.ServerInterceptor):
        def intercept_service(self, continuation, details):
            given = dict(details.invocation_metadata).get(KEY, "")
            if signatures.accepts(given, details.method):
                return continuation(details)
            return grpc.unary_unary_rpc_method_handler(_refuse)

    return grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers),
                       interceptors=[Check()], options=[("grpc.so_reuseport", 0)])


def listen(server, address):
    """Binds `server` to `address` ("host:0": a free port, chosen as it binds) and returns
    the port; a port another process took since it was chosen is one UsageError line."""
    with quiet.captured_stderr():  # gRPC logs its own error line
        try:
            return server.add_insecure_port(address)
        except RuntimeError:
            pass
    raise UsageError(f"the tuning chief cannot listen on {address}: another process took the "
                     "port (another session or job on that machine); run the command again")


def _refuse(request, context):
    context.abort(_grpc().StatusCode.UNAUTHENTICATED,
                  "this tuning session's secret is missing or wrong")


def channel(address, path, through=None):
    """A channel to `address` (or the channel `through`) whose calls carry a signature made
    with the secret read from `path` (read at the first call: a worker may be made before its
    chief has written it)."""
    grpc = _grpc()

    class Details(collections.namedtuple("Details", (
            "method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")),
            grpc.ClientCallDetails):
        pass

    token = []

    class Present(grpc.UnaryUnaryClientInterceptor):
        def intercept_unary_unary(self, continuation, details, request):
            if not token:
                token.append(_read_when_there(path, details.timeout or 600))
            metadata = list(details.metadata or []) + [(KEY, signed(token[0], details.method))]
            return continuation(Details(details.method, details.timeout, metadata,
                                        details.credentials, details.wait_for_ready,
                                        details.compression), request)

    return grpc.intercept_channel(through or grpc.insecure_channel(address), Present())
