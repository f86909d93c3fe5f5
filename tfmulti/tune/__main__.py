"""Tuning sessions: keras-tuner finds the batch size and learning rate for your devices.

    python -m tfmulti.tune --flagfile=flags/tune.cfg
    python -m tfmulti.tune --flagfile=flags/tune_smoke.cfg        # CPU, minutes

Large batches need larger learning rates (Goyal et al. 2017: the linear scaling rule with
gradual warm-up, which breaks down at very large batches). Each trial trains the main job's
model with the main job's engine on every device, at learning rate
base_lr x rule(global_batch / 256); the search picks the per-replica batch, base_lr, the rule
and the warm-up. The session lives in --model_dir: rerun the same command after an
interruption and finished trials are kept, the unfinished one runs again. It ends with a table
(printed and trials.csv), a plot (accuracy.png: accuracy against learning rate, coloured by
batch) and best.cfg, a flagfile `python -m tfmulti.main --flagfile=...` runs as is.

--parallel_trials=K runs K trials at once, each on an equal share of the devices, through
keras-tuner's distributed mode (tune/parallel_trials.py). The same program is also a plain
keras-tuner chief or worker when KERASTUNER_TUNER_ID/_ORACLE_IP/_ORACLE_PORT are set.

The tool is tfmulti/tools/tune.py; the library tfmulti/tune/.
"""
from tfmulti import cli

if __name__ == "__main__":
    cli.main("tune")
