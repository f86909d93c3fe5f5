# Each target sets up .venv itself: a fresh clone needs only python3 (3.10-3.12) and make.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test soak container-test cluster-test clean tcmalloc

# uv installs in about a third of pip's time (TensorFlow's wheels: 30 s instead of 100 s on
# 2 cores); where uv cannot be had or cannot reach the index (a pip.conf-only mirror), pip.
$(STAMP): setup.py
	$(PYTHON) -m venv $(VENV)
	{ $(PY) -m pip install --quiet uv && \
	  $(PY) -m uv pip install --quiet --python $(PY) --compile-bytecode -e '.[test]'; } || \
	{ $(PY) -m pip install --quiet --upgrade pip && $(PY) -m pip install --quiet -e '.[test]'; }
	touch $(STAMP)

# TCMalloc, which make run and the processes tfmulti starts preload when it is installed
# (docs/performance.md, "The memory allocator"): installed with apt-get when missing and
# possible (root); else a line says so.
FIND_TCMALLOC = $(PYTHON) -c 'from tfmulti.distribution import allocator; print(allocator.find_tcmalloc() or "")'
tcmalloc:
	@test -n "$$($(FIND_TCMALLOC))" || { echo "make: installing TCMalloc (apt-get install libtcmalloc-minimal4)"; \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get install -y -qq libtcmalloc-minimal4 >/dev/null 2>&1 || \
	  { timeout 300 apt-get update -qq && apt-get install -y -qq libtcmalloc-minimal4; } >/dev/null 2>&1 || \
	  echo "make: could not install TCMalloc (apt-get needs root and Debian's packages): glibc's malloc is used (the tests pass either way; docs/performance.md)"; }

# TCMalloc preloaded where it is installed (docs/performance.md, "The memory allocator").
PRELOAD = LD_PRELOAD="$$($(FIND_TCMALLOC))" TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD=1099511627776

# The main job on the embedded offline data set, 2 CPU replicas, a few minutes.
run: $(STAMP) tcmalloc
	$(PRELOAD) $(PY) -m tfmulti.main --flagfile=flags/quickstart.cfg

# ruff (ruff.toml) on the whole tree, then the suite. The tests marked `soak` (too slow for
# here) run in `make soak`. Three pytest workers on 2 cores (with two, the tests' processes,
# which wait for each other and for timeouts, kept 1.7 cores busy; with three about 1.95), each
# test file on one of them (a file's trained runs are shared through its fixtures).
test: $(STAMP) tcmalloc
	$(PY) -m ruff check --quiet .
	$(PY) -m pytest -q -m "not soak" -n 3 --dist loadfile --no-loadscope-reorder --max-worker-restart=0 --durations=12 tests

# What the suite cannot afford: long runs, repeated multi-worker runs, kill -9 at chosen
# moments, a tuning session killed 3 times.
soak: $(STAMP) tcmalloc
	$(PY) -m testing.soak

# The Docker image built and run for real: needs root (it installs and starts Docker's engine
# if none runs, and makes a Debian stand-in for the TensorFlow base image once, cached), then
# runs its checks in containers and the fault tests. See docs/containers.md.
container-test: $(STAMP) tcmalloc
	$(PY) -m testing.container
	$(PY) -m pytest -q -p no:cacheprovider testing/container_faults.py

# A real Slurm on this machine (root): installs it if missing, starts its daemons for two
# logical nodes, runs srun and sbatch checks, stops everything it started (docs/slurm.md).
cluster-test: $(STAMP)
	$(PY) -m testing.cluster

clean:
	rm -rf $(VENV) runs .pytest_cache
