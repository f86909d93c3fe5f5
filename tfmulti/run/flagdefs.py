"""Command-line flags, defined once here and read only by the entry points.

A run's settings are the fields of config.RunConfig; their flags are made from those fields.
The other flags belong to one tool each. Every flag names the tools (entry points) that accept
it: each tool's --help lists its own, and a flag of another tool is refused (`check_tool`).
`parse_or_exit` is the flags parser: a bad flag gives one line and exit code 1.
"""
from __future__ import annotations

import dataclasses
import os
import shlex
import sys
import typing

from absl import flags

from tfmulti.run import config

FLAGS = flags.FLAGS
OWNERS = {}  # flag name -> the tools that accept it
MODULES = {"main": "tfmulti.main", "tune": "tfmulti.tune", "scratch": "tfmulti.scratch",
           "bench": "tfmulti.bench", "doctor": "tfmulti.doctor", "launch": "tfmulti.launch",
           "evaluate": "tfmulti.evaluate", "dataservice": "tfmulti.dataservice"}
# A tool's own default for a shared flag: the scratch lesson's rate is the book's 0.2 per 256
# examples (its run keeps the book's global batch 256 whatever the device count).
TOOL_DEFAULTS = {"scratch": {"base_lr": 0.2}}


def _define(define, name, default, help, tools, **kwargs):
    OWNERS[name] = tuple(tools)
    define(name, default, help=help, **kwargs)


class _BatchParser(flags.ArgumentParser):
    """A number of examples, or "auto" (found at the start: bench/batchsize.py)."""

    def parse(self, argument):
        if argument is None or argument == config.AUTO_BATCH or isinstance(argument, int):
            return argument
        try:
            return int(argument)
        except ValueError:
            raise ValueError(f"{argument!r}: give a number of examples or "
                             f"{config.AUTO_BATCH}") from None

    def flag_type(self):
        return "int or auto"


def _define_run_config_flags():
    """One flag per RunConfig field, of the field's kind."""
    for f in dataclasses.fields(config.RunConfig):
        kind = typing.get_args(f.type)[0] if typing.get_origin(f.type) is typing.Union else f.type
        meta = f.metadata
        default = 0 if f.name == "width" else f.default
        if f.name == "per_replica_batch_size":
            OWNERS[f.name] = tuple(meta["tools"])
            flags.DEFINE(_BatchParser(), f.name, default, meta["help"])
        elif meta["choices"]:
            _define(flags.DEFINE_enum, f.name, default, meta["help"], meta["tools"],
                    enum_values=list(meta["choices"]))
        else:
            define = {bool: flags.DEFINE_bool, int: flags.DEFINE_integer,
                      float: flags.DEFINE_float, str: flags.DEFINE_string,
                      tuple: flags.DEFINE_list}[kind]
            _define(define, f.name, default, meta["help"], meta["tools"])


_define_run_config_flags()

# tfmulti.launch
_define(flags.DEFINE_integer, "workers", 2, "Worker processes to start on this machine.",
        ["launch"])
_define(flags.DEFINE_integer, "gpus_per_worker", None, "GPUs each worker gets for its own "
        "(CUDA_VISIBLE_DEVICES and --num_gpus); default: the GPUs split evenly, none on a "
        "machine without GPUs; 0 keeps the workers on the CPU.", ["launch"])
_define(flags.DEFINE_float, "grace", 60.0, "Seconds the other workers get to stop by "
        "themselves after one fails (or the launcher is stopped) before they are killed.",
        ["launch"])
_define(flags.DEFINE_enum, "network", "private", "private: the workers get a network of their "
        "own (a Linux user and network namespace), so their servers, which run code for "
        "whoever reaches them, are reachable only by each other; host: the machine's network "
        "(needed for gs:// or other remote storage; the servers then listen on every "
        "interface).", ["launch"], enum_values=["private", "host"])
_define(flags.DEFINE_integer, "data_service_workers", 0, "Also start a tf.data service for "
        "the workers: a dispatcher and this many worker servers on this machine, in the "
        "workers' network, and give the workers --data_service (docs/data-service.md).",
        ["launch"])
_define(flags.DEFINE_enum, "program", "main", "What every worker runs: main (the main job) or "
        "doctor (its checks, the all-reduce across the workers in their network).",
        ["launch"], enum_values=["main", "doctor"])
# tfmulti.dataservice
_define(flags.DEFINE_integer, "port", 0, "The port this server listens on (every interface; "
        "run it where only the training machines reach it). 0: a free one, said when it "
        "listens; a dispatcher needs a fixed one for --data_service.", ["dataservice"])
_define(flags.DEFINE_boolean, "trusted_network", False, "Start the server although it "
        "listens on every interface of this machine, with no authentication: whoever reaches "
        "its port runs code here as you. Give it only on a network your training machines "
        "alone reach (tfmulti.launch --data_service_workers starts its servers in its workers' "
        "own network).", ["dataservice"])
_define(flags.DEFINE_string, "dispatcher", "", "worker: HOST:PORT of the dispatcher to "
        "serve for.", ["dataservice"])
_define(flags.DEFINE_string, "advertise", "", "worker: the host name the training workers "
        "reach this worker by (default: this machine's name).", ["dataservice"])
_define(flags.DEFINE_float, "linger", 0.0, "Seconds the server goes on serving after "
        "SIGTERM before it exits (Ctrl-C: at once): a training job stopped by the same "
        "signal (Slurm's time limit, a preemption) finishes its step and saves with it.",
        ["dataservice"])
# tfmulti.scratch
_define(flags.DEFINE_enum, "allreduce", "naive", "How gradients are summed: naive (all onto the "
        "first device, the book's) or ring (reduce-scatter, then all-gather, one chunk per step "
        "to the next device).", ["scratch"], enum_values=["naive", "ring"])
# tfmulti.tune
_define(flags.DEFINE_enum, "tuner", "random", "The search (hyperband spends --epochs as the "
        "budget).", ["tune"], enum_values=["random", "bayesian", "hyperband"])
_define(flags.DEFINE_integer, "max_trials", 10, "Trials in the session (random, bayesian).",
        ["tune"])
_define(flags.DEFINE_integer, "max_retries_per_trial", 1, "Reruns of a trial that crashes "
        "before it is marked failed and the search goes on.", ["tune"])
_define(flags.DEFINE_string, "objective", "", "What the session maximizes or minimizes: a "
        "figure of the validation part (--validation_split) at a trial's last epoch, named as "
        "Keras names it: val_loss, val_accuracy, val_<your metric>, with :max or :min where "
        "the name does not say. Default: val_accuracy for a classifier, else val_loss.",
        ["tune"])
_define(flags.DEFINE_enum, "prune", "none", "median: stop a trial after an epoch at which its "
        "objective is worse than the median of the completed trials' at that epoch, once 3 of "
        "them reached it (never at its last epoch); it is recorded as pruned with its figure "
        "there. random and bayesian tuners.", ["tune"], enum_values=["none", "median"])
_define(flags.DEFINE_bool, "decode_once", True, "A folder of images, or records read from "
        "their files (tfds:, tfrecord:), on one worker: decode the training examples once into "
        "memory where they fit in a quarter of the memory this process may use (counting a "
        "copy per trial process in a session), and read them from there; a main job's where "
        "they do not: into a file of ~/.cache/tfmulti/decoded mapped into memory, where it "
        "takes at most half of the disk's free space; --nodecode_once: read the files each "
        "epoch.",
        ["main", "tune"])
_define(flags.DEFINE_list, "tune_lr_range", ["0.01", "1.0"], "base_lr range (per 256 "
        "examples), searched on a log scale: low,high, each a --base_lr.", ["tune"])
# The search space: each flag lists the values to try of one RunConfig field, each value
# checked as that field is (tune.py builds a trial's RunConfig with it). keras-tuner draws
# them in this order (the batch, then base_lr, then the rest).
TUNE_CHOICES = {  # flag -> (RunConfig field, default values, what they are)
    "tune_batch_sizes": ("per_replica_batch_size", ["64", "128", "256"],
                         "Per-replica batch choices"),
    "tune_lr_scalings": ("lr_scaling", ["linear", "sqrt"], "Scaling rules to try"),
    "tune_warmup_epochs": ("warmup_epochs", ["0", "1"], "Warm-up choices, in epochs"),
    "tune_lr_schedules": ("lr_schedule", ["constant"], "Schedules after the warm-up to try"),
    "tune_momentum": ("momentum", ["0"], "SGD momentum choices"),
    "tune_weight_decay": ("weight_decay", ["0"], "Weight-decay choices"),
}


def _define_tune_choice_flags():
    fields = {f.name: f for f in dataclasses.fields(config.RunConfig)}
    for name, (field, default, what) in TUNE_CHOICES.items():
        choices = fields[field].metadata["choices"]
        _define(flags.DEFINE_list, name, default, f"{what}: values of --{field}"
                + (f" ({', '.join(choices)})." if choices else "."), ["tune"])


_define_tune_choice_flags()
_define(flags.DEFINE_integer, "parallel_trials", 1, "Trials run at once, each on an equal "
        "share of the devices (one GPU each with --num_gpus=K, or a group of CPU replicas pinned "
        "to its cores), through keras-tuner's chief oracle and K workers.", ["tune"])
# tfmulti.doctor
_define(flags.DEFINE_float, "doctor_timeout", 60.0, "Seconds the test all-reduce may take "
        "before it counts as hung (the prediction's measurement: --measure_budget more).",
        ["doctor"])
_define(flags.DEFINE_float, "doctor_allreduce_mb", 32.0, "Megabytes per replica in the test "
        "all-reduce.", ["doctor"])
_define(flags.DEFINE_bool, "doctor_predict", True, "Time a few training steps of one replica "
        "(--model, --width, --dtype, the per-replica batch) and matmuls in float32 and "
        "bfloat16, as `bench predict` does, then predict the speed-up of these devices and "
        "workers over one replica, recommend the batch and --steps_per_call, and warn when "
        "--dtype computes slower than float32 here. Up to about --measure_budget seconds; "
        "--nodoctor_predict skips it.", ["doctor"])
_define(flags.DEFINE_float, "measure_budget", 40.0, "predict, and the doctor's prediction: "
        "seconds measuring one device aims to take (tracing the model and two timed steps at "
        "the batch run whatever it says; half the batch is measured too when it leaves room).",
        ["bench", "doctor"])
# tfmulti.bench
_define(flags.DEFINE_float, "link_mb", 0.0, "scaling_point: then time all-reduces across the "
        "replicas (one number, and this many megabytes) for the link's latency and bus "
        "bandwidth (0: not).", ["bench"])
_define(flags.DEFINE_integer, "step_times", 0, "scaling_point: then time this many single "
        "steps, one call each (their spread gives the predictor's straggler term).", ["bench"])
_define(flags.DEFINE_integer, "matrix_size", 0, "parallel/overlap: matrix side (0: the book's "
        "4000 on GPUs, 1024 on the CPU).", ["bench"])
_define(flags.DEFINE_integer, "products", 50, "parallel/overlap: matrix products per device.",
        ["bench"])
_define(flags.DEFINE_integer, "repeats", 5, "Timed repeats of each figure (median and spread).",
        ["bench"])
_define(flags.DEFINE_integer, "warmup", 1, "Untimed runs before timing.", ["bench"])
_define(flags.DEFINE_integer, "steps", 10, "scaling: training steps timed per repeat; "
        "predict: timed steps at each batch size, at most (fewer when --measure_budget ends).",
        ["bench"])
_define(flags.DEFINE_list, "predict_devices", ["1", "2", "4", "8"], "predict: devices per "
        "machine to predict.", ["bench"])
_define(flags.DEFINE_list, "predict_machines", ["1", "2", "4"], "predict: machines to predict.",
        ["bench"])
_define(flags.DEFINE_string, "intra_link", None, "predict: the link between one machine's "
        "devices, by name (pcie3, pcie4, nvlink1, nvlink2, nvlink3) or as GB/s[@us per hop], "
        "e.g. the doctor's bus bandwidth; default: measured across this plan's replicas when "
        "there are several, else pcie3.", ["bench"])
_define(flags.DEFINE_string, "inter_link", "eth25", "predict: the network between machines: "
        "eth10, eth25, eth50, eth100, eth400, ib_edr, ib_hdr, or GB/s[@us per hop].", ["bench"])
_define(flags.DEFINE_enum, "collective", "ring", "predict: the all-reduce between machines "
        "(tree: fewer hops, the same bandwidth).", ["bench"], enum_values=["ring", "tree"])
_define(flags.DEFINE_float, "overlap", 0.0, "predict: share of the backward pass the "
        "all-reduce hides behind (0: tfmulti's engine sums after the whole backward pass; "
        "Horovod and DDP overlap).", ["bench"])
_define(flags.DEFINE_string, "out", None, "Where the JSON (and PNG) go; default "
        "runs/<time>-bench-<command>/.", ["bench"])


def values(tool: str, flag_values: flags.FlagValues = FLAGS) -> dict[str, typing.Any]:
    """The values of the flags `tool` accepts, for reports."""
    return {name: flag_values[name].value for name in tool_flags(tool)}


def command_line(argv: list[str] | None = None) -> str:
    """This process's command line as it can be run again from the same folder, for reports:
    `python -m tfmulti.X ...` for a tool (sys.argv holds the path of tfmulti/X.py), each
    word quoted where the shell needs it."""
    argv = sys.argv if argv is None else argv
    program = argv[0] if argv else ""
    module = f"tfmulti.{os.path.splitext(os.path.basename(program))[0]}"
    tool = (os.path.basename(os.path.dirname(os.path.abspath(program))) == "tfmulti"
            and module in MODULES.values())
    return shlex.join((["python", "-m", module] if tool else [program]) + list(argv[1:]))


def tool_flags(tool: str) -> list[str]:
    """The names of the flags `tool` accepts, in definition order."""
    return [name for name, tools in OWNERS.items() if tool in tools]


def check_tool(tool: str, flag_values: flags.FlagValues = FLAGS) -> str | None:
    """None, or one line naming each flag given to `tool` that only other tools accept (it
    would do nothing here) and the tools it belongs to."""
    foreign = [f"--{name} belongs to {' or '.join(f'python -m {MODULES[t]}' for t in tools)}"
               for name, tools in OWNERS.items()
               if flag_values[name].present and tool not in tools]
    if not foreign:
        return None
    hint = ""
    if tool == "launch" and all("main" in tools for name, tools in OWNERS.items()
                                if flag_values[name].present and tool not in tools):
        hint = ("; the workers' flags go after a bare --: python -m tfmulti.launch --workers=2 "
                "-- --epochs=2")
    return f"not flags of python -m {MODULES[tool]}: {'; '.join(foreign)}{hint}"


def parse_or_exit(argv: list[str]) -> list[str]:
    """absl flags parser for app.run: one clear line and exit 1 on a bad flag."""
    try:
        return FLAGS(argv)
    except flags.CantOpenFlagFileError as e:  # absl says "ERROR:: Unable to open flagfile: ..."
        reason = str(e).split("Unable to open flagfile:", 1)[-1].strip()
        sys.exit(f"tfmulti: error: a --flagfile cannot be read: {reason}")
    except flags.Error as e:
        sys.exit(f"tfmulti: error: {e}")
