"""Starts N workers of the main job on this machine and streams their output.

    python -m tfmulti.launch --workers=2 -- --dataset=synthetic --width=16 --epochs=2

Each worker is `python -m tfmulti.main <your flags> --worker_hosts=localhost:P0,localhost:P1
--task_index=i` on localhost ports of a network of their own (--network=private: nobody
else reaches their servers; --network=host for the machine's), with the cores shared out
(--intra_op_threads).
On a GPU machine each worker gets GPUs of its own (CUDA_VISIBLE_DEVICES and --num_gpus):
--gpus_per_worker of them, by default the GPUs split evenly; --gpus_per_worker=0 keeps the
workers on the CPU.
Output lines are prefixed [worker i]. When a worker fails, the others are given `--grace`
seconds to stop by themselves, then terminated; the exit code is the first failure's.
SIGTERM or Ctrl-C stops every worker (they save a checkpoint: exit code 75), and killing the
launcher kills them.
For a real cluster, run one `python -m tfmulti.main ... --worker_hosts=... --task_index=i`
per host (or let a scheduler set TF_CONFIG): see the README.
"""
from tfmulti import cli

if __name__ == "__main__":
    cli.main("launch")
