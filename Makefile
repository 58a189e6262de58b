# Quick start: `make run` (set up + main job), `make test` (set up + tests).
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
TORCH_PIN := torch==2.13.0
CONFIG ?= conf/local.toml
# More pytest arguments for `make test`, e.g. PYTEST_ARGS="-n 2 --dist loadgroup" (pytest-xdist; modules that
# share a Ray instance or an emulated subnet carry an xdist_group mark). The default is one process: on two
# cores a second one gains little (the daemons already fill them) and loaded heartbeats grow flaky.
PYTEST_ARGS ?=

.PHONY: setup run test test-unit bench docs docs-figures clean

# Idempotent: creates .venv once; installs the pinned CPU torch only when the
# environment has none (an unpinned torch would pull GBs of CUDA wheels).
setup: $(VENV)/.hmp-setup

$(VENV)/.hmp-setup: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -e ".[test]"
	touch $@

run: setup
	$(VENV)/bin/hmp-launch $(CONFIG)

test: setup
	$(PY) -m pytest -q $(PYTEST_ARGS)

# The pure tier alone (no sockets, threads or processes): under a minute.
test-unit: setup
	$(PY) -m pytest -q tests/unit

bench: setup
	$(PY) bench/transport.py
	$(PY) bench/ps.py
	$(PY) bench/allreduce.py
	$(PY) bench/reply.py
	$(PY) bench/hogbatch.py
	$(PY) bench/hfta.py
	$(PY) bench/placement.py
	$(PY) bench/pipeline.py

# Regenerate docs/config.md's configuration reference from hmp/config/schema.py.
docs: setup
	$(PY) -m hmp.config.reference --update docs/config.md

# Redraw the figures the docs show (benchmarks otherwise write into runs/bench/; the real GADGET replay needs root).
docs-figures: setup
	$(PY) bench/gadget.py --out docs
	$(PY) bench/hogbatch.py --out docs

clean:
	rm -rf $(VENV) build *.egg-info runs
