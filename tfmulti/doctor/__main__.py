"""Preflight: says what is wrong before a long run starts, with the main job's flags.

    python -m tfmulti.doctor --num_gpus=2 --model_dir=runs/big --data_dir=/data/fashion
    docker run --gpus all ... --entrypoint python3 tfmulti -m tfmulti.doctor --num_gpus=2

Reports the devices (GPUs with memory and compute capability, logical CPU replicas), the
TensorFlow, CUDA, cuDNN and NCCL versions, the strategy the main job would pick, and runs a
small all-reduce across every replica under --doctor_timeout, checking its sum and measuring
its bandwidth. Then /dev/shm (in containers), --model_dir and the data set. Exit 0 when the
flags would run; otherwise one `problem:` line per problem and exit 1. Nothing is written.
"""
from tfmulti import cli

if __name__ == "__main__":
    cli.main("doctor")
