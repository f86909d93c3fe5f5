import pytest

from tfmulti import devices
from tfmulti.devices import DevicePlan
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
    assert devices.cpu_thread_pools(2, cores=2) == (1, 4)
    assert devices.cpu_thread_pools(4, cores=16) == (4, 8)
    assert devices.cpu_thread_pools(1, cores=2) == (0, 0)


def test_strategies(one_replica, two_replicas):
    assert one_replica.num_replicas_in_sync == 1
    assert devices.replica_names(one_replica) == ["CPU:0"]
    assert two_replicas.num_replicas_in_sync == 2
    assert devices.replica_names(two_replicas) == ["CPU:0", "CPU:1"]


def test_more_cpu_replicas_than_configured():
    with pytest.raises(UsageError, match="8 CPU replicas asked for but only 4"):
        devices.make_strategy(DevicePlan("cpu", 8))
