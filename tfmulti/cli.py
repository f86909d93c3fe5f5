"""Runs a tool: `python -m tfmulti.<tool>` is `cli.main("<tool>")`.

The tool's code is tfmulti/tools/<tool>.py, which imports what it uses at the top like any
module. Before it is imported, TensorFlow's start-up lines are held back (quiet.py), so that a
bad flag gets one line; then the tool's flags are parsed (each tool its own: --help lists
them, another tool's is refused), the tool runs, and an error a user can cause ends as one
line and an exit code: 1, or 75 after SIGTERM saved a checkpoint.

Nothing happens at import: importing this module loads neither TensorFlow nor a tool.
"""
import contextlib
import importlib
import os
import signal
import sys

from absl import app, logging

from tfmulti import quiet
from tfmulti.errors import (
    INTERRUPTED_EXIT_CODE,
    PREEMPTED_EXIT_CODE,
    UserError,
    lost_contact_cause,
    out_of_memory_line,
    undecodable_image,
)
from tfmulti.processes import child, ctrl_c, netns
from tfmulti.run import flagdefs


def main(tool: str, argv: list[str] | None = None) -> None:
    """`python -m tfmulti.<tool>` with the command line argv (sys.argv when None). Ctrl-C
    while it starts (importing TensorFlow) is one line too."""
    try:
        _start(tool, argv)
    except KeyboardInterrupt:
        exit_with(INTERRUPTED_LINE, INTERRUPTED_EXIT_CODE)


INTERRUPTED_LINE = ("tfmulti: stopped at once by Ctrl-C; a run resumes from its last checkpoint "
                    "when the same command runs again")


# Tools that only start processes: no TensorFlow in them (8 s of start-up on 2 cores).
WITHOUT_TENSORFLOW = ("launch",)
# absl's help flags: asked for, the tool's flags are listed without importing the tool (nor
# TensorFlow): every flag is defined in flagdefs, which imports neither.
HELP_FLAGS = {f"{dashes}{name}" for dashes in ("-", "--")
              for name in ("help", "helpshort", "helpfull", "helpxml", "?")}


def wants_help(argv: list[str]) -> bool:
    """Whether the command line (before a bare --, what the launcher passes on) asks for
    --help, -?, --helpshort, --helpfull or --helpxml: not as the value of the flag before it
    (`--model_dir --help`, absl's two-word form)."""
    given = argv[1:argv.index("--")] if "--" in argv else argv[1:]
    value_next = False
    for arg in given:
        if value_next:
            value_next = False
            continue
        if arg in HELP_FLAGS:
            return True
        name = arg.lstrip("-")
        value_next = arg.startswith("-") and "=" not in arg and (
            name == "flagfile" or name in flagdefs.FLAGS and not flagdefs.FLAGS[name].boolean)
    return False


@contextlib.contextmanager
def interrupted_while_importing():
    """Within the block a Ctrl-C ends the process at once with INTERRUPTED_LINE (exit 130): a
    KeyboardInterrupt raised inside an extension's import (numpy's, TensorFlow's) comes out as
    an ImportError with a traceback. An ignored SIGINT (a background job) stays ignored."""
    try:
        terminal = os.dup(2)  # stderr as it is now: quiet.py holds fd 2 while TensorFlow imports
    except OSError:  # no stderr at all
        terminal = None
    if terminal is None or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        if terminal is not None:
            os.close(terminal)
        yield
        return

    def stop(signum, frame):
        os.write(terminal, (INTERRUPTED_LINE + "\n").encode())
        os._exit(INTERRUPTED_EXIT_CODE)

    previous = signal.signal(signal.SIGINT, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        os.close(terminal)


def _start(tool, argv):
    if tool not in WITHOUT_TENSORFLOW:  # (the launcher passes the user's own to its workers)
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's C++ lines, before it
    try:  # a launcher's worker joins the workers' own network, before TensorFlow's threads
        netns.join_from_environment()
    except OSError as e:
        exit_with(f"tfmulti: error: could not join the workers' network ({e})")
    for name, value in flagdefs.TOOL_DEFAULTS.get(tool, {}).items():  # scratch's base_lr
        flagdefs.FLAGS.set_default(name, value)
    if wants_help(argv or sys.argv):  # absl prints the flags and exits as it parses them
        run(lambda *args: None, tool, argv=argv)
        return
    with interrupted_while_importing():
        if tool not in WITHOUT_TENSORFLOW:
            quiet.import_tensorflow()
        module = importlib.import_module(f"tfmulti.tools.{tool}")
    ctrl_c.install()  # from here a Ctrl-C is kept even where TensorFlow's C++ loses it
    run(module.main, tool, getattr(module, "COMMANDS", None),
        getattr(module, "PASSTHROUGH", False), argv)


def run(tool_main, tool, commands=None, passthrough=False, argv=None):
    """absl's app.run(tool_main) for the tool `tool`.

    With `commands`, the one positional argument must be one of them and tool_main gets it;
    with passthrough, tool_main gets whatever follows `--` (flags for another program).
    """
    FLAGS = flagdefs.FLAGS
    for name in flagdefs.tool_flags(tool):  # what --help lists
        FLAGS.register_key_flag_for_module((argv or sys.argv)[0], FLAGS[name])

    def main_or_exit(argv):
        child.die_with_parent_from_environment()
        try:
            foreign = flagdefs.check_tool(tool)
            if foreign:
                raise UserError(foreign)
            args = argv[1:]
            if commands and (len(args) != 1 or args[0] not in commands):
                raise UserError(f"give one command: {', '.join(commands)} (got "
                                f"{' '.join(args) or 'none'})")
            if not commands and args and not passthrough:
                raise UserError(f"unexpected arguments: {' '.join(args)} (flags start with --)")
            if not FLAGS["verbosity"].present:
                logging.set_verbosity(logging.WARNING)  # tf.distribute's INFO lines
            tool_main(*args)
            quiet_shutdown()  # the work is done: what TensorFlow logs as it shuts down is not
        except BaseException as e:  # noqa: BLE001 - what is not a user's error is re-raised
            handle(e)

    app.run(main_or_exit, argv=argv, flags_parser=flagdefs.parse_or_exit)


def handle(error):
    """The one line (and exit code) for an error a user can cause; anything else is raised."""
    if ctrl_c.interrupted(error):  # Ctrl-C outside training, or a second one
        exit_with(INTERRUPTED_LINE, INTERRUPTED_EXIT_CODE)
    if isinstance(error, UserError):
        exit_with(f"tfmulti: error: {error}")
    if isinstance(error, FloatingPointError):  # a diverged run: say where, keep what was written
        exit_with(f"tfmulti: error: training diverged: {error}; try a lower --base_lr")
    if "tensorflow" not in sys.modules:  # a tool without it (the launcher)
        raise error
    import tensorflow as tf

    from tfmulti.training import loop

    if (isinstance(error, (tf.errors.UnavailableError, tf.errors.DeadlineExceededError))
            and os.environ.get("TF_CONFIG")):
        cause = lost_contact_cause(str(error.message))
        exit_with(f"tfmulti: error: lost contact with another worker "
                  f"({cause or type(error).__name__}); restart every worker with the same "
                  "command to resume from the last checkpoint")
    if isinstance(error, tf.errors.InvalidArgumentError) and undecodable_image(error.message):
        exit_with(f"tfmulti: error: an image file no longer decodes "
                  f"({undecodable_image(error.message)}): a file of the folder changed after "
                  "it was checked at the start; replace it and run the same command to resume "
                  "from the last checkpoint")
    if isinstance(error, tf.errors.ResourceExhaustedError):  # the step did not fit
        exit_with(f"tfmulti: error: out of memory ({out_of_memory_line(error.message)}): the "
                  "step does not fit the device; give a smaller --per_replica_batch_size (with "
                  "--grad_accum_steps to keep the global batch), or "
                  "--per_replica_batch_size=auto to find one that fits")
    if isinstance(error, loop.Preempted):
        print(f"tfmulti: stopped by {error.by} at step {error.step}, checkpoint saved; run the "
              "same command again to resume", file=sys.stderr)
        sys.exit(PREEMPTED_EXIT_CODE)
    raise error


def exit_with(line, code=1):
    """The one line a failure deserves, and nothing after it: TensorFlow's runtime logs its
    shutdown at exit in a failed multi-worker run (kept with TF_CPP_MIN_LOG_LEVEL=0 or 1)."""
    print(line, file=sys.stderr, flush=True)
    quiet_shutdown()
    sys.exit(code)


def quiet_shutdown():
    """In a multi-worker run, nothing more on stderr: TensorFlow's runtime logs the others'
    going away as errors when a worker shuts down (E0000 ... Failed to send RPC to
    coordination service), after a run that ended well too. Kept with TF_CPP_MIN_LOG_LEVEL=0
    or 1."""
    if os.environ.get("TF_CONFIG") and os.environ.get("TF_CPP_MIN_LOG_LEVEL", "0") not in (
            "0", "1"):
        sys.stderr.flush()
        os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
