"""The malloc choice: TCMalloc preloaded by a restart of the entry point, before TensorFlow
loads; the system's on request; one line for a choice that cannot be honoured."""
import os
import subprocess
import sys
import time

import pytest

from tfmulti.distribution import allocator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NEEDS = "TCMalloc is not installed here: `make test` installs it (apt-get install libtcmalloc-minimal4)"


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
    assert env[allocator._STARTED] == str(os.getpid())
    assert allocator.preload_environment({}, "/lib/t.so")["LD_PRELOAD"] == "/lib/t.so"


def test_the_process_restarts_once_with_the_library_and_not_when_it_is_loaded(tmp_path):
    library = fake_library(tmp_path)
    glibc_only = tmp_path / "maps"
    glibc_only.write_text("7f00-7f01 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n")
    calls = []

    def execve(path, argv, env):
        calls.append((path, argv, env))

    def use(environ, maps=glibc_only):
        allocator.use_preferred(environ, execve, [str(tmp_path)], str(maps))

    use({allocator.SETTING: "auto", "LD_PRELOAD": "/mine.so"})
    (path, argv, env), = calls
    assert path == sys.executable and argv == [sys.executable, *sys.orig_argv[1:]]
    assert env["LD_PRELOAD"] == f"{library} /mine.so"
    assert env[allocator._STARTED] == str(os.getpid())  # execve keeps the pid
    # restarted and still not loaded: no second restart. auto goes on with glibc's and takes
    # the library out of LD_PRELOAD for the processes it starts; an explicit choice is an error
    calls.clear()
    restarted = dict(env)
    use(restarted)
    assert calls == [] and restarted["LD_PRELOAD"] == "/mine.so"
    with pytest.raises(allocator.AllocatorError, match="did not load"):
        use(dict(env, **{allocator.SETTING: library}))
    # a process the restarted one starts (another pid) may restart itself
    use(dict(env, **{allocator._STARTED: str(os.getpid() + 1)}))
    assert len(calls) == 1
    calls.clear()
    use({allocator.SETTING: "system"})
    use({allocator.SETTING: ""})  # empty: auto
    assert len(calls) == 1
    calls.clear()
    for mapped in (f"7f00-7f01 r-xp 0 08:01 1 {library}\n",  # loaded: no restart
                   "7f00-7f01 r-xp 0 08:01 1 /usr/lib/libjemalloc.so.2\n"):  # the user's kept
        maps = tmp_path / "maps2"
        maps.write_text(mapped)
        use({}, maps)
        use({allocator.SETTING: library}, maps)
    assert calls == []


def test_the_doctor_line_says_what_is_used_and_how_to_get_tcmalloc(tmp_path):
    fake_library(tmp_path)
    system, found, none = (lambda: "system"), [str(tmp_path)], [str(tmp_path / "none")]
    assert allocator.describe({}, found, lambda: "tcmalloc") == ("tcmalloc (preloaded)", "")
    assert allocator.describe({allocator.SETTING: "system"}, found, system) == (
        "the system's (TFMULTI_MALLOC=system)", "")
    used, hint = allocator.describe({}, none, system)
    assert used == "the system's" and "apt-get install libtcmalloc-minimal4" in hint
    used, hint = allocator.describe({}, found, system)
    assert "installed but not loaded" in hint


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


@pytest.mark.parametrize("setting,how", [(None, "module"), ("system", "module"),
                                         (None, "console script")])
def test_an_entry_point_restarts_itself_with_tcmalloc_keeping_its_pid_and_command(
        tmp_path, setting, how):
    """The real restart: the process a launcher started (its pid) is the one that trains, with
    TCMalloc mapped before TensorFlow, and the same command line; TFMULTI_MALLOC=system keeps
    glibc's. `python -m tfmulti.main` and the `tfmulti` command alike."""
    assert allocator.find_tcmalloc(), NEEDS
    env = {k: v for k, v in os.environ.items()
           if k not in ("LD_PRELOAD", allocator._STARTED, allocator.SETTING)}
    if setting:
        env[allocator.SETTING] = setting
    flags = ["--flagfile=flags/cpu_smoke.cfg", f"--model_dir={tmp_path}/run"]
    command = ([sys.executable, "-m", "tfmulti.main", *flags] if how == "module" else
               [os.path.join(os.path.dirname(sys.executable), "tfmulti"), *flags])
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    try:
        maps = maps_once_tensorflow_loads(process)
        with open(f"/proc/{process.pid}/cmdline") as f:
            cmdline = f.read().split("\0")[:-1]
    finally:
        process.kill()
        process.wait()
    # the script runs as `python <script> flags` (its #! line), before and after the restart
    assert cmdline == command if how == "module" else cmdline[1:] == command
    assert ("libtcmalloc" in maps) == (setting is None)


def test_a_malloc_that_cannot_be_used_is_one_line_and_exit_1(tmp_path):
    """Before TensorFlow loads: a bad setting, TCMalloc asked for by path that is no library
    (the dynamic loader ignores it: no second restart, one line)."""
    not_a_library = fake_library(tmp_path)
    for setting, words in (("fast", "give auto, tcmalloc, system"),
                           (str(tmp_path / "none.so"), "no such file"),
                           (not_a_library, "did not load")):
        env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", allocator._STARTED, allocator.SETTING)}
        result = subprocess.run([sys.executable, "-m", "tfmulti.main", "--num_gpus=0"], cwd=ROOT,
                                env=dict(env, **{allocator.SETTING: setting}),
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 1
        ours = [line for line in result.stderr.splitlines() if line.startswith("tfmulti:")]
        assert len(ours) == 1 and words in ours[0], result.stderr
