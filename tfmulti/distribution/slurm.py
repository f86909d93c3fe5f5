"""`srun python -m tfmulti.main ...`: the cluster of a Slurm job step, read from the variables
Slurm gives each task.

Every task of the step is one worker of MultiWorkerMirroredStrategy. Slurm says which task
this is (SLURM_PROCID), on which nodes the step runs (SLURM_STEP_NODELIST) and how many tasks
each node holds (SLURM_STEP_TASKS_PER_NODE); tasks are numbered node by node (srun's default
block distribution), the first task is the chief. The node names are expanded with
TensorFlow's own SlurmClusterResolver functions. That resolver itself is not used: it runs
nvidia-smi (FileNotFoundError on a node without it), divides by the GPU count (0 on a CPU
node, and CUDA_VISIBLE_DEVICES="" counts as one), and starts every node's ports at 8888, so
two jobs on one node, or two logical nodes on one host, collide. Here each task keeps the GPUs
Slurm gave it (CUDA_VISIBLE_DEVICES, as --gpus-per-task sets it), and the ports come from the
job and step ids, so concurrent steps on one node differ (jobs fewer than the range's slots
apart always; a port found taken is one line, workers.check_own_port).

The ports lie in PORTS_VARIABLE's range ("LOW-HIGH"; a site sets it for every job, in a
TaskProlog or the users' environment), by default DEFAULT_PORTS, below Linux's ephemeral
ports (32768-60999 unless the node was set otherwise: `ephemeral_overlap` says so), which
the kernel hands to outgoing connections and could give away first.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tfmulti import tfprivate
from tfmulti.errors import UsageError

if TYPE_CHECKING:
    from collections.abc import Mapping

PORTS_VARIABLE = "TFMULTI_SLURM_PORTS"
DEFAULT_PORTS = (20000, 32767)  # below Linux's default ephemeral ports
PORT_STRIDE = 64  # tasks of one step on one host that get ports of their own
STEP_SPACING = 97  # slots between a job's consecutive steps
PORT_BASE = DEFAULT_PORTS[0]
EPHEMERAL = "/proc/sys/net/ipv4/ip_local_port_range"


def in_step(environ: Mapping[str, str]) -> bool:
    """Whether this process is a task of an srun step (not the batch script itself)."""
    return "SLURM_STEP_ID" in environ and "SLURM_PROCID" in environ


def cluster(environ: Mapping[str, str]) -> dict[str, Any] | None:
    """This task's TF_CONFIG as a dict for a step of several tasks; None outside Slurm or
    for a step of one task. UsageError in one line for a set-up that cannot work."""
    if not in_step(environ):
        tasks = _int(environ, "SLURM_NTASKS", 1)
        if "SLURM_JOB_ID" in environ and tasks > 1:
            raise UsageError(f"this is Slurm job {environ['SLURM_JOB_ID']} of {tasks} tasks, "
                             "but not a task of a job step: start the command with srun "
                             "(srun python -m tfmulti.main ...), or it trains alone")
        return None
    rank = _int(environ, "SLURM_PROCID")
    try:
        nodes, per_node = tfprivate.slurm_hosts(environ["SLURM_STEP_NODELIST"],
                                                environ["SLURM_STEP_TASKS_PER_NODE"])
    except (KeyError, ValueError) as e:
        raise UsageError(f"Slurm's step variables cannot be read ({e})") from None
    if len(nodes) != len(per_node):
        raise UsageError(f"Slurm's step lists {len(nodes)} nodes but tasks for "
                         f"{len(per_node)} (SLURM_STEP_TASKS_PER_NODE)")
    hosts = [node for node, count in zip(nodes, per_node) for _ in range(count)]
    if len(hosts) < 2:
        return None
    if not 0 <= rank < len(hosts):
        raise UsageError(f"SLURM_PROCID={rank} is not one of the step's {len(hosts)} tasks")
    own = environ.get("SLURMD_NODENAME")
    if own and own != hosts[rank]:
        raise UsageError(f"task {rank} runs on {own}, not on {hosts[rank]} where srun's block "
                         "distribution puts it: give srun --distribution=block")
    base = step_base(environ, port_range(environ))
    local = [i - hosts.index(h) for i, h in enumerate(hosts)]  # the index within its node
    if max(local) >= PORT_STRIDE:
        raise UsageError(f"{max(local) + 1} tasks on one node; tfmulti gives at most "
                         f"{PORT_STRIDE} tasks of a step on one node ports of their own")
    workers = [f"{h}:{base + (i if len(hosts) <= PORT_STRIDE else local[i])}"
               for i, h in enumerate(hosts)]
    return {"cluster": {"worker": workers}, "task": {"type": "worker", "index": rank}}


def port_range(environ):
    """(low, high) of the ports Slurm steps use: PORTS_VARIABLE's, else DEFAULT_PORTS."""
    text = environ.get(PORTS_VARIABLE, "").strip()
    if not text:
        return DEFAULT_PORTS
    low, _, high = text.partition("-")
    if not (low.strip().isdigit() and high.strip().isdigit()):
        raise UsageError(f"{PORTS_VARIABLE}={text!r}: give the ports as LOW-HIGH, for example "
                         "20000-32767")
    low, high = int(low), int(high)
    if not 1024 <= low <= high <= 65535 or high - low + 1 < PORT_STRIDE:
        raise UsageError(f"{PORTS_VARIABLE}={text!r}: give at least {PORT_STRIDE} ports "
                         "between 1024 and 65535, LOW-HIGH")
    return low, high


def step_base(environ, ports):
    """The first port of this job step's slot of PORT_STRIDE ports in `ports` (low, high):
    slot (job id + STEP_SPACING x step id) modulo the range's slots, the same in every task.
    Jobs that run together on a node have near ids: any `slots` consecutive jobs' first steps
    get slots of their own (a hash would not: jobs 3 and 4 met on the test cluster)."""
    low, high = ports
    slots = (high - low + 1) // PORT_STRIDE
    slot = (_int(environ, "SLURM_JOB_ID") + STEP_SPACING * _int(environ, "SLURM_STEP_ID"))
    return low + slot % slots * PORT_STRIDE


def ephemeral_overlap(environ: Mapping[str, str], path: str = EPHEMERAL) -> str:
    """A line when the step's port range overlaps this node's ephemeral ports (outgoing
    connections may take one first), else ''."""
    try:
        with open(path) as f:
            first, last = (int(v) for v in f.read().split())
    except (OSError, ValueError):
        return ""
    low, high = port_range(environ)
    if high < first or low > last:
        return ""
    return (f"the Slurm ports {low}-{high} overlap this node's ephemeral ports {first}-{last} "
            "(the kernel may give one to an outgoing connection first): set "
            f"{PORTS_VARIABLE}=LOW-HIGH outside them for every job (docs/slurm.md)")


def describe(cluster: Mapping[str, Any], environ: Mapping[str, str]) -> str:
    """One line on the cluster derived from Slurm, for the doctor and the chief."""
    workers = cluster["cluster"]["worker"]
    nodes = len({w.rsplit(":", 1)[0] for w in workers})
    return (f"Slurm job {environ.get('SLURM_JOB_ID')} step {environ.get('SLURM_STEP_ID')}: "
            f"{len(workers)} tasks on {nodes} node{'s' if nodes > 1 else ''}, this is task "
            f"{cluster['task']['index']} ({', '.join(workers)})")


def _int(environ, name, default=None):
    value = environ.get(name)
    if value is None and default is not None:
        return default
    try:
        return int(value)
    except (TypeError, ValueError):
        raise UsageError(f"{name}={value!r} is not a number (is this a Slurm task?)") from None
