"""The malloc choice: TCMalloc preloaded where processes are created (never by a restart),
the system's on request, one line for a choice that cannot be honoured, and the doctor's
line on what a process has."""
import json
import os
import subprocess
import sys
import time

import pytest

from tfmulti.distribution import allocator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def fake_library(directory, name="libtcmalloc_minimal.so.4"):
    path = directory / name
    path.write_text("not a library")
    return str(path)


def test_the_setting_picks_tcmalloc_when_found_the_system_on_request_and_refuses_the_rest(
        tmp_path):
    empty = [str(tmp_path / "none")]
    found = fake_library(tmp_path)
    assert allocator.choose("auto", [str(tmp_path)]) == found
    assert allocator.choose(None, [str(tmp_path)]) == found  # unset: auto
    assert allocator.choose("tcmalloc", [str(tmp_path)]) == found
    assert allocator.choose("auto", empty) is None  # not installed: the system's, quietly
    assert allocator.choose("system", [str(tmp_path)]) is None
    assert allocator.choose(found) == found  # a path
    with pytest.raises(allocator.AllocatorError, match="tcmalloc: TCMalloc is not installed"):
        allocator.choose("tcmalloc", empty)
    with pytest.raises(allocator.AllocatorError, match="no such file"):
        allocator.choose(str(tmp_path / "missing.so"))
    with pytest.raises(allocator.AllocatorError, match="give auto, tcmalloc, system"):
        allocator.choose("fast")


def test_the_library_goes_first_in_ld_preload_and_what_was_there_stays():
    env = allocator.preload_environment({"LD_PRELOAD": "/a.so:/lib/t.so /b.so"}, "/lib/t.so")
    assert env["LD_PRELOAD"] == "/lib/t.so /a.so /b.so"
    assert allocator.preload_environment({}, "/lib/t.so")["LD_PRELOAD"] == "/lib/t.so"


def test_the_doctor_line_says_what_is_used_and_how_to_get_tcmalloc(tmp_path):
    fake_library(tmp_path)
    system, found, none = (lambda: "system"), [str(tmp_path)], [str(tmp_path / "none")]
    assert allocator.describe({}, found, lambda: "tcmalloc") == ("tcmalloc (preloaded)", "")
    assert allocator.describe({allocator.SETTING: "system"}, found, system, kept=False) == (
        "the system's (TFMULTI_MALLOC=system)", "")
    used, hint = allocator.describe({}, none, system, kept=False)
    assert used == "the system's" and "apt-get install libtcmalloc-minimal4" in hint
    used, hint = allocator.describe({}, found, system, kept=False)
    assert "installed but not loaded" in hint and f"LD_PRELOAD={found[0]}/" in hint


def test_loaded_malloc_reads_the_memory_map(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 0 08:01 1 /usr/lib/libtcmalloc_minimal.so.4.5.10\n")
    assert allocator.loaded_malloc(str(maps)) == "tcmalloc"
    maps.write_text("7f00-7f01 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n")
    assert allocator.loaded_malloc(str(maps)) == "system"
    assert allocator.loaded_malloc(str(tmp_path / "absent")) == "system"


def maps_once_tensorflow_loads(process, timeout=120):
    """The memory map of `process` (its pid) once TensorFlow's library is in it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        with open(f"/proc/{process.pid}/maps") as f:
            maps = f.read()
        if "libtensorflow" in maps:
            return maps
        time.sleep(0.2)
    raise AssertionError(f"TensorFlow not loaded in {timeout} s (exit {process.poll()})")


@pytest.mark.parametrize("how", ["module", "console script"])
def test_an_entry_point_runs_as_it_was_started_and_takes_a_preloaded_malloc(tmp_path, how):
    """No restart: the process keeps its command line and the malloc it was started with: the
    system's when nothing is preloaded (TCMalloc installed or not), TCMalloc when the command
    preloads it as make run does (where TCMalloc is installed)."""
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", allocator.SETTING)}
    flags = ["--flagfile=flags/cpu_smoke.cfg", f"--model_dir={tmp_path}/run"]
    command = ([sys.executable, "-m", "tfmulti.main", *flags] if how == "module" else
               [os.path.join(os.path.dirname(sys.executable), "tfmulti"), *flags])
    library = allocator.find_tcmalloc()
    for preload in ([None, library] if library else [None]):
        started = allocator.preload_environment(env, preload) if preload else env
        process = subprocess.Popen(command, cwd=ROOT, env=started, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL)
        try:
            maps = maps_once_tensorflow_loads(process)
            with open(f"/proc/{process.pid}/cmdline") as f:
                cmdline = f.read().split("\0")[:-1]
        finally:
            process.kill()
            process.wait()
        # the script runs as `python <script> flags` (its #! line)
        assert cmdline == command if how == "module" else cmdline[1:] == command
        assert ("libtcmalloc" in maps) == (preload is not None)


def test_the_code_never_restarts_a_process():
    """The restart that used to preload TCMalloc is gone for good: no exec in the package."""
    package = os.path.join(ROOT, "tfmulti")
    for folder, _, files in os.walk(package):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(folder, name)) as f:
                    assert "execv" not in f.read(), name


def test_glibcs_thresholds_are_set_only_for_glibcs_malloc_and_never_over_yours(monkeypatch):
    """keep_buffers: after before() (TensorFlow's own setting), for glibc's malloc only, and
    not when the environment sets either threshold (its own names or GLIBC_TUNABLES); the
    doctor's and the run's line then say the buffers are kept, with no hint."""
    monkeypatch.setattr(allocator, "KEPT", [False])
    ran = []
    system = lambda: "system"  # noqa: E731
    for environ in ({"MALLOC_MMAP_THRESHOLD_": "1048576"}, {"MALLOC_TRIM_THRESHOLD_": "0"},
                    {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.mmap_threshold=1"}):
        assert allocator.keep_buffers(lambda: ran.append(1), environ, system) is False
    assert allocator.keep_buffers(lambda: ran.append(1), {}, lambda: "tcmalloc") is False
    assert ran == []
    assert allocator.keep_buffers(lambda: ran.append(1), {
        "GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, system) is (sys.platform == "linux")
    assert ran == [1] and allocator.KEPT == [sys.platform == "linux"]
    assert allocator.describe({}, (), system, kept=True) == (
        "the system's, a step's buffers kept (glibc's mmap threshold 32 MB)", "")
    assert allocator.describe({allocator.SETTING: "system"}, (), system, kept=True)[0] == (
        "the system's (TFMULTI_MALLOC=system), a step's buffers kept (glibc's mmap threshold "
        "32 MB)")


# Whether glibc serves a request with a mapping of its own (freed by unmapping it): the
# IS_MMAPPED bit of the chunk's size word, just before the pointer malloc returns.
PROBE = '''
import ctypes, json, sys
sys.path.insert(0, ROOT)
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]

def mapped(size=4 << 20):
    """Whether a block of `size` freed and asked for again is a mapping of its own."""
    libc.free(libc.malloc(size))  # glibc's own threshold rises past what is freed
    block = libc.malloc(size)
    bit = ctypes.c_size_t.from_address(block - 8).value & 2
    libc.free(block)
    return bool(bit)

said = {"at_start": mapped()}
'''


def probe(script):
    """What the PROBE script followed by `script` prints (a JSON line), with glibc's malloc."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("LD_PRELOAD", allocator.SETTING, "GLIBC_TUNABLES",
                        *allocator.GLIBC_SETTINGS)}
    done = subprocess.run([sys.executable, "-c", f"ROOT = {ROOT!r}\n" + PROBE + script],
                          cwd=ROOT, env={**env, "TF_CPP_MIN_LOG_LEVEL": "2"},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


ON_TWO_REPLICAS = '''
import tensorflow as tf
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
batches = strategy.experimental_distribute_dataset(tf.data.Dataset.range(8).batch(4))
next(iter(batches))  # the iterator of a dataset on two devices: a generator dataset each
'''


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's malloc: Linux only")
def test_tensorflow_pins_glibcs_threshold_in_a_run_on_two_replicas_and_the_start_up_lifts_it():
    """The cause, in a real process: glibc keeps a freed 4 MB block for the next request,
    until a distributed dataset's iterator runs on two devices (tf.data sets glibc's mmap
    threshold to 128 KB then): every such block is then a mapping of its own, faulted in
    again each time. The start-up (Startup.start_devices, as every tool starts) makes
    TensorFlow set it first and sets glibc's thresholds after it: blocks are kept, also
    after a two-replica iterator has run."""
    untouched = probe('''
import tensorflow as tf
tf.config.set_logical_device_configuration(tf.config.list_physical_devices("CPU")[0],
                                           [tf.config.LogicalDeviceConfiguration()] * 2)
said["tensorflow"] = mapped()
''' + ON_TWO_REPLICAS + '''
said["two_replicas"] = mapped()
print(json.dumps(said))
''')
    assert untouched == {"at_start": False, "tensorflow": False, "two_replicas": True}
    started = probe('''
from tfmulti.distribution import startup
from tfmulti.run.config import RunConfig
startup.from_config(RunConfig(cpu_replicas=2)).start_devices()
said["started"] = mapped()
''' + ON_TWO_REPLICAS + '''
said["two_replicas"] = mapped()
print(json.dumps(said))
''')
    assert started == {"at_start": False, "started": False, "two_replicas": False}


def test_workers_with_glibcs_malloc_keep_their_buffers_and_train(tmp_path):
    """Two workers started by the launcher with glibc's malloc (TFMULTI_MALLOC=system): each
    sets glibc's thresholds after its strategy is made (a worker's collectives must be
    configured before any op runs, and tf.data's threshold is set by running one), and the
    run trains to its report."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("LD_PRELOAD", "GLIBC_TUNABLES", *allocator.GLIBC_SETTINGS)}
    done = subprocess.run(
        [sys.executable, "-m", "tfmulti.launch", "--workers=2", "--",
         "--flagfile=flags/cpu_smoke.cfg", "--cpu_replicas=1", "--synthetic_train_size=256",
         "--synthetic_test_size=64", f"--model_dir={tmp_path}/run"],
        cwd=ROOT, env={**env, allocator.SETTING: "system"}, capture_output=True, text=True,
        timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    said = done.stdout + done.stderr
    assert said.count("[worker 0] malloc: the system's (TFMULTI_MALLOC=system), a step's "
                      "buffers kept (glibc's mmap threshold 32 MB)") == 1
    assert "[worker 0] test acc: " in said
