import os

import pytest

from tfmulti.distribution import devices, gpulibs
from tfmulti.distribution.devices import DevicePlan
from tfmulti.errors import UsageError


@pytest.mark.parametrize("num_gpus, cpu_replicas, available, plan", [
    (None, 0, 0, DevicePlan("cpu", 1)),  # the default on a machine without GPUs
    (None, 0, 4, DevicePlan("gpu", 4)),
    (-1, 0, 2, DevicePlan("gpu", 2)),
    (2, 0, 4, DevicePlan("gpu", 2)),
    (0, 0, 4, DevicePlan("cpu", 1)),
    (None, 3, 4, DevicePlan("cpu", 3)),
    (0, 2, 0, DevicePlan("cpu", 2)),
])
def test_plans(num_gpus, cpu_replicas, available, plan):
    assert devices.plan_devices(num_gpus, cpu_replicas, available) == plan


def test_too_many_gpus_names_both_counts_and_the_way_out():
    with pytest.raises(UsageError) as e:
        devices.plan_devices(2, 0, 1, why_none="ignored: a GPU was found")
    assert str(e.value) == ("--num_gpus=2 asks for 2 GPUs but TensorFlow sees 1; use "
                            "--cpu_replicas=2 to run 2 replicas on the CPU")


def test_no_gpu_quotes_what_cuda_said():
    with pytest.raises(UsageError, match=r"sees 0 \(TensorFlow: failed call to cuInit\)"):
        devices.plan_devices(1, 0, 0, why_none="failed call to cuInit")


@pytest.mark.parametrize("num_gpus, cpu_replicas, words", [
    (-2, 0, "--num_gpus=-2"),
    (-1, 0, "asks for all GPUs but TensorFlow sees none"),
    (None, -1, "--cpu_replicas=-1"),
    (2, 2, "not both"),
])
def test_refused(num_gpus, cpu_replicas, words):
    with pytest.raises(UsageError, match=words):
        devices.plan_devices(num_gpus, cpu_replicas, 0)


def test_thread_pools_share_the_cores():
    assert devices.cpu_thread_pools(2, cores=2) == (1, 2)
    assert devices.cpu_thread_pools(4, cores=16) == (4, 4)
    assert devices.cpu_thread_pools(4, cores=2) == (1, 4)
    assert devices.cpu_thread_pools(1, cores=2) == (0, 0)


def test_strategies(one_replica, two_replicas):
    assert one_replica.num_replicas_in_sync == 1
    assert devices.replica_names(one_replica) == ["CPU:0"]
    assert two_replicas.num_replicas_in_sync == 2
    assert devices.replica_names(two_replicas) == ["CPU:0", "CPU:1"]


def test_more_cpu_replicas_than_configured():
    with pytest.raises(UsageError, match="8 CPU replicas asked for but only 4"):
        devices.make_strategy(DevicePlan("cpu", 8))


# ----------------------------------------------------------------------------- GPU choice

@pytest.mark.parametrize("gpus, num_gpus, growth, plan, chosen", [
    (["0", "2"], None, False, DevicePlan("gpu", 2, (0, 2)), (0, 2)),
    (["3"], 1, True, DevicePlan("gpu", 1, (3,), True), (3,)),
    (None, 2, False, DevicePlan("gpu", 2), (0, 1)),  # the first --num_gpus
    (None, None, True, DevicePlan("gpu", 4, (), True), (0, 1, 2, 3)),
    (None, 0, True, DevicePlan("cpu", 1), ()),  # memory growth means nothing on the CPU
])
def test_the_plan_names_the_gpus_this_process_may_see(gpus, num_gpus, growth, plan, chosen):
    """Every GPU plan says which GPUs the process shows TensorFlow (configure then hides the
    others before the runtime starts): before, a --num_gpus=1 job started all of them."""
    got = devices.plan_devices(num_gpus, 0, 4, gpus=gpus, memory_growth=growth)
    assert got == plan and got.chosen_gpus == chosen
    if chosen:  # TensorFlow numbers the GPUs it is shown from 0
        assert got.devices == [f"/GPU:{i}" for i in range(len(chosen))]


@pytest.mark.parametrize("plan, shown, growth", [
    (DevicePlan("gpu", 2, (1, 3), True), ["gpu1", "gpu3"], ["gpu1", "gpu3"]),
    (DevicePlan("gpu", 1), ["gpu0"], []),
])
def test_configure_shows_tensorflow_the_plans_gpus_only(plan, shown, growth):
    """What configure hands tf.config for a GPU plan (recorded here: no GPU on this machine
    to hand it to): only the plan's GPUs visible, memory growth on exactly those."""
    import types
    calls = []
    config = types.SimpleNamespace(
        set_visible_devices=lambda devices, kind: calls.append(("visible", list(devices), kind)),
        experimental=types.SimpleNamespace(
            set_memory_growth=lambda device, on: calls.append(("growth", device, on))))
    devices.show_only_gpus(plan, ["gpu0", "gpu1", "gpu2", "gpu3"], config)
    assert calls == [("visible", shown, "GPU")] + [("growth", g, True) for g in growth]


@pytest.mark.parametrize("gpus, num_gpus, cpu_replicas, words", [
    (["0", "4"], None, 0, "--gpus=0,4: no GPU 4, TensorFlow sees 4 (numbered from 0)"),
    (["1", "1"], None, 0, "--gpus=1,1: give each GPU once"),
    (["x"], None, 0, "--gpus=x: give GPU numbers"),
    (["-1"], None, 0, "--gpus=-1: give each GPU once, numbered from 0"),
    (["0", "1"], 1, 0, "--gpus=0,1 names 2 GPUs but --num_gpus=1; leave --num_gpus out"),
    (["0"], None, 2, "--gpus=0 and --cpu_replicas=2: choose GPUs or CPU replicas"),
])
def test_gpus_refused(gpus, num_gpus, cpu_replicas, words):
    with pytest.raises(UsageError) as e:
        devices.plan_devices(num_gpus, cpu_replicas, 4, gpus=gpus)
    assert str(e.value).startswith(words)


def test_no_gpu_for_gpus_quotes_what_cuda_said():
    with pytest.raises(UsageError, match=r"no GPU 0, TensorFlow sees 0 \(numbered from 0\) "
                                         r"\(TensorFlow: cuInit failed\)"):
        devices.plan_devices(None, 0, 0, why_none="cuInit failed", gpus=["0"])


def test_children_of_the_tests_see_no_gpu():
    """On a GPU host the suite's child processes (main jobs, workers, trials, the doctor) must
    run on the CPU as the tests expect: each inherits CUDA_VISIBLE_DEVICES="" (before, only
    the pytest process hid its GPUs, with tf.config)."""
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}  # as tests do
    out = subprocess.run([sys.executable, "-c", "import os; print(repr(os.environ.get("
                          "'CUDA_VISIBLE_DEVICES')))"], env=env, capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == "''"


# ----------------------------------------------------------------------------- GPU libraries

CUDA_BUILD = {"is_cuda_build": True, "cuda_version": "12.5.1", "cudnn_version": "9"}
LIBRARIES = ["libcudart.so.12", "libcublas.so.12", "libcublasLt.so.12", "libcufft.so.11",
             "libcusparse.so.12", "libcusolver.so.11", "libcudnn.so.9"]


def test_no_driver_is_named_with_the_loaders_words():
    """A machine without an NVIDIA driver (faked: a loader that cannot open libcuda.so.1) is
    named in the loader's own words; on this machine, whatever it has, the line is what its
    own loader says of libcuda.so.1."""
    said = "libcuda.so.1: cannot open shared object file: No such file or directory"

    def no_driver(name):
        raise OSError(said if name == "libcuda.so.1" else f"unexpected load of {name}")

    assert gpulibs.gpu_libraries_problem(CUDA_BUILD, load=no_driver) == f"no NVIDIA driver: {said}"
    assert gpulibs.gpu_libraries_problem({"is_cuda_build": False}, load=no_driver) is None
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError as e:  # no driver here: the same words as the loader's
        assert gpulibs.gpu_libraries_problem(CUDA_BUILD) == f"no NVIDIA driver: {e}"
    else:  # a driver: the line, if any, is about the CUDA libraries, not the driver
        assert not (gpulibs.gpu_libraries_problem(CUDA_BUILD) or "").startswith("no NVIDIA")


def stand_in_libraries(folder, names):
    """Real shared objects under the names CUDA's have, so that dlopen loads them: this
    Python's own _ctypes extension, present wherever the tests run."""
    import _ctypes
    real = os.path.realpath(_ctypes.__file__)
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        os.symlink(real, folder / name)
    return str(folder)


def problems_in_child(cases, library_path):
    """gpu_libraries_problem(tf_site, site_dirs) for each case, in a process whose loader
    path is library_path (dlopen reads LD_LIBRARY_PATH at start-up only)."""
    import json
    import subprocess
    import sys
    code = ("import json, sys; from tfmulti.distribution import gpulibs; "
            "build = json.loads(sys.argv[1]); "
            "print(json.dumps([gpulibs.gpu_libraries_problem(build, tf_site, site_dirs) "
            "for tf_site, site_dirs in json.loads(sys.argv[2])]))")
    env = dict(os.environ, LD_LIBRARY_PATH=":".join(library_path))
    out = subprocess.run([sys.executable, "-c", code, json.dumps(CUDA_BUILD), json.dumps(cases)],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_cuda_libraries_not_found_name_the_first_and_the_fix(tmp_path):
    driver = stand_in_libraries(tmp_path / "driver", ["libcuda.so.1"])
    tf_site, other = tmp_path / "venv-site", tmp_path / "user-site"
    tf_site.mkdir()
    for name in LIBRARIES:  # the wheels, installed into another site directory
        stand_in_libraries(other / "nvidia" / name.split(".")[0][3:] / "lib", [name])
    nowhere, apart, beside = problems_in_child(
        [(str(tf_site), []), (str(tf_site), [str(other)]), (str(other), [])], [driver])
    assert nowhere == ("TensorFlow cannot load libcudart.so.12: cannot open shared object "
                       "file: No such file or directory (and 6 more); install TensorFlow's "
                       "CUDA wheels: pip install 'tfmulti[gpu]'")
    folders = sorted(str(p) for p in other.glob("nvidia/*/lib"))
    assert apart.endswith("the CUDA wheels are installed apart from TensorFlow: export "
                          "LD_LIBRARY_PATH=" + ":".join(folders))
    assert beside is None  # TensorFlow finds the wheels next to itself (its RUNPATH)
    assert problems_in_child([(str(tf_site), [str(other)])], [driver, *folders]) == [None]


def test_one_startup_gives_every_tool_its_devices_cluster_role_and_share():
    """startup.from_config: the plan and cluster the flags ask for, checked, nothing started;
    the role and share follow the cluster, a tuning session (one_run=False) has none."""
    import dataclasses
    import json

    from tfmulti.distribution import startup
    from tfmulti.distribution.startup import Role
    from tfmulti.run.config import RunConfig

    alone = startup.from_config(RunConfig(cpu_replicas=2, deterministic=True, seed=7,
                                          intra_op_threads=3), environ={})
    assert (alone.plan, alone.cluster, alone.role, alone.place) == (
        DevicePlan("cpu", 2), None, Role.ALONE, (0, 1))
    assert (alone.threads, alone.seed) == ((3, 0), 7)
    assert startup.from_config(RunConfig(), environ={}).seed is None  # not deterministic
    hosts = RunConfig(worker_hosts="localhost:1,localhost:2", task_index=1, worker_timeout=9)
    second = startup.from_config(hosts, environ={})
    assert (second.role, second.place, second.worker_timeout) == (Role.WORKER, (1, 2), 9)
    assert startup.from_config(dataclasses.replace(hosts, task_index=0),
                               environ={}).role is Role.CHIEF
    assert startup.from_config(hosts, environ={}, one_run=False).role is Role.ALONE
    tf_config = {"cluster": {"chief": ["c:1"], "worker": ["w:1"]},
                 "task": {"type": "chief", "index": 0}}
    chief = startup.from_config(RunConfig(), environ={"TF_CONFIG": json.dumps(tf_config)})
    assert (chief.role, chief.place) == (Role.CHIEF, (0, 2))
    assert [r.leads for r in Role] == [True, True, False]
    with pytest.raises(UsageError, match="each CPU worker is one replica"):
        startup.from_config(dataclasses.replace(hosts, cpu_replicas=2), environ={})
