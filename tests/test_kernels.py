"""The CPU kernels TensorFlow runs: oneDNN's on every x86 CPU unless you say otherwise
(tfmulti/kernels.py), chosen before TensorFlow loads, said in the run's first lines and
run.json (test_main.py's smoke run shows them in a real run)."""
import platform

from tfmulti import kernels, tfprivate


def test_onednn_is_chosen_on_x86_and_your_setting_wins():
    mine = {}
    assert kernels.choose(mine, "x86_64") == "tfmulti"
    assert mine == {kernels.VARIABLE: "1", kernels.CHOSEN_BY: "1"}
    assert kernels.choose(dict(mine), "x86_64") == "tfmulti"  # a process it starts inherits
    yours = {kernels.VARIABLE: "0"}
    assert kernels.choose(yours, "x86_64") == "you" and yours == {kernels.VARIABLE: "0"}
    assert kernels.choose({kernels.VARIABLE: "1"}, "AMD64") == "you"
    # yours, in a process a tfmulti process started
    assert kernels.choose({kernels.VARIABLE: "0", kernels.CHOSEN_BY: "1"}, "x86_64") == "you"
    arm = {}
    assert kernels.choose(arm, "aarch64") == "TensorFlow" and arm == {}


def test_this_process_runs_the_kernels_chosen_for_it():
    """The suite imported TensorFlow as the tools do (conftest.py): on x86, oneDNN's."""
    if platform.machine().lower() in kernels.X86:
        assert tfprivate.onednn_on()
    assert kernels.choose() in ("tfmulti", "you", "TensorFlow")


def test_the_first_lines_say_the_kernels_and_threads():
    assert kernels.line(kernels.described(True, "tfmulti", 1, 4)) == (
        "CPU kernels: oneDNN's (tfmulti's choice; TF_ENABLE_ONEDNN_OPTS=0 for Eigen's); "
        "1 intra-op thread, 4 inter-op threads")
    assert kernels.line(kernels.described(False, "you", 0, 0)) == (
        "CPU kernels: Eigen's (your TF_ENABLE_ONEDNN_OPTS); TensorFlow's intra-op threads, "
        "TensorFlow's inter-op threads")
