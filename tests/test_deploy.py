"""deploy/k8s/: the Kubernetes manifests, read as Kubernetes and Kubeflow's operator would.
No Kubernetes cluster runs here: these tests check that each pod's command is one tfmulti
accepts, that the cluster each pod derives (the TF_CONFIG the operator injects, or the
Indexed Job's names) is the one the manifest declares, and that every pod's exit is bounded:
a bounded wait for the others (--worker_timeout), a grace for the SIGTERM save, a restart
policy that resumes exit 75 and a limit on restarts. The mechanisms themselves run in real
processes elsewhere: a worker that never comes (test_multiworker), a worker killed with
kill -9 (make soak), SIGTERM to one worker (make soak, make cluster-test)."""
import json
import os

import pytest
import yaml
from test_docs import accepted

from tfmulti.distribution import workers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
K8S = os.path.join(ROOT, "deploy", "k8s")


def documents(name):
    with open(os.path.join(K8S, name)) as f:
        return {doc["kind"]: doc for doc in yaml.safe_load_all(f)}


def flags(container):
    """The container's tfmulti flags as name -> value (its command must be the main job)."""
    assert container["command"] == ["python3", "-m", "tfmulti.main"]  # the image's python
    parsed = dict(arg[2:].split("=", 1) for arg in container["args"])
    unknown = set(parsed) - accepted("main")
    assert not unknown, unknown
    return parsed


def check_bounded(pod_spec, restart_policy, backoff_limit, parsed):
    assert restart_policy == "OnFailure"  # exit 75 after a SIGTERM save: restarted, resumed
    assert 0 < backoff_limit <= 10  # a pod that keeps failing is not restarted for ever
    assert pod_spec["terminationGracePeriodSeconds"] >= 60  # the checkpoint's save
    assert 0 < float(parsed["worker_timeout"]) <= 3600  # the wait for the other workers


def test_the_tfjob_gives_each_worker_the_tf_config_tfmulti_reads():
    job = documents("tfjob.yaml")["TFJob"]
    assert job["apiVersion"] == "kubeflow.org/v1"
    spec = job["spec"]["tfReplicaSpecs"]["Worker"]
    pod = spec["template"]["spec"]
    container = pod["containers"][0]
    assert container["name"] == "tensorflow"  # the name the operator looks for
    parsed = flags(container)
    check_bounded(pod, spec["restartPolicy"], job["spec"]["runPolicy"]["backoffLimit"], parsed)
    assert "worker_hosts" not in parsed and "task_index" not in parsed  # TF_CONFIG says it
    port = container["ports"][0]["containerPort"]
    assert container["ports"][0]["name"] == "tfjob-port" and port == 2222  # the operator's
    name, count = job["metadata"]["name"], spec["replicas"]
    # What the operator injects into worker i: every replica's service, this task, the cloud.
    hosts = [f"{name}-worker-{i}.default.svc:{port}" for i in range(count)]
    for index in range(count):
        tf_config = json.dumps({"cluster": {"worker": hosts}, "environment": "cloud",
                                "task": {"type": "worker", "index": index}})
        config = workers.cluster_config(None, 0, tf_config=tf_config)
        assert config["cluster"]["worker"] == hosts and config["task"]["index"] == index
        assert workers.is_chief(config) == (index == 0)  # worker 0 writes the report
    mount = container["volumeMounts"][0]["mountPath"]
    assert parsed["model_dir"].startswith(mount + "/")  # a folder every pod sees


def test_the_indexed_job_names_each_pod_as_its_workers_list_does():
    docs = documents("indexed-job.yaml")
    service, job = docs["Service"], docs["Job"]
    spec = job["spec"]
    pod = spec["template"]["spec"]
    container = pod["containers"][0]
    parsed = flags(container)
    check_bounded(pod, pod["restartPolicy"], spec["backoffLimit"], parsed)
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"]  # every worker at once
    # The headless Service gives pod i the name <job>-<i>.<service>, on the workers' port.
    assert (service["spec"]["clusterIP"] == "None"
            and pod["subdomain"] == service["metadata"]["name"])
    assert service["spec"]["selector"] == {"job-name": job["metadata"]["name"]}
    port = container["ports"][0]["containerPort"]
    assert service["spec"]["ports"][0]["port"] == port
    expected = [f"{job['metadata']['name']}-{i}.{pod['subdomain']}:{port}"
                for i in range(spec["completions"])]
    assert parsed["worker_hosts"].split(",") == expected
    # --task_index is the pod's completion index, through a declared variable ($(X) expands).
    variable = parsed["task_index"]
    assert variable.startswith("$(") and variable.endswith(")")
    declared = {e["name"]: e for e in container["env"]}[variable[2:-1]]
    assert declared["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.annotations['batch.kubernetes.io/job-completion-index']")
    for index in range(spec["completions"]):
        config = workers.cluster_config(parsed["worker_hosts"], index)
        assert config["cluster"]["worker"] == expected and config["task"]["index"] == index
        assert workers.is_chief(config) == (index == 0)


@pytest.mark.parametrize("name", ["tfjob.yaml", "indexed-job.yaml"])
def test_each_manifest_asks_for_what_the_docs_say(name):
    """A GPU per worker, the runs claim mounted: the parts people edit, as the docs show."""
    for doc in documents(name).values():
        if doc["kind"] in ("TFJob", "Job"):
            specs = (doc["spec"]["tfReplicaSpecs"].values() if doc["kind"] == "TFJob"
                     else [doc["spec"]])
            for spec in specs:
                pod = spec["template"]["spec"]
                limits = pod["containers"][0]["resources"]["limits"]
                assert limits["nvidia.com/gpu"] == int(flags(pod["containers"][0])["num_gpus"])
                assert pod["volumes"][0]["persistentVolumeClaim"]["claimName"] == "tfmulti-runs"


@pytest.mark.parametrize("name, label", [
    ("tfjob.yaml", "training.kubeflow.org/job-name"), ("indexed-job.yaml", "job-name")])
def test_only_the_jobs_own_pods_reach_its_workers(name, label):
    """The NetworkPolicy beside each job selects the job's pods by the label Kubernetes (the
    Job controller) or the operator gives them, and lets in only those pods, only on the
    workers' gRPC port."""
    docs = documents(name)
    policy = docs["NetworkPolicy"]["spec"]
    job = docs.get("TFJob") or docs["Job"]
    selected = {label: job["metadata"]["name"]}
    assert policy["podSelector"] == {"matchLabels": selected}
    assert policy["policyTypes"] == ["Ingress"]
    [rule] = policy["ingress"]
    assert rule["from"] == [{"podSelector": {"matchLabels": selected}}]
    specs = (job["spec"]["tfReplicaSpecs"].values() if "tfReplicaSpecs" in job["spec"]
             else [job["spec"]])
    ports = {p["containerPort"] for spec in specs for c in spec["template"]["spec"]["containers"]
             for p in c.get("ports", [])} or {docs["Service"]["spec"]["ports"][0]["port"]}
    assert [p["port"] for p in rule["ports"]] == sorted(ports)


def test_the_docs_pod_with_your_own_model_takes_the_main_jobs_flags_and_finds_your_files():
    """docs/kubernetes.md's container for your own model: flags the main job accepts (your
    model and data function among them, a valid run), PYTHONPATH where the project is
    mounted, every mount a volume of the pod."""
    import re

    from tfmulti.run.config import RunConfig

    with open(os.path.join(ROOT, "docs", "kubernetes.md")) as f:
        [block] = re.findall(r"```yaml\n(.*?)```", f.read(), re.S)
    pod = yaml.safe_load(block)
    [container] = pod["containers"]
    parsed = flags(container)
    cfg = RunConfig(**{k: (int(v) if k in ("num_gpus", "global_batch_size") else
                           float(v) if k == "worker_timeout" else v) for k, v in parsed.items()})
    assert cfg.model == "my_models:price_regression" and cfg.dataset == "my_data:houses"
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert {v["name"] for v in pod["volumes"]} == set(mounts)
    path = {e["name"]: e["value"] for e in container["env"]}["PYTHONPATH"]
    project = next(v for v in pod["volumes"] if "configMap" in v)["name"]
    assert mounts[project] == path
    assert cfg.model_dir.startswith(mounts["runs"] + "/")
