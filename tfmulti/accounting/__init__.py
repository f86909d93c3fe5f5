"""Where a run's time and work go: the model's FLOPs counted from its traced step and the
devices' matmul peak (flops.py, for model FLOPs utilization), the clocks inside a step and the
straggler rule (timing.py)."""
