"""The book's automatic-parallelism experiments, a scaling sweep of the main job, and its
predicted scaling.

    python -m tfmulti.bench parallel --num_gpus=2            # two devices at once
    python -m tfmulti.bench overlap --num_gpus=1             # compute overlapped with copies
    python -m tfmulti.bench scaling --num_gpus=8             # 1, 2, 4, 8 replicas
    python -m tfmulti.bench parallel --cpu_replicas=2        # the same on logical CPU devices
    python -m tfmulti.bench predict --inter_link=eth100      # N devices on M machines, predicted

parallel and overlap: bench/experiments.py; scaling: bench/scaling.py; predict:
bench/advise.py (the doctor's prediction too). The JSON (with flags, devices and
versions) and, for scaling, a PNG plot go to --out.
"""
from tfmulti import cli

if __name__ == "__main__":
    cli.main("bench")
