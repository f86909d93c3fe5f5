"""Data: where a data set comes from (sources.load above every source), the checks every
source's arrays go through, and the per-replica pipelines (pipeline.py)."""
