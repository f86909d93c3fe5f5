"""Every test runs on the CPU with 4 logical devices (2-replica strategies use the first two).

The logical devices must exist before TensorFlow starts its runtime, so they are configured
once, in pytest_configure, before the test modules are collected (not in pytest-xdist's
controller, which runs no test).

On a GPU host the tests' child processes (the main job, the doctor, workers, trials) must not
see the GPUs either: they expect the CPU. `tf.config.set_visible_devices` below hides them
from this process only, so CUDA_VISIBLE_DEVICES="" goes into the environment every child
inherits (tests build their children's environment from os.environ).
"""
import atexit
import itertools
import os
import shutil
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["CUDA_VISIBLE_DEVICES"] = ""
# tfmulti's caches (decoded examples, record indexes, XLA verdicts) of the tests' own files
# go to a folder of this session's, never to the user's ~/.cache (children inherit it)
_CACHE = tempfile.mkdtemp(prefix="tfmulti-tests-cache-")
os.environ["XDG_CACHE_HOME"] = _CACHE
atexit.register(shutil.rmtree, _CACHE, True)

import pytest  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from tfmulti import quiet  # noqa: E402
from tfmulti.distribution import devices  # noqa: E402

LOGICAL_CPUS = 4
tf = None  # TensorFlow, started by pytest_configure in each process that runs tests


def pytest_configure(config):
    config.addinivalue_line("markers", "soak: too slow for `make test`; "
                            "`make soak` runs these tests as one of its checks")
    config.addinivalue_line("markers", "isolated: `make soak` runs each such test in a "
                            "pytest process of its own (a crash there is that test's alone)")
    if not xdist_controller(config):
        start_tensorflow()


def xdist_controller(config) -> bool:
    """Whether this process is pytest-xdist's controller (`-n 3`), which only hands the
    test files to its workers: it needs no TensorFlow (its start-up is seconds of CPU)."""
    return bool(config.getoption("numprocesses", None)) and not hasattr(config, "workerinput")


def start_tensorflow():
    """TensorFlow as the tools import it (its start-up lines held back), with the 4 logical
    CPUs, before its runtime starts (test modules import it after this, at collection)."""
    global tf
    quiet.import_tensorflow()
    import tensorflow

    tf = tensorflow
    tf.config.set_visible_devices([], "GPU")
    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0],
        [tf.config.LogicalDeviceConfiguration()] * LOGICAL_CPUS)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2 * LOGICAL_CPUS)


# The files whose tests take longest, first, by their share of the suite's seconds (the
# seconds_per_file of benchmarks/results/test_times*.json, both CPU kinds). With pytest-xdist
# (`-n 3 --dist loadfile --no-loadscope-reorder`) each worker takes the next file when it is
# done with one: long files last would leave one worker running alone at the end.
SLOWEST_FIRST = ("test_main.py", "test_yourtask.py", "test_resume.py", "test_xla.py",
                 "test_records.py", "test_config.py", "test_engine.py", "test_doctor.py",
                 "test_multiworker.py", "test_sessions.py", "test_usermodel.py", "test_tune.py",
                 "test_ownstep.py", "test_userdata.py", "test_keras_examples.py",
                 "test_launch.py", "test_scratch.py", "test_callbacks.py", "test_supervisor.py",
                 "test_checkpointed.py", "test_storage.py", "test_flops.py", "test_weights.py",
                 "test_asgiven.py", "test_dataservice.py", "test_report.py",
                 "test_validation.py", "test_timing.py", "test_compiled.py", "test_bench.py",
                 "test_batchsize.py", "test_layout.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's order kept


@pytest.fixture(scope="session")
def one_replica():
    return devices.make_strategy(devices.DevicePlan("cpu", 1))


@pytest.fixture(scope="session")
def two_replicas():
    return devices.make_strategy(devices.DevicePlan("cpu", 2))


@pytest.fixture(scope="session")
def four_replicas():
    """4 replicas beside the 2 above in one process: their all-reduces would share the group
    key 1 (each MirroredStrategy numbers its collective groups from 1, and a group's size is
    fixed at its first use), so this one numbers its groups from 100001, as TensorFlow's own
    tests make strategies side by side (distribute/strategy_combinations.py)."""
    mirrored = tf.distribute.MirroredStrategy
    base, mirrored._collective_key_base = mirrored._collective_key_base, 100000
    try:
        return devices.make_strategy(devices.DevicePlan("cpu", 4))
    finally:
        mirrored._collective_key_base = base


@pytest.fixture(scope="session")
def tiny_synthetic():
    from tfmulti.data import sources

    return sources.load("synthetic", synthetic_train_size=1024, synthetic_test_size=250, seed=0)


@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory):
    """The suite's one end-to-end run of the main job, shared by the tests that read it:
    flags/cpu_smoke.cfg (a width-8 ResNet-18, 2 epochs, 2 CPU replicas) as a real command,
    started as make run starts it (TCMalloc preloaded where it is installed). Returns
    (the finished process, its model_dir, the malloc it was given)."""
    import subprocess
    import sys

    from tfmulti.distribution import allocator

    model_dir = tmp_path_factory.mktemp("smoke") / "run"
    tcmalloc = allocator.find_tcmalloc()
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    env.update(allocator.preload_environment({}, tcmalloc) if tcmalloc else {})
    result = subprocess.run([sys.executable, "-m", "tfmulti.main", "--flagfile=flags/cpu_smoke.cfg",
                             f"--model_dir={model_dir}", "--show_replicas"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    return result, model_dir, "tcmalloc" if tcmalloc else "system"


def in_this_process(name, *args, strategy=None):
    """Runs `python -m tfmulti.<name> ARGS` in this process, as cli.main runs it; returns its
    exit code (sys.exit's argument: a string is the line the interpreter would print). Given
    `strategy` (one of the suite's), the start-up hands the command that strategy instead of
    configuring this process's devices again (set up once, above). What the tune tool changes
    in its process (keras-tuner's state writer, the session's secret) is undone after."""
    from tfmulti import cli
    from tfmulti.distribution import startup
    from tfmulti.run import flagdefs

    defaults = {flag: flagdefs.FLAGS[flag].default for flag in flagdefs.FLAGS}
    argv = [f"tfmulti.{name}", *args]
    saved, sys.argv = sys.argv, argv  # absl's --help lists the flags of sys.argv[0]
    try:
        with pytest.MonkeyPatch.context() as patched:
            if name == "tune":
                from keras_tuner.src import utils

                from tfmulti.tune import secret

                patched.setattr(utils, "save_json", utils.save_json)
                patched.delenv(secret.VARIABLE, raising=False)
            if strategy is not None:
                patched.setattr(startup.Startup, "start", started_on(strategy))
            cli.main(name, argv)
        return 0
    except SystemExit as e:
        return e.code or 0
    finally:
        sys.argv = saved
        flagdefs.FLAGS.unparse_flags()
        for flag, value in defaults.items():  # a tool's own defaults (scratch's base_lr)
            if flagdefs.FLAGS[flag].default != value:
                flagdefs.FLAGS.set_default(flag, value)


def started_on(strategy):
    """Startup.start for a command run in this process: `strategy`, with --seed's random
    numbers seeded as the real start-up seeds them (without TensorFlow's op determinism,
    which would then hold for the rest of this process's tests), so what the command draws
    does not depend on the tests before it."""
    def start(self):
        if self.seed is not None:
            import keras

            keras.utils.set_random_seed(self.seed)
        return strategy

    return start


@pytest.fixture
def tool(capsys):
    """tool(name, *args, strategy=None): in_this_process, and (exit code, stdout, stderr).
    For the refusals a command meets before it starts any device (bad flags, data,
    model_dir), or after, given `strategy`: the same code path as the real command, without a
    new process that imports TensorFlow (a few real-process checks keep the start-up
    honest)."""
    def run(name, *args, strategy=None):
        code = in_this_process(name, *args, strategy=strategy)
        out, err = capsys.readouterr()
        if isinstance(code, str):  # sys.exit("line"): the interpreter would print it
            code, err = 1, err + code + "\n"
        return code, out, err

    return run


_MODULE_NUMBERS = itertools.count()


@pytest.fixture
def importable(tmp_path, monkeypatch):
    """importable(prefix, text): writes text as a module of a fresh name in the working
    directory (tmp_path), as a user's module is found, and returns the name; forgotten at the
    end of the test."""
    names = []

    def write(prefix, text):
        name = f"{prefix}_{next(_MODULE_NUMBERS)}"
        (tmp_path / f"{name}.py").write_text(text)
        names.append(name)
        return name

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != ""])
    yield write
    for name in names:
        sys.modules.pop(name, None)


@pytest.fixture
def iterated(monkeypatch):
    """The autotuning option of each tf.data dataset iterated while the test runs (None:
    tf.data's default, on): freeing an iterator that autotunes can wait up to a minute
    (tfprivate.no_autotuning_on_devices)."""
    seen = []
    plain_iter, plain_numpy = tf.data.Dataset.__iter__, tf.data.Dataset.as_numpy_iterator

    def recorded_iter(self):
        seen.append(self.options().autotune.enabled)
        return plain_iter(self)

    def recorded_numpy(self):
        seen.append(self.options().autotune.enabled)
        return plain_numpy(self)

    monkeypatch.setattr(tf.data.Dataset, "__iter__", recorded_iter)
    monkeypatch.setattr(tf.data.Dataset, "as_numpy_iterator", recorded_numpy)
    return seen
