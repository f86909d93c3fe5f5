"""The doctor's checks (`python -m tfmulti.doctor`): the machine, the probes, the prediction."""
