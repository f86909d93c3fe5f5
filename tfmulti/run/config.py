"""A run's settings: one frozen dataclass, built once from the flags and checked in one place.

Each field is also its command-line flag (flagdefs.py defines the flags from these fields):
its help, its kind, the tools that accept it, and whether it may change when a run resumes.
run.json, metrics.json, tuning trials and best.cfg all come from a RunConfig, so adding a
hyperparameter is a field here and the code that uses it (docs/developing.md).

No TensorFlow here: the entry points build a RunConfig before the runtime starts.
"""
import dataclasses
import json
import math
import re
import typing

from tfmulti.errors import UsageError
from tfmulti.run import datasets, hparams, usercode

if typing.TYPE_CHECKING:
    from absl import flags

TOOLS = ("main", "tune", "scratch", "bench", "doctor", "launch", "evaluate", "dataservice")
TRAINING = ("main", "tune")
DEVICE_TOOLS = ("main", "tune", "scratch", "bench", "doctor")
MODELS = ("resnet18", "lenet")
MODEL_SPEC = usercode.SPEC  # MODULE:FUNCTION, your own model
BOOK_WIDTH = {"resnet18": 64, "lenet": 20}
DATASETS = datasets.BUILT_IN  # built in; also your own, see datasets.SOURCES
IMAGE_SIZE = re.compile(r"^(\d+)(?:x(\d+))?$")  # --image_size=32 or 32x48 (height x width)
DTYPES = ("float32", "mixed_bfloat16", "mixed_float16")
ALLREDUCE_DTYPES = ("float32", "bfloat16", "float16")
INITS = ("keras", "book")
LR_SCHEDULES = ("constant", "cosine")
JIT_MODES = ("off", "on", "auto")  # training/xla.py
DEFAULT_BASE_LR = 0.1  # per 256 examples: the book's SGD rate, where --base_lr is unset
DEFAULT_LR_SCALING = "linear"  # where --lr_scaling is unset
AUTO_BATCH = "auto"  # --per_replica_batch_size=auto: found at the start (bench/batchsize.py)


def setting(default, help, *, tools=TRAINING, choices=None, resume=False, invocation=False):
    """A field and its flag. resume: may change when the run resumes (everything else must
    match the run in --model_dir). invocation: where and how this command runs, not what it
    trains (kept out of run.json's comparison and out of best.cfg). The doctor takes every
    setting: it checks the flags of the run about to start."""
    return dataclasses.field(default=default, metadata={
        "help": help, "tools": tuple(dict.fromkeys((*tools, "doctor"))), "choices": choices,
        "resume": resume or invocation, "invocation": invocation})


@dataclasses.dataclass(frozen=True)
class RunConfig:
    # Devices
    num_gpus: typing.Optional[int] = setting(
        None, "GPUs to train on: N, -1 for all, 0 for the CPU. Unset: all GPUs there are, or "
        "the CPU if there are none.", tools=DEVICE_TOOLS, resume=True)
    gpus: typing.Optional[tuple] = setting(
        None, "Which GPUs to train on: --gpus=0,2 (the others stay untouched). Unset: the first "
        "--num_gpus. The numbers are nvidia-smi's (tfmulti sets CUDA_DEVICE_ORDER=PCI_BUS_ID "
        "unless it is set), counted within CUDA_VISIBLE_DEVICES when that is set.",
        tools=DEVICE_TOOLS, resume=True)
    gpu_memory_growth: bool = setting(
        False, "Take GPU memory as it is needed instead of nearly all of it at start-up (for "
        "several processes on one GPU; always on in tuning trials and the doctor's probe).",
        tools=DEVICE_TOOLS, resume=True)
    cpu_replicas: int = setting(
        0, "Split the CPU into N logical devices and train N replicas on them (for machines "
        "without GPUs). 0: the CPU is one device.", tools=DEVICE_TOOLS, resume=True)
    intra_op_threads: int = setting(
        0, "Threads per op; 0 picks cores / replicas for CPU replicas, TensorFlow's default "
        "otherwise.", tools=DEVICE_TOOLS, resume=True)
    inter_op_threads: int = setting(
        0, "Ops run at once; 0 picks one per replica for CPU replicas, TensorFlow's default "
        "otherwise.", tools=DEVICE_TOOLS, resume=True)
    worker_hosts: typing.Optional[str] = setting(
        None, "Several machines: every worker's host:port, comma separated, the same on each; "
        "with --task_index. A TF_CONFIG already set (by a scheduler) is used when this is not "
        "given.", tools=("main", "bench", "doctor"), invocation=True)
    task_index: int = setting(0, "This worker's place in --worker_hosts (0 is the chief).",
                              tools=("main", "bench", "doctor"), invocation=True)
    worker_timeout: float = setting(
        600.0, "Several machines: seconds to wait for every worker to join; then the run (or "
        "the doctor's check) stops naming who is missing. Tuning across srun's tasks: seconds "
        "a task may be silent (a worker's trial then goes to another worker; a worker whose "
        "chief is silent stops). With --data_service: seconds a training call may wait for "
        "its batches past three times the longest call so far (twice this for the first).",
        tools=("main", "doctor", "tune"), invocation=True)
    # Batch, optimizer, schedule
    per_replica_batch_size: typing.Optional[typing.Union[int, str]] = setting(
        None, f"Examples per replica per step (default {hparams.DEFAULT_PER_REPLICA_BATCH}), or "
        "auto (tfmulti.main): the largest that fits a GPU's memory, the fastest per example on "
        "a CPU, found at the start. Give this or --global_batch_size; a run resumed on another "
        "device count keeps its global batch, so give --global_batch_size for that.",
        tools=("main", "scratch", "bench"), resume=True)
    global_batch_size: typing.Optional[int] = setting(
        None, "Examples per step over all replicas; must divide by the replica count (times "
        "--grad_accum_steps). Give this or --per_replica_batch_size.",
        tools=("main", "scratch", "bench"), resume=True)
    grad_accum_steps: int = setting(
        1, "Reach the global batch in K micro-steps per replica, summing their gradients "
        "before one update (for a global batch that does not fit the devices). Batch-norm "
        "statistics are then each micro-batch's own.", resume=True)
    base_lr: typing.Optional[float] = setting(
        None, f"Learning rate per {hparams.LR_REFERENCE_BATCH} examples; scaled to the global "
        f"batch by --lr_scaling. Unset: {DEFAULT_BASE_LR} (the book's SGD), and your compiled "
        "model's optimizer keeps its own rate, as model.fit trains it, unless --lr_scaling is "
        "given.", tools=("main", "scratch"))
    lr_scaling: typing.Optional[str] = setting(
        None, "How the rate grows with the global batch: linear (base_lr x batch/256), sqrt, "
        f"or none. Unset: {DEFAULT_LR_SCALING} (a compiled optimizer's own rate is kept as it "
        "is, unless --base_lr is given).", tools=("main", "scratch"),
        choices=hparams.LR_SCALINGS)
    warmup_epochs: float = setting(0.0, "Epochs of linear learning-rate warm-up (Goyal et al.).",
                                   tools=("main",))
    lr_schedule: str = setting(
        "constant", "After the warm-up: constant (the book's), or cosine down to 0 at the end "
        "of --epochs (the epochs are then fixed for the run).", tools=("main",),
        choices=LR_SCHEDULES)
    momentum: float = setting(0.0, "SGD momentum (0: the book's plain SGD).", tools=("main",))
    weight_decay: float = setting(0.0, "Decoupled weight decay per step, times the learning "
                                  "rate (0: none, the book's).", tools=("main",))
    epochs: int = setting(10, "Training epochs.", tools=("main", "tune", "scratch"), resume=True)
    steps_per_call: int = setting(10, "Training steps per tf.function call (and per "
                                  "progress-bar update).", tools=("main", "tune", "bench"),
                                  resume=True)
    # Data
    dataset: str = setting(
        "fashion_mnist", "fashion_mnist: the real data set (tensorflow-datasets or --data_dir); "
        "synthetic: the embedded offline stand-in; or your own: MODULE:FUNCTION (numpy arrays "
        "or tf.data), folder:DIR (DIR/train/<class>/ and DIR/test/<class>/ image files) or "
        "tfds:NAME (a tensorflow-datasets set, with --data_dir); docs/your-data.md.",
        tools=("main", "tune", "scratch", "doctor", "evaluate"))
    train_split: str = setting(
        "", "A tensorflow-datasets set's split to train on, in its syntax, slices allowed "
        "(train[:95%]). Unset: train.", tools=("main", "tune", "doctor", "evaluate"))
    eval_split: str = setting(
        "", "A tensorflow-datasets set's split a run evaluates as its test set (the figures "
        "at each epoch's end; tfmulti.evaluate's), slices allowed (train[95%:]). Unset: "
        "test, else validation.", tools=("main", "tune", "doctor", "evaluate"))
    parse: str = setting(
        "", "--dataset=tfrecord:...: MODULE:FUNCTION, your function from one serialized "
        "tf.train.Example (a string tensor) to (features, target) tensors (docs/your-data.md).",
        tools=("main", "tune", "doctor", "evaluate"))
    image_size: str = setting(
        "", "Resize every image to HEIGHTxWIDTH (or N for NxN) when the data set is loaded. "
        "Unset: folder: and tfds: sets take their first image's size, the others keep theirs.",
        tools=("main", "tune", "doctor", "evaluate"))
    data_dir: typing.Optional[str] = setting(
        None, "A directory with the four Fashion-MNIST IDX files (train-images-idx3-ubyte.gz, "
        "...), or a tensorflow-datasets data_dir.",
        tools=("main", "tune", "scratch", "doctor", "evaluate"),
        resume=True)
    data_service: str = setting(
        "", "HOST:PORT of a tf.data service dispatcher (python -m tfmulti.dataservice "
        "dispatcher): its workers read and decode the training batches, for input-bound jobs. "
        "Each example at most once an epoch, in the service's order; a resume continues at its "
        "step, not bit for bit (docs/data-service.md).", tools=("main",), resume=True)
    synthetic_train_size: int = setting(60000, "Training images of --dataset=synthetic.",
                                        tools=("main", "tune", "scratch", "evaluate"))
    synthetic_test_size: int = setting(10000, "Test images of --dataset=synthetic.",
                                       tools=("main", "tune", "scratch", "evaluate"))
    seed: int = setting(0, "Seed for weights, data order and the synthetic data set.",
                        tools=("main", "tune", "scratch"))
    validation_split: float = setting(
        0.0, "Hold this share of the training data out as a validation part (the same "
        "examples for a seed; each class its share) and report it every epoch (val_ figures) "
        "beside the test set. 0: none (tfmulti.main's default); a tuning session's default is "
        "0.1, and it chooses its trials on this part, never on the test set.")
    validation_set: str = setting(
        "", "A split of a tensorflow-datasets set (tfds:NAME) to validate on instead of a "
        "share held out: its name, slices allowed (validation, validation[:50%]); not train "
        "(the training data) or test (for the end). Reported every epoch (val_ figures); a "
        "tuning session chooses its trials on it.")
    # Model
    model: str = setting("resnet18", "resnet18 (the book's ResNet-18 variant), lenet, or "
                         "MODULE:FUNCTION, your own: FUNCTION(input_shape, num_classes) returns "
                         "an uncompiled Keras model that outputs logits (docs/your-model.md).",
                         tools=("main", "tune", "bench"))
    model_hparams: str = setting(
        "", "Your model's hyperparameters as JSON, e.g. '{\"units\":64}': the values its "
        "hp.Int, hp.Choice, ... return (a tuning session's best.cfg writes them; in a session "
        "they are fixed, not searched).", tools=("main", "tune"))
    class_weight: str = setting(
        "", "Weigh each class's examples in the training loss and metrics, as model.fit's "
        "class_weight: balanced (n / (classes x n_c)), or a JSON object of class ids or names, "
        "like '{\"0\": 1.0, \"3\": 5.0}' (the others 1). Your data function's sample "
        "weights, (x, y, weights), need no flag.")
    callbacks: str = setting(
        "", "MODULE:FUNCTION: FUNCTION() returns a list of your Keras callbacks "
        "(EarlyStopping, ReduceLROnPlateau, CSVLogger, your own), called as model.fit calls "
        "them (docs/your-model.md).", tools=("main",), resume=True)
    width: int = setting(0, "Channels of the first stage of a built-in model (0: the book's, 64 "
                         "for resnet18, 20 for lenet); smaller trains faster.",
                         tools=("main", "tune", "scratch", "bench"))
    init: str = setting(
        "keras", "Starting weights: keras (Glorot uniform, zero biases: trains well from the "
        "start) or book (Normal(0, 0.01), the book's; can stay at chance for a while on small "
        "data sets).", choices=INITS)
    dtype: str = setting("float32", "Compute precision; the mixed policies keep float32 weights.",
                         tools=("main", "tune", "bench"), choices=DTYPES)
    allreduce_dtype: str = setting(
        "float32", "The dtype gradients cross devices and workers in: bfloat16 or float16 "
        "halve the all-reduce's bytes (for a slow link), the sum then rounded to 8 (bfloat16) "
        "or 11 (float16) significant bits; float16 also flushes gradients below 6e-8 to 0.",
        tools=("main", "tune", "bench"), choices=ALLREDUCE_DTYPES, resume=True)
    sync_batchnorm: bool = setting(False, "Batch-norm statistics over the global batch (all "
                                   "replicas) instead of each replica's slice.")
    jit_compile: str = setting(
        "off", "on: each replica's forward and backward pass compiled with XLA, under every "
        "strategy (the all-reduce and the update stay outside); a model XLA cannot compile "
        "trains without it, said in one line. auto: on where `python -m tfmulti.doctor "
        "--jit_compile=auto` with the same flags measured it faster on these devices.",
        tools=(*TRAINING, "bench"), choices=JIT_MODES, resume=True)
    # Output
    model_dir: typing.Optional[str] = setting(
        None, "Where the run's report, checkpoints and model go. Unset: "
        "runs/<time>-<model>-<dataset>.",
        tools=("main", "tune", "scratch", "doctor", "evaluate"),
        invocation=True)
    overwrite: bool = setting(False, "Replace an earlier run in --model_dir (the same run there "
                              "is resumed without it).", tools=("main", "tune", "scratch"),
                              invocation=True)
    checkpoint_steps: int = setting(100, "Save a checkpoint every N training steps (and at every "
                                    "epoch's end); 0: only at epoch ends.", tools=("main",),
                                    resume=True)
    deterministic: bool = setting(False, "Seed everything and make TensorFlow's ops "
                                  "deterministic: the same command gives the same weights, "
                                  "resumed or not (a tuning session: the same trials, each "
                                  "with the same figures).",
                                  tools=("main", "tune", "scratch", "bench"),
                                  resume=True)
    show_replicas: bool = setting(False, "Print one parameter's first values on every replica "
                                  "after building the model (the same copy on each device).",
                                  tools=("main",), invocation=True)

    @property
    def rate_rule(self) -> tuple[float, str]:
        """(base_lr, lr_scaling) as the run uses them: the defaults where they are unset."""
        return (DEFAULT_BASE_LR if self.base_lr is None else self.base_lr,
                self.lr_scaling or DEFAULT_LR_SCALING)

    @property
    def own_model(self) -> bool:
        """--model=MODULE:FUNCTION: your model, not one of tfmulti's."""
        return bool(MODEL_SPEC.match(self.model))

    @property
    def features_as_given(self) -> bool:
        """Your model on your own function's data (--dataset=MODULE:FUNCTION, or tfrecord:
        with your --parse): the features reach it as your function returns them, as
        model.fit gives them (no scaling, no channel axis, no resizing); tfmulti's models,
        and its own sets (synthetic, fashion_mnist, folder:, tfds:), take images scaled to
        [0, 1] with a channel axis."""
        return self.own_model and datasets.source_of(self.dataset).features_as_given

    @property
    def settable_rate(self) -> bool:
        """The optimizer's rate is a number your callbacks may set (as fit's compiled float
        rate): --callbacks given, and no warm-up or cosine schedule drives it."""
        return bool(self.callbacks) and not self.warmup_epochs and self.lr_schedule == "constant"

    @property
    def keeps_compiled_rate(self) -> bool:
        """A compiled model's optimizer keeps its own learning rate (neither --base_lr nor
        --lr_scaling given), as model.fit trains it."""
        return self.base_lr is None and self.lr_scaling is None

    def __post_init__(self):
        own_model = bool(MODEL_SPEC.match(self.model))
        if not own_model and self.model not in MODELS:
            raise UsageError(f"--model={self.model}: choose one of {', '.join(MODELS)}, or "
                             "MODULE:FUNCTION for your own")
        if own_model and self.width:
            raise UsageError(f"--width={self.width} sets a built-in model's channels; "
                             f"--model={self.model} builds its own")
        if self.model_hparams:
            if not own_model:
                raise UsageError(f"--model_hparams is for your own model (--model=MODULE:"
                                 f"FUNCTION), not --model={self.model}")
            try:
                given = json.loads(self.model_hparams)
            except ValueError:
                given = None
            if not isinstance(given, dict):
                raise UsageError(f"--model_hparams={self.model_hparams}: give a JSON object, "
                                 "like '{\"units\":64}'")
        if self.class_weight:
            class_weight_given(self.class_weight)
        if self.callbacks and not MODEL_SPEC.match(self.callbacks):
            raise UsageError(f"--callbacks={self.callbacks}: give MODULE:FUNCTION, a function "
                             "that returns a list of Keras callbacks")
        datasets.source_of(self.dataset)
        if self.image_size and not image_size(self.image_size):
            raise UsageError(f"--image_size={self.image_size}: give HEIGHTxWIDTH, like 32x32, "
                             "or one number for square images")
        if self.image_size and self.features_as_given:
            raise UsageError(f"--image_size={self.image_size}: --model={self.model} takes the "
                             f"features of --dataset={self.dataset} as your function returns "
                             "them, as model.fit does; resize them there, or in your model "
                             "(keras.layers.Resizing)")
        if self.width == 0 and not own_model:
            object.__setattr__(self, "width", BOOK_WIDTH[self.model])
        if self.gpus is not None:
            object.__setattr__(self, "gpus", tuple(str(g) for g in self.gpus))
        for name in ("epochs", "steps_per_call", "grad_accum_steps", "synthetic_train_size",
                     "synthetic_test_size"):
            if getattr(self, name) < 1:
                raise UsageError(f"--{name}={getattr(self, name)}: must be at least 1")
        for name in ("checkpoint_steps", "warmup_epochs", "momentum", "weight_decay",
                     "cpu_replicas", "intra_op_threads", "inter_op_threads", "task_index"):
            if getattr(self, name) < 0:
                raise UsageError(f"--{name}={getattr(self, name):g}: must be 0 or more")
        if not 0 <= self.validation_split < 1:
            raise UsageError(f"--validation_split={self.validation_split:g}: give a share of "
                             "the training data, 0 or more and below 1")
        check_splits(self)
        if self.data_service:
            object.__setattr__(self, "data_service", service_address(self.data_service))
        if self.data_service and not self.worker_timeout > 0:
            raise UsageError(f"--worker_timeout={self.worker_timeout:g}: give the seconds to "
                             "wait for the tf.data service, more than 0")
        if self.validation_set:
            check_validation_set(self)
        if self.width < 0:
            raise UsageError(f"--width={self.width}: must be positive (or 0 for the book's)")
        if self.base_lr is not None and not self.base_lr > 0:
            raise UsageError(f"--base_lr={self.base_lr:g}: the learning rate must be positive")
        if self.momentum >= 1:
            raise UsageError(f"--momentum={self.momentum:g}: must be below 1")
        for f in dataclasses.fields(self):
            choices = f.metadata["choices"]
            if choices and getattr(self, f.name) not in (*choices, None if f.default is None
                                                         else choices[0]):
                raise UsageError(f"--{f.name}={getattr(self, f.name)}: choose one of "
                                 f"{', '.join(choices)}")
        if self.per_replica_batch_size == AUTO_BATCH:
            if self.global_batch_size is not None:
                raise UsageError("--per_replica_batch_size=auto and --global_batch_size both "
                                 "given; give one")
            if self.grad_accum_steps > 1:
                raise UsageError("--per_replica_batch_size=auto with --grad_accum_steps: auto "
                                 "finds the batch one step holds, accumulation goes past it; "
                                 "give the batch as a number")
        else:
            hparams.batch_sizes(1, self.per_replica_batch_size, self.global_batch_size)
        if self.grad_accum_steps > 1 and self.sync_batchnorm:
            raise UsageError("--grad_accum_steps with --sync_batchnorm: synchronized batch norm "
                             "all-reduces inside each micro-batch, which TensorFlow cannot do "
                             "inside the accumulation loop; drop one of them")

    def record(self):
        """What run.json and metrics.json hold: every field but how this command runs."""
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)
                if not f.metadata["invocation"]}

    @classmethod
    def from_record(cls, record):
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in record.items() if k in names})

    def must_match(self):
        """The fields a resumed run must keep (the cosine schedule also fixes the epochs)."""
        keep = {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)
                if not f.metadata["resume"]}
        if self.dataset != "synthetic":  # the synthetic set's sizes mean nothing then
            del keep["synthetic_train_size"], keep["synthetic_test_size"]
        if self.lr_schedule == "cosine":
            keep["epochs"] = self.epochs
        # the rate as it trains: unset means the defaults, so a run recorded with them
        # (before they could be unset) resumes; for your model, whether a compiled
        # optimizer keeps its own rate is part of it
        keep["base_lr"], keep["lr_scaling"] = self.rate_rule
        if MODEL_SPEC.match(self.model) and self.keeps_compiled_rate:
            keep["base_lr"] = keep["lr_scaling"] = "unset: a compiled optimizer's own"
        return keep

    def flag_lines(self, tool="main"):
        """This configuration as flags `tool` accepts, one per line (best.cfg): every setting
        that makes the run what it is (defaults too: a later default cannot change it), the
        others where they differ from the default; how the command runs is left out, and so
        are settings that do not apply (the synthetic set's sizes for other data, a built-in
        model's width for yours)."""
        idle = (() if self.dataset == "synthetic" else ("synthetic_train_size",
                                                        "synthetic_test_size"))
        idle += ("width",) if MODEL_SPEC.match(self.model) else ()
        lines = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if (tool not in f.metadata["tools"] or f.metadata["invocation"] or value is None
                    or f.name in idle
                    or value == "" == _default(f)  # unset text: said by its absence
                    or (f.metadata["resume"] and value == _default(f))):
                continue
            if isinstance(value, bool):
                lines.append(f"--{'' if value else 'no'}{f.name}")
            elif isinstance(value, tuple):
                lines.append(f"--{f.name}={','.join(value)}")
            else:
                lines.append(f"--{f.name}={value!r}" if isinstance(value, float)
                             else f"--{f.name}={value}")
        return lines


FIELDS = tuple(f.name for f in dataclasses.fields(RunConfig))


_SERVICE = re.compile(r"^(?:grpc://)?(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})$")


def class_weight_given(text: str) -> dict[str, float] | str:
    """--class_weight as given: "balanced", or {class: weight}; UsageError in one line."""
    if text == "balanced":
        return text
    try:
        given = json.loads(text)
    except ValueError:
        given = None
    if not isinstance(given, dict) or not all(
            isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w)
            and w >= 0 for w in given.values()):
        raise UsageError(f"--class_weight={text}: give balanced, or a JSON object of class "
                         "weights of 0 or more, like '{\"0\": 1.0, \"3\": 5.0}'")
    return {str(k): float(w) for k, w in given.items()}


def service_address(value: str) -> str:
    """grpc://HOST:PORT for --data_service=HOST:PORT (grpc:// may be given); UsageError for
    anything else."""
    found = _SERVICE.match(value)
    if not found or not 0 < int(found.group(2)) < 65536:
        raise UsageError(f"--data_service={value}: give the dispatcher as HOST:PORT, like "
                         "data-node:5050")
    return f"grpc://{found.group(1)}:{int(found.group(2))}"


def host_port(service: str) -> str:
    """HOST:PORT of a service_address (grpc://HOST:PORT), as a user writes it."""
    return service.removeprefix("grpc://")


def image_size(text: str | None) -> tuple[int, int] | None:
    """(height, width) of --image_size, None when unset or malformed."""
    match = IMAGE_SIZE.match(text or "")
    if not match or int(match.group(1)) < 1 or int(match.group(2) or 1) < 1:
        return None
    return int(match.group(1)), int(match.group(2) or match.group(1))


def _default(f):
    if f.name == "width":
        return 0
    return f.default


def _plain(value):
    return list(value) if isinstance(value, tuple) else value


def check_splits(cfg: RunConfig) -> None:
    """UsageError for --train_split or --eval_split of a data set without named splits, and
    for --parse without TFRecord files or the reverse."""
    source = datasets.source_of(cfg.dataset)
    for name in ("train_split", "eval_split"):
        if getattr(cfg, name) and not source.named_splits:
            raise UsageError(f"--{name}={getattr(cfg, name)}: only a tensorflow-datasets set "
                             f"(--dataset=tfds:NAME) has named splits, not --dataset="
                             f"{cfg.dataset}")
    if cfg.train_split and cfg.train_split == cfg.eval_split:
        raise UsageError(f"--train_split and --eval_split are both {cfg.train_split}: a run "
                         "is not judged on the examples it trained on; name two splits or two "
                         "slices (train[:95%], train[95%:])")
    if cfg.parse and not source.parsed:
        raise UsageError(f"--parse={cfg.parse} reads TFRecord files; --dataset={cfg.dataset} "
                         "is not --dataset=tfrecord:TRAIN_FILES,EVAL_FILES")
    if source.parsed and not MODEL_SPEC.match(cfg.parse):
        raise UsageError(f"--dataset={cfg.dataset}: give --parse=MODULE:FUNCTION, your "
                         "function from one serialized tf.train.Example to (features, target)"
                         + (f" (not {cfg.parse!r})" if cfg.parse else ""))


def check_validation_set(cfg: RunConfig) -> None:
    """UsageError for a --validation_set that cannot be: beside --validation_split, of a data
    set without named splits, or the training or the test split."""
    given = f"--validation_set={cfg.validation_set}"
    if cfg.validation_split:
        raise UsageError(f"{given} and --validation_split={cfg.validation_split:g}: give one, "
                         "a named split or a share of the training data held out")
    if not datasets.source_of(cfg.dataset).named_splits:
        raise UsageError(f"{given}: only a tensorflow-datasets set (--dataset=tfds:NAME) has "
                         f"named splits; for --dataset={cfg.dataset} hold a share of the "
                         "training data out with --validation_split")
    base = cfg.validation_set.split("[", 1)[0].strip()
    if cfg.validation_set in (cfg.train_split, cfg.eval_split):
        raise UsageError(f"{given}: that split is also --"
                         f"{'train' if cfg.validation_set == cfg.train_split else 'eval'}_split")
    training = cfg.train_split or "train"
    if base == training.split("[", 1)[0].strip() and (
            "[" not in cfg.validation_set or "[" not in training):
        raise UsageError(f"{given}: that is the training data; hold a share of it out with "
                         "--validation_split, or name another split")
    if base == "test" and not cfg.eval_split:
        raise UsageError(f"{given}: the test set is for the end (a tuning session never reads "
                         "it); name another split, or hold a share out with --validation_split")


def from_flags(flag_values: "flags.FlagValues", **overrides: typing.Any) -> RunConfig:
    """The RunConfig of the parsed flags (fields no flag sets keep their defaults)."""
    values = {f.name: flag_values[f.name].value for f in dataclasses.fields(RunConfig)
              if f.name in flag_values}
    return RunConfig(**{**values, **overrides})
