"""Command-line flags, defined once here and read only by the entry points.

Entry points turn FLAGS into plain values and pass those to the library. `parse_or_exit` is
their flags parser: a bad flag gives one line and exit code 1, not a usage dump.
"""
import sys

from absl import flags

from tfmulti import data, hparams, models

FLAGS = flags.FLAGS

# Devices
flags.DEFINE_integer("num_gpus", None, "GPUs to train on: N, -1 for all, 0 for the CPU. "
                     "Unset: all GPUs there are, or the CPU if there are none.")
flags.DEFINE_list("gpus", None, "Which GPUs to train on: --gpus=0,2 "
                  "(the others stay untouched). Unset: the first --num_gpus. The numbers are "
                  "nvidia-smi's (tfmulti sets CUDA_DEVICE_ORDER=PCI_BUS_ID unless it is set), "
                  "counted within CUDA_VISIBLE_DEVICES when that is set.")
flags.DEFINE_bool("gpu_memory_growth", False, "Take GPU memory as it is needed instead of "
                  "nearly all of it at start-up (for several processes on one GPU; always "
                  "on in tuning trials and the doctor's probe).")
flags.DEFINE_integer("cpu_replicas", 0, "Split the CPU into N logical devices and train N "
                     "replicas on them (for machines without GPUs). 0: the CPU is one device.")
flags.DEFINE_integer("intra_op_threads", 0, "Threads per op; 0 picks cores / replicas for "
                     "CPU replicas, TensorFlow's default otherwise.")
flags.DEFINE_integer("inter_op_threads", 0, "Ops run at once; 0 picks 2 x replicas for CPU "
                     "replicas, TensorFlow's default otherwise.")
flags.DEFINE_string("worker_hosts", None, "Several machines: every worker's host:port, comma "
                    "separated, the same on each; with --task_index. A TF_CONFIG already set "
                    "(by a scheduler) is used when this is not given.")
flags.DEFINE_integer("task_index", 0, "This worker's place in --worker_hosts (0 is the chief).")
flags.DEFINE_float("worker_timeout", 600.0, "Several machines: seconds to wait for every worker "
                   "to join; then the run (or the doctor's check) stops naming who is missing.")
flags.DEFINE_integer("workers", 2, "tfmulti.launch: worker processes to start on this machine.")
flags.DEFINE_integer("gpus_per_worker", None, "tfmulti.launch: GPUs each worker gets for its "
                     "own (CUDA_VISIBLE_DEVICES and --num_gpus); default: the GPUs split "
                     "evenly, none on a machine without GPUs; 0 keeps the workers on the CPU.")
flags.DEFINE_float("grace", 60.0, "tfmulti.launch: seconds the other workers get to stop by "
                   "themselves after one fails (or the launcher is stopped) before they are "
                   "killed.")
# Batch and learning rate
flags.DEFINE_integer("per_replica_batch_size", None, "Examples per replica per step (default "
                     f"{hparams.DEFAULT_PER_REPLICA_BATCH}). Give this or --global_batch_size.")
flags.DEFINE_integer("global_batch_size", None, "Examples per step over all replicas; must "
                     "divide by the replica count. Give this or --per_replica_batch_size.")
flags.DEFINE_float("base_lr", 0.1, "Learning rate per 256 examples; scaled to the global batch "
                   "by --lr_scaling.")
flags.DEFINE_enum("lr_scaling", "linear", hparams.LR_SCALINGS, "How the rate grows with the "
                  "global batch: linear (base_lr x batch/256), sqrt, or none.")
flags.DEFINE_float("warmup_epochs", 0.0, "Epochs of linear learning-rate warm-up (Goyal et al.).")
flags.DEFINE_integer("epochs", 10, "Training epochs.")
flags.DEFINE_integer("steps_per_call", 10, "Training steps per tf.function call (and per "
                     "progress-bar update).")
# Data
flags.DEFINE_enum("dataset", "fashion_mnist", data.DATASETS, "fashion_mnist: the real data set "
                  "(tensorflow-datasets or --data_dir); synthetic: the embedded offline stand-in.")
flags.DEFINE_string("data_dir", None, "A directory with the four Fashion-MNIST IDX files "
                    "(train-images-idx3-ubyte.gz, ...), or a tensorflow-datasets data_dir.")
flags.DEFINE_integer("synthetic_train_size", 60000, "Training images of --dataset=synthetic.")
flags.DEFINE_integer("synthetic_test_size", 10000, "Test images of --dataset=synthetic.")
# Model
flags.DEFINE_enum("model", "resnet18", models.MODELS, "The book's ResNet-18 variant or LeNet.")
flags.DEFINE_integer("width", 0, "Channels of the first stage (0: the book's, 64 for resnet18, "
                     "20 for lenet); smaller trains faster.")
flags.DEFINE_enum("dtype", "float32", ["float32", "mixed_bfloat16", "mixed_float16"],
                  "Compute precision; the mixed policies keep float32 weights.")
flags.DEFINE_bool("sync_batchnorm", False, "Batch-norm statistics over the global batch "
                  "(all replicas) instead of each replica's slice.")
flags.DEFINE_integer("seed", 0, "Seed for weights, data order and the synthetic data set.")
# Data parallelism from scratch (python -m tfmulti.scratch)
flags.DEFINE_enum("allreduce", "naive", ["naive", "ring"], "How tfmulti.scratch sums gradients: "
                  "naive (all onto the first device, the book's) or ring (reduce-scatter, then "
                  "all-gather, one chunk per step to the next device).")
# Tuning sessions (python -m tfmulti.tune)
flags.DEFINE_enum("tuner", "random", ["random", "bayesian", "hyperband"], "tune: the search "
                  "(hyperband spends --epochs as the budget).")
flags.DEFINE_integer("max_trials", 10, "tune: trials in the session (random, bayesian).")
flags.DEFINE_integer("max_retries_per_trial", 1, "tune: reruns of a trial that crashes before "
                     "it is marked failed and the search goes on.")
flags.DEFINE_list("tune_batch_sizes", ["64", "128", "256"], "tune: per-replica batch choices.")
flags.DEFINE_list("tune_lr_range", ["0.01", "1.0"], "tune: base_lr range (per 256 examples), "
                  "searched on a log scale.")
flags.DEFINE_list("tune_lr_scalings", ["linear", "sqrt"], "tune: scaling rules to try.")
flags.DEFINE_list("tune_warmup_epochs", ["0", "1"], "tune: warm-up choices, in epochs.")
flags.DEFINE_integer("parallel_trials", 1, "tune: trials run at once, each on an equal share of "
                     "the devices (one GPU each with --num_gpus=K, or a group of CPU replicas "
                     "pinned to its cores), through keras-tuner's chief oracle and K workers.")
# Preflight (python -m tfmulti.doctor)
flags.DEFINE_float("doctor_timeout", 60.0, "doctor: seconds the test all-reduce may take before "
                   "it counts as hung.")
flags.DEFINE_float("doctor_allreduce_mb", 32.0, "doctor: megabytes per replica in the test "
                   "all-reduce.")
# Benchmarks (python -m tfmulti.bench)
flags.DEFINE_integer("matrix_size", 0, "bench parallel/overlap: matrix side (0: the book's 4000 "
                     "on GPUs, 1024 on the CPU).")
flags.DEFINE_integer("products", 50, "bench parallel/overlap: matrix products per device.")
flags.DEFINE_integer("repeats", 5, "bench: timed repeats of each figure (median and spread).")
flags.DEFINE_integer("warmup", 1, "bench: untimed runs before timing.")
flags.DEFINE_integer("steps", 10, "bench scaling: training steps timed per repeat.")
flags.DEFINE_string("out", None, "bench: where the JSON (and PNG) go; default runs/<time>-bench-"
                    "<command>/.")
# Output
flags.DEFINE_string("model_dir", None, "Where the run's report, checkpoints and model go. "
                    "Unset: runs/<time>-<model>-<dataset>.")
flags.DEFINE_bool("overwrite", False, "Replace an earlier run in --model_dir (the same run "
                  "there is resumed without it).")
flags.DEFINE_integer("checkpoint_steps", 100, "Save a checkpoint every N training steps (and "
                     "at every epoch's end); 0: only at epoch ends.")
flags.DEFINE_bool("deterministic", False, "Seed everything and make TensorFlow's ops "
                  "deterministic: the same command gives the same weights, resumed or not.")
flags.DEFINE_bool("show_replicas", False, "Print one parameter's first values on every replica "
                  "after building the model (the same copy on each device).")


def parse_or_exit(argv):
    """absl flags parser for app.run: one clear line and exit 1 on a bad flag."""
    try:
        return FLAGS(argv)
    except flags.Error as e:
        sys.exit(f"tfmulti: error: {e}")
