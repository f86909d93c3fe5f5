"""srun: the cluster of a Slurm step read from the variables Slurm sets (the real srun runs in
`make cluster-test`, testing/cluster.py; here the variables as Slurm 22.05 sets them)."""
import os

import pytest

from tfmulti.distribution import devices, slurm, workers
from tfmulti.errors import UsageError


def step(procid, nodelist="n1", per_node="2", job=42, step_id=0, node=None):
    """The variables srun gives task `procid` (its node: where block distribution puts it)."""
    return {"SLURM_JOB_ID": str(job), "SLURM_STEP_ID": str(step_id), "SLURM_PROCID": str(procid),
            "SLURM_STEP_NODELIST": nodelist, "SLURM_STEP_TASKS_PER_NODE": per_node,
            "SLURM_NTASKS": "x", **({"SLURMD_NODENAME": node} if node else {})}


def test_two_tasks_on_one_node_are_two_workers_with_ports_of_their_own():
    first, second = (slurm.cluster(step(i, node="n1")) for i in (0, 1))
    assert first["cluster"] == second["cluster"]
    hosts = first["cluster"]["worker"]
    assert [h.split(":")[0] for h in hosts] == ["n1", "n1"]
    ports = [int(h.split(":")[1]) for h in hosts]
    assert ports[1] == ports[0] + 1 and ports[0] >= slurm.PORT_BASE
    assert (first["task"], second["task"]) == ({"type": "worker", "index": 0},
                                               {"type": "worker", "index": 1})
    assert workers.is_chief(first) and not workers.is_chief(second)


def test_four_tasks_on_two_nodes_in_block_order():
    config = slurm.cluster(step(2, nodelist="n[1-2]", per_node="2(x2)", node="n2"))
    assert [h.split(":")[0] for h in config["cluster"]["worker"]] == ["n1", "n1", "n2", "n2"]
    assert config["task"]["index"] == 2
    uneven = slurm.cluster(step(0, nodelist="a7,b[08-09]", per_node="3,1(x2)"))
    assert [h.split(":")[0] for h in uneven["cluster"]["worker"]] == [
        "a7", "a7", "a7", "b08", "b09"]


def test_two_jobs_or_steps_on_one_node_get_other_ports():
    ports = {tuple(slurm.cluster(step(0, job=j, step_id=s))["cluster"]["worker"])
             for j, s in ((42, 0), (43, 0), (42, 1))}
    assert len(ports) == 3


@pytest.mark.parametrize("environ, words", [
    ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4"}, "Slurm job 7 of 4 tasks, but not a task of a "
                                                 "job step: start the command with srun"),
    (step(1, nodelist="n[1-2]", per_node="1(x2)", node="n1"), "task 1 runs on n1, not on n2 "
                                                               "where srun's block distribution"),
    (step(3), "SLURM_PROCID=3 is not one of the step's 2 tasks"),
    (step(0, per_node="2(x2)"), "lists 1 nodes but tasks for 2"),
    ({**step(0), "SLURM_JOB_ID": "abc"}, "SLURM_JOB_ID='abc' is not a number"),
])
def test_a_step_that_cannot_work_is_one_line(environ, words):
    with pytest.raises(UsageError, match=words.replace("(", "\\(")):
        slurm.cluster(environ)


def test_one_task_or_no_slurm_is_one_machine():
    assert slurm.cluster(step(0, per_node="1")) is None
    assert slurm.cluster({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1"}) is None
    assert slurm.cluster({}) is None


def test_a_port_held_by_another_process_is_one_line():
    """gRPC would share a taken port (SO_REUSEPORT); the worker refuses it instead."""
    import socket

    with socket.socket() as holder:
        holder.bind(("", 0))
        holder.listen()
        port = holder.getsockname()[1]
        config = {"cluster": {"worker": ["n1:1", f"localhost:{port}"]},
                  "task": {"type": "worker", "index": 1}}
        with pytest.raises(UsageError, match=f"port {port} of this worker \\(localhost:{port}\\) "
                                             "is taken by another process"):
            workers.check_own_port(config)
    workers.check_own_port(config)  # free again


@pytest.mark.parametrize("task, chief", [({"type": "chief", "index": 0}, True),
                                         ({"type": "worker", "index": 0}, False),
                                         ({"type": "worker", "index": 1}, False)])
def test_the_tf_config_kubeflows_operator_injects_is_read_as_it_is(task, chief):
    """Kubeflow's TFJob with a Chief replica: TF_CONFIG names a chief beside the workers (and
    "environment": "cloud"); the chief writes the report, worker 0 is then not the chief."""
    import json

    injected = {"cluster": {"chief": ["tfjob-chief-0.ns.svc:2222"],
                            "worker": ["tfjob-worker-0.ns.svc:2222", "tfjob-worker-1.ns.svc:2222"]},
                "task": task, "environment": "cloud"}
    config = workers.cluster_config(tf_config=json.dumps(injected), environ={})
    assert config == injected and workers.is_chief(config) == chief
    without_chief = {"cluster": {"worker": injected["cluster"]["worker"]},
                     "task": {"type": "worker", "index": 0}}
    assert workers.is_chief(workers.cluster_config(tf_config=json.dumps(without_chief)))


def test_past_64_tasks_a_host_numbers_its_tasks_by_their_local_index():
    """Up to PORT_STRIDE (64) tasks, task i's port is base + i; past it, base + its index on
    its node, so no two tasks of one node share a port (70 tasks on 2 nodes of 35)."""
    config = slurm.cluster(step(0, nodelist="a[1-2]", per_node="35(x2)"))
    hosts = config["cluster"]["worker"]
    assert len(hosts) == 70 > slurm.PORT_STRIDE
    for node in ("a1", "a2"):
        ports = [int(h.split(":")[1]) for h in hosts if h.startswith(node + ":")]
        assert len(set(ports)) == 35 and max(ports) - min(ports) == 34
    small = slurm.cluster(step(0, nodelist="a[1-2]", per_node="32(x2)"))["cluster"]["worker"]
    assert len({h.split(":")[1] for h in small}) == 64  # at 64, every task its own port


@pytest.mark.parametrize("visible", ["", "3", "0,1", None])
def test_each_task_keeps_the_gpus_slurm_gave_it(monkeypatch, visible):
    """--gpus-per-task gives each task its GPUs in CUDA_VISIBLE_DEVICES. No GPU here: what can
    be shown on a CPU is the mechanism. The cluster is read the same whatever the variable
    says (TensorFlow's resolver divides by its GPU count: "" counted as one GPU failed with 2
    tasks on a node, and without nvidia-smi it raised), nothing runs nvidia-smi, the variable
    is left as Slurm set it, and the devices tfmulti plans on are its ids."""
    import shutil

    environ = step(1, node="n1")
    monkeypatch.setattr(shutil, "which", lambda *a, **k: None)  # no nvidia-smi on the node
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    config = workers.cluster_config()
    assert config == slurm.cluster(step(1, node="n1"))  # as without the variable
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == visible
    assert devices.visible_gpus() == ([g for g in visible.split(",") if g] or None
                                      if visible is not None else None)


def test_ports_lie_below_the_ephemeral_range_and_a_site_chooses_them(tmp_path):
    """By default 20000-32767 (below Linux's ephemeral 32768-60999), in 199 slots: any 199
    consecutive jobs (those that run together on a node) get ports of their own, and so do a
    job's first steps; jobs 1000 and 1600 (one slot under the old arithmetic) differ.
    TFMULTI_SLURM_PORTS sets the range."""
    def ports(environ):
        return [int(h.split(":")[1]) for h in slurm.cluster(environ)["cluster"]["worker"]]

    jobs = [tuple(ports(step(0, job=j))) for j in range(1000, 1199)]
    assert len(set(jobs)) == 199
    assert all(slurm.DEFAULT_PORTS[0] <= p <= slurm.DEFAULT_PORTS[1] for t in jobs for p in t)
    assert len({tuple(ports(step(0, job=1000, step_id=s))) for s in range(4)}) == 4
    assert ports(step(0, job=1000)) != ports(step(0, job=1600))
    assert ports(step(0, job=3)) != ports(step(0, job=4))  # met under a hash on the test cluster
    site = {**step(1, job=1000), slurm.PORTS_VARIABLE: "40000-40127"}
    assert all(40000 <= p <= 40127 for p in ports(site))
    assert slurm.cluster(site)["cluster"] == slurm.cluster({**site, "SLURM_PROCID": "0"})["cluster"]
    for bad in ("40000", "x-y", "40000-40010", "80-200", "60000-70000", "5-4"):
        with pytest.raises(UsageError, match=f"{slurm.PORTS_VARIABLE}='{bad}'"):
            slurm.cluster({**site, slurm.PORTS_VARIABLE: bad})
    ranges = tmp_path / "ip_local_port_range"
    ranges.write_text("32768\t60999\n")
    assert slurm.ephemeral_overlap(step(0), str(ranges)) == ""
    assert "overlap this node's ephemeral ports 32768-60999" in slurm.ephemeral_overlap(
        {slurm.PORTS_VARIABLE: "30000-40000"}, str(ranges))
    ranges.write_text("15000\t60999\n")  # a node set otherwise: the default range overlaps
    assert "20000-32767 overlap" in slurm.ephemeral_overlap({}, str(ranges))


def test_more_tasks_on_one_node_than_ports_of_their_own_is_one_line():
    with pytest.raises(UsageError, match="65 tasks on one node; tfmulti gives at most 64"):
        slurm.cluster(step(0, nodelist="n[1-2]", per_node="65(x2)", node="n1"))
