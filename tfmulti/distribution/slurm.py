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
job and step ids, so concurrent steps on one node differ.
"""
from tfmulti.errors import UsageError

PORT_BASE = 20000
PORT_SLOTS = 600  # steps that may share a node before two could meet (by job and step id)
PORT_STRIDE = 64  # tasks of one step on one host that get ports of their own


def in_step(environ):
    """Whether this process is a task of an srun step (not the batch script itself)."""
    return "SLURM_STEP_ID" in environ and "SLURM_PROCID" in environ


def cluster(environ, port_base=PORT_BASE):
    """This task's TF_CONFIG as a dict for a step of several tasks; None outside Slurm or
    for a step of one task. UsageError in one line for a set-up that cannot work."""
    if not in_step(environ):
        tasks = _int(environ, "SLURM_NTASKS", 1)
        if "SLURM_JOB_ID" in environ and tasks > 1:
            raise UsageError(f"this is Slurm job {environ['SLURM_JOB_ID']} of {tasks} tasks, "
                             "but not a task of a job step: start the command with srun "
                             "(srun python -m tfmulti.main ...), or it trains alone")
        return None
    from tensorflow.python.distribute.cluster_resolver.slurm_cluster_resolver import (
        expand_hostlist, expand_tasks_per_node)

    rank = _int(environ, "SLURM_PROCID")
    try:
        nodes = expand_hostlist(environ["SLURM_STEP_NODELIST"])
        per_node = expand_tasks_per_node(environ["SLURM_STEP_TASKS_PER_NODE"])
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
    base = port_base + (_int(environ, "SLURM_JOB_ID") * 31 + _int(environ, "SLURM_STEP_ID")
                        ) % PORT_SLOTS * PORT_STRIDE
    local = [i - hosts.index(h) for i, h in enumerate(hosts)]  # the index within its node
    workers = [f"{h}:{base + (i if len(hosts) <= PORT_STRIDE else local[i])}"
               for i, h in enumerate(hosts)]
    return {"cluster": {"worker": workers}, "task": {"type": "worker", "index": rank}}


def describe(config, environ):
    """One line on the cluster derived from Slurm, for the doctor and the chief."""
    workers = config["cluster"]["worker"]
    nodes = len({w.rsplit(":", 1)[0] for w in workers})
    return (f"Slurm job {environ.get('SLURM_JOB_ID')} step {environ.get('SLURM_STEP_ID')}: "
            f"{len(workers)} tasks on {nodes} node{'s' if nodes > 1 else ''}, this is task "
            f"{config['task']['index']} ({', '.join(workers)})")


def _int(environ, name, default=None):
    value = environ.get(name)
    if value is None and default is not None:
        return default
    try:
        return int(value)
    except (TypeError, ValueError):
        raise UsageError(f"{name}={value!r} is not a number (is this a Slurm task?)") from None
