# Set-up and the two project commands. Override TORCH_SPEC for a GPU build, e.g.
#   make test TORCH_SPEC='torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128'
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
# torchtitan without its trainer's requirements; the `torchtitan` extra has what its models need.
TORCHTITAN_SPEC ?= torchtitan==0.3.0
# Tests run in TEST_WORKERS processes side by side (pytest-xdist; a module whose tests share one
# costly fixture stays on one worker by its `xdist_group` mark), then the multi-rank ones (`ranks`),
# one at a time: their ranks already fill the cores, and a collective waits for its slowest rank.
TEST_WORKERS ?= auto
PY := $(VENV)/bin/python
STAMP := $(VENV)/.actplan-installed

.PHONY: demo test lint bench peers gpu setup clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet $(TORCH_SPEC)
	$(PY) -m pip install --quiet -e '.[dev]'
	$(PY) -m pip install --quiet --no-deps $(TORCHTITAN_SPEC)
	touch $(STAMP)

# The first look: every preset on dense long, in fewer rounds than `actplan bench` takes by
# default (its full run, with the overhead rounds against torch.utils.checkpoint: `make bench`
# for dense small, or `actplan bench` itself), so set-up and table stay within 3 minutes.
demo: $(STAMP)
	$(VENV)/bin/actplan bench --repeats 5 --warmup 1 --overhead-repeats 0

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests bench conftest.py

test: lint
	$(VENV)/bin/pytest -q -n $(TEST_WORKERS) --dist loadgroup -m "not ranks"
	$(VENV)/bin/pytest -q -m ranks

bench: $(STAMP)
	$(VENV)/bin/actplan bench --size small --json bench/results/bench_dense_small.json --markdown bench/results/bench_dense_small.md
	$(PY) -m bench.goals bench/results/bench_dense_small.json

peers: $(STAMP)
	$(PY) -m bench.peers

# Everything that needs CUDA, at most 7 minutes on one H200; installs nothing (see README, "On a GPU").
gpu:
	$(if $(wildcard $(PY)),$(PY),$(PYTHON)) -m bench.gpu.suite

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
