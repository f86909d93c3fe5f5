"""XLA for each replica's forward and backward pass (--jit_compile).

Keras 3 turns XLA off under tf.distribute (its `_resolve_auto_jit_compile`); tfmulti compiles
the part of a step that is each replica's own: the model's forward pass, the loss and the
gradients (replicastep.ReplicaStep.forward_backward). The all-reduce and the optimizer's
update stay outside XLA, in the strategy's replica function, under every strategy. Before the
first step, the step is lowered to XLA on every replica (no step runs): a model with an op
XLA cannot compile trains without XLA and says so in one line, naming the op. What fails
later, in the backend's compile at the first step, falls back the same way (XlaFellBack):
nothing of that step is kept, and the input is made again from the step the run was at.

Synchronized batch norm all-reduces inside the forward pass. TensorFlow compiles that
all-reduce into XLA's own (MirroredStrategy's `_use_merge_call` is false in an XLA context
when every replica is a GPU; the collective is compiled over NCCL). On CPUs it keeps
`merge_call`, which a compiled function cannot hold: refused, in one line, before the first
step.
"""
from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import re
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from tfmulti import caches, tfprivate
from tfmulti.distribution import storage
from tfmulti.errors import UserError, first_line
from tfmulti.models import usermodel
from tfmulti.run import usercode

if TYPE_CHECKING:
    from tfmulti.data.dataset import DataSet
    from tfmulti.run.config import RunConfig

_UNSUPPORTED = re.compile(r"on XLA_\w+: (.+?) \(No registered")
_NODE = re.compile(r"\{\{node ([^}]+)\}\}")
# what TensorFlow's runtime error says around its cause: the head, where the graph's node
# was defined (a stack), how many errors
_AROUND = re.compile(r"Graph execution error|Detected at node|File \"|<stack traces|Stack trace"
                     r"|\d+ root error\(s\) found|\[\[")
_CODE = re.compile(r"^\(\d+\) [A-Z][A-Z_]+: +")  # "(0) UNIMPLEMENTED: " before a cause


def reason(error: BaseException, first_step: bool = False) -> str:
    """Why XLA could not compile the step, in one line: the ops it has no kernel for (and the
    first one's node), or the line of the error that says what went wrong; first_step: the
    error is the first step's (the backend's compile), not the lowering's."""
    text = str(error)
    if "merge_call" in text:  # an all-reduce inside the model (synchronized batch norm)
        return ("the model all-reduces inside its forward pass (synchronized batch norm), "
                "which TensorFlow compiles with XLA only when every replica is a GPU")
    ops = _UNSUPPORTED.search(text)
    if ops:
        node = _NODE.search(text)
        return (f"XLA has no kernel for {ops.group(1)}"
                + (f" (the op {node.group(1)})" if node else ""))
    if first_step:  # a runtime error: its cause is under a head and a stack
        cause = runtime_cause(text) or first_line(error) or type(error).__name__
        return f"XLA failed to compile the first step: {cause}"
    return first_line(error) or type(error).__name__


def runtime_cause(text: str) -> str:
    """The line of a TensorFlow runtime error that says what went wrong ('' if none): the
    first root error's ("(0) UNIMPLEMENTED: why"), else the first line that is neither the
    head nor the stack of where the node was defined (its lines indented)."""
    lines = text.splitlines()
    for line in lines:
        if _CODE.match(line.strip()):
            return _CODE.sub("", line.strip())
    for line in lines:
        if line.strip() and not line[0].isspace() and not _AROUND.match(line):
            return line.strip()
    return ""


def lowering_refusal(strategy, forward_backward, features, targets) -> str:
    """'' when XLA lowers `forward_backward` (a tf.function with jit_compile=True) for this
    per-replica batch on every replica; else why not (reason). Runs no step: the function is
    only traced and converted to XLA's HLO, in each replica's context (its variables are the
    replica's)."""
    def lower(f, t):
        forward_backward.experimental_get_compiler_ir(f, t)(stage="hlo")

    quiet = logging.getLogger("tensorflow")  # "Using MirroredStrategy eagerly ..."
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        strategy.run(lower, args=(features, targets))
    except Exception as e:  # noqa: BLE001 -- any failure to compile is the answer
        return reason(e)
    finally:
        quiet.setLevel(level)
    return ""


# ----------------------------------------------------------------------------- fallback
# XLA compiles at the first call (the lowering checked before it leaves the backend's
# compile); a failure there turns XLA off, and the run goes on without it.

COMPILED_PASS = "xla_pass"  # the name scope of the call of each replica's compiled pass
FELL_KEY = "tfmulti/xla_compile_failed/"  # + a worker's task: its compile failed
# A worker whose compile failed waits this long for the others' word: they started their
# compile with it, and the same model on the same devices compiles in about the same time
# (seconds here; minutes for a large model on a GPU)
FALLBACK_WAIT_S = 300.0
INPUT_ERROR = "transformation with iterator: Iterator::"  # tf.data's words for its own errors
# The buffers the variables held after a first call whose compile failed, never freed (some
# may be freed already: first_call_falls_back), at the process's exit either (one reference
# more than Python's); the model's variables, once per process.
FAILED_CALLS_BUFFERS: list = []
ctypes.pythonapi.Py_IncRef(ctypes.py_object(FAILED_CALLS_BUFFERS))


class XlaFellBack(Exception):
    """XLA could not compile the first training call (`reason`, one line); the engine now
    trains without it, at the step it was at. Its input must be made again from that step:
    the failed call took its batches."""

    def __init__(self, reason):
        super().__init__(reason)
        self.reason = reason


def compiled_pass_failed(error: BaseException) -> bool:
    """Whether a training call's error is its compiled pass's own (the node TensorFlow names
    is in COMPILED_PASS's scope), and not out of memory, another worker's, a wait that ran
    out or the input's (an error of tf.data's names its iterator; with several replicas
    TensorFlow may report it at a node of the compiled pass, which waited for the batch)."""
    import tensorflow as tf

    not_the_compile = (tf.errors.ResourceExhaustedError, tf.errors.UnavailableError,
                       tf.errors.DeadlineExceededError, tf.errors.CancelledError,
                       tf.errors.AbortedError)
    message = str(error)
    return (not isinstance(error, not_the_compile)
            and INPUT_ERROR not in message
            and re.search(rf"\b{COMPILED_PASS}/", message) is not None)


@contextlib.contextmanager
def first_call_falls_back(state: Callable[[], list], turn_off: Callable[[], None],
                          strategy: Any = None, worker_index: int = 0,
                          wait_s: float = FALLBACK_WAIT_S) -> Iterator[None]:
    """Around the first training call with XLA: its compiled pass failing turns XLA off
    (turn_off()) and raises XlaFellBack. Nothing of the call is kept: every variable a call
    changes (state(): [(variable, its value)], read before the call) is put back as it was
    (what ran beside the failed step changed some: the step count, the metrics and the
    optimizer's iterations); its batches were taken, so the caller makes its input again
    from the same step. Any other error (the input's, out of memory, another worker's) is
    raised as it is.

    With several workers (strategy: theirs, else None), they fall back together or not at
    all: one that did alone would never join the all-reduce the others wait in. A worker
    whose compile failed says so to the others (the coordination service's key-value store)
    and waits at most wait_s seconds for every other's word; without it, it reports the
    error to every worker (they stop) and raises one line."""
    import tensorflow as tf

    before = state()
    said = ""
    try:
        yield
    except tf.errors.OpError as e:
        if not compiled_pass_failed(e):
            raise
        said, code = reason(e, first_step=True), e.error_code
    if not said:
        return
    # outside the except: no traceback keeps the call's objects
    if strategy is not None:
        spec = strategy.cluster_resolver
        tfprivate.tell_workers(f"{FELL_KEY}{spec.task_type}_{spec.task_id}", said)
        tasks = [f"{FELL_KEY}{kind}_{i}" for kind, hosts
                 in sorted(spec.cluster_spec().as_dict().items()) for i in range(len(hosts))]
        if not tfprivate.heard_from_every_worker(tasks, wait_s):
            tfprivate.stop_every_worker(code, said)
            raise UserError(
                f"{said} (worker {worker_index}); not on every worker within {wait_s:g} s, "
                "and the workers fall back without XLA only together: run again with "
                "--jit_compile=off") from None
    turn_off()
    for part, value in before:
        # TensorFlow 2.21 can leave a variable of the failed call holding a buffer that is
        # freed already (seen on a synchronized batch norm's moving mean, in about 1 of 6
        # pairs of workers with glibc's malloc checks on): assigning to it would free it again and
        # corrupt the heap. What each variable holds now is kept (FAILED_CALLS_BUFFERS).
        FAILED_CALLS_BUFFERS.append(part.value())
        part.assign(value)
    del before
    raise XlaFellBack(said) from None


class Fallback:
    """The engine's first training call with XLA, around which first_call_falls_back runs:
    `state()` every variable a call may change (put back if the compile fails), `turn_off()`
    XLA off for the next traced step; with several workers (multi_worker) they agree through
    the strategy's coordination service, this one `worker_index`, each waiting at most
    wait_s for the others' word."""

    def __init__(self, strategy: Any, state: Callable[[], list], turn_off: Callable[[], None],
                 multi_worker: bool, worker_index: int):
        self.strategy, self.state, self.turn_off = strategy, state, turn_off
        self.multi_worker, self.worker_index = multi_worker, worker_index
        self.wait_s = FALLBACK_WAIT_S

    @contextlib.contextmanager
    def around(self, first: bool) -> Iterator[None]:
        """Around a training call: the first with XLA (first) falls back if its compile
        fails; any other runs as it is."""
        if not first:
            yield
            return
        with first_call_falls_back(self._local_values, self.turn_off,
                                   self.strategy if self.multi_worker else None,
                                   self.worker_index, self.wait_s):
            yield

    def _local_values(self) -> list:
        """(variable, value) of every variable a training call may change, as this process
        holds them: each local replica's copy (reading a metric's whole value would be a
        collective, which another worker still in its step would take for that step's)."""
        import keras

        parts = [part for v in self.state()
                 for part in self.strategy.experimental_local_results(
                     v.value if isinstance(v, keras.Variable) else v)]
        return [(part, part.numpy()) for part in parts]


def first_batch(dataset: DataSet | None, per_replica: int, seed: int = 0) -> tuple:
    """(features, targets) of a first per-replica batch of `dataset` (a DataSet) as the
    training pipeline makes it, or of 28x28 synthetic images when it is None (the doctor's
    and `bench`'s measurement)."""
    import numpy as np
    import tensorflow as tf

    from tfmulti.data import pipeline

    if dataset is None:
        features = np.zeros((per_replica, 28, 28), np.uint8)
        targets, images = np.zeros(per_replica, np.int32), True
    else:
        features, targets = dataset.train_features, dataset.train_targets
        images = dataset.images
    return next(iter(pipeline.train_input_fn(features, targets, per_replica, seed,
                                             images=images)(tf.distribute.InputContext())))


def refusal_on_first_batch(refusal: Callable[..., str], dataset: DataSet | None,
                           per_replica: int, seed: int = 0) -> str:
    """refusal (an engine's xla_refusal) for first_batch(dataset, per_replica, seed)."""
    return refusal(*first_batch(dataset, per_replica, seed))


# ----------------------------------------------------------------------------- auto
# The doctor (--jit_compile=auto) times one replica's step with XLA and without and keeps the
# verdict here, per user and machine; a run with --jit_compile=auto reads it.

def verdicts_path() -> str:
    return os.path.join(caches.home(), "xla.json")


def verdict_key(cfg: RunConfig, per_replica: int, device: str) -> str:
    """What the verdict holds for: the model (your code's file hash too), its width and
    hyperparameters, the dtype, the per-replica batch, the device's kind and name and
    TensorFlow's version."""
    import tensorflow as tf

    code = usercode.provenance(cfg.model)["sha256"] if usermodel.is_spec(cfg.model) else ""
    return "|".join(str(part) for part in (
        cfg.model, code, cfg.width, cfg.model_hparams, cfg.dtype, per_replica,
        device_name(device), tf.__version__))


def device_name(device: str) -> str:
    """'GPU: <its name>' or 'CPU: <the processor's model name> x <usable cores>'."""
    import tensorflow as tf

    if "GPU" in device.upper():
        gpus = tf.config.list_physical_devices("GPU")
        details = tf.config.experimental.get_device_details(gpus[0]) if gpus else {}
        return f"GPU: {details.get('device_name', 'unknown')}"
    name = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f
                         if line.startswith("model name")), name)
    except OSError:
        pass
    return f"CPU: {name} x {len(os.sched_getaffinity(0))}"


LOCK_WAIT_S = 10.0  # a writer holds the lock for one small JSON file's read and write


def record_verdict(key: str, measured: dict, wait_s: float = LOCK_WAIT_S) -> bool:
    """Keeps the doctor's measurement (advise.measure_xla) under `key`; several doctors at
    once each add theirs (the file is read and rewritten under a lock, replaced whole).
    False, nothing written, when the lock stayed taken wait_s seconds."""
    path = verdicts_path()
    if not caches.own_folder(os.path.dirname(path)):  # a cache others may write: not kept
        return False
    with os.fdopen(storage.own_file(path + ".lock", os.O_WRONLY | os.O_APPEND), "a") as lock:
        if not storage.try_lock(lock, wait_s):
            return False
        verdicts = _read(path)
        verdicts[key] = {k: measured[k] for k in ("ratio", "refused", "step_s", "step_s_xla")}
        with storage.replacing(path, "w", caches.FILE_MODE) as f:
            json.dump(verdicts, f, indent=1)
    return True


def _read(path):
    if not (caches.own_folder(os.path.dirname(path)) and caches.trusted_file(path)):
        return {}  # none yet, or not yours alone: measured again
    try:
        with open(path) as f:
            verdicts = json.load(f)
    except (OSError, ValueError):  # none yet, or spoiled: measured again
        return {}
    return verdicts if isinstance(verdicts, dict) else {}


def turns_on(verdict: dict) -> bool:
    """Whether a verdict ({"ratio", "refused"}: advise.measure_xla's) turns XLA on under
    --jit_compile=auto: XLA compiled the step and it was faster."""
    return not verdict.get("refused") and (verdict.get("ratio") or 0) > 1


def auto(key: str) -> tuple[bool, str]:
    """(compile, what the run says) for --jit_compile=auto: on where the doctor measured one
    replica's step faster with XLA on these devices; off, said, where it measured it slower
    or refused; off, said, where it did not measure."""
    verdict = _read(verdicts_path()).get(key)
    if verdict is None:
        return False, ("XLA: off (--jit_compile=auto: not measured for this model, batch and "
                       "dtype on these devices; python -m tfmulti.doctor --jit_compile=auto "
                       "with the same flags measures it)")
    if verdict.get("refused"):
        return False, f"XLA: off (--jit_compile=auto: {verdict['refused']})"
    ratio = verdict["ratio"]
    if turns_on(verdict):
        return True, (f"XLA: on (--jit_compile=auto: the doctor measured one replica's step "
                      f"{ratio:.2f}x as fast with it on these devices)")
    return False, (f"XLA: off (--jit_compile=auto: the doctor measured one replica's step "
                   f"{ratio:.2f}x as fast with it on these devices)")
