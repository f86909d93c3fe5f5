"""Data parallelism from scratch: the book's LeNet, every copy and every sum written out.

    python -m tfmulti.scratch --cpu_replicas=2 --dataset=synthetic
    python -m tfmulti.scratch --num_gpus=2 --allreduce=ring

No tf.distribute: each device gets a copy of the parameters, a share of each minibatch, and
sums the gradients with the others (the book's naive way, or a ring). The tool is
tfmulti/tools/scratch.py, the lesson itself tfmulti/scratch/lesson.py.
"""
from tfmulti import cli

if __name__ == "__main__":
    cli.main("scratch")
