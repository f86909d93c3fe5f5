"""The levels of testing beyond `make test` (tests/), each run from the repository's root:

    python -m testing.soak        make soak: long runs, kill -9 at chosen moments, soak tests
    python -m testing.container   make container-test (root): the image built and run in Docker
    python -m testing.cluster     make cluster-test (root): a real Slurm on this machine

harness.py holds the step lines the container and cluster checks share; container_faults.py
the container's fault tests (pytest); tune_memory.py the tuner's memory probe soak runs.
"""
