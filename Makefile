# Two entry points (see README, Quickstart):  `make demo` runs the main job, `make test` the tests.
# Both build the virtual environment in .venv first, from this repository's own files only.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test test-all docs install clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip "setuptools>=68" wheel
	# The CPU build of torch first: it lies on these machines' disk, and a looser request
	# would otherwise pull a multi-GB CUDA wheel.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q --no-build-isolation -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/specforge plugins
	$(BIN)/specforge config show default

test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

test-all: $(STAMP)
	$(BIN)/python -m pytest -q

docs: $(STAMP)
	$(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) site build *.egg-info
