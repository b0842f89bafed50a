# Quick start: `make demo`, `make test`. `make setup` is idempotent.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)

.PHONY: setup demo test test-all bench clean

setup: $(STAMP)

# --no-compile: byte-compiling all of torch/ray/transformers up front costs over a minute on
# 2 cores; Python compiles what is imported, on first import (the venv's own pip is enough)
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --no-compile --disable-pip-version-check -e '.[test]'
	rm -f $(VENV)/.installed-* && touch $@

demo: setup
	$(BIN)/moeflow demo

test: setup
	$(BIN)/python -m pytest -m "not slow" tests

test-all: setup
	$(BIN)/python -m pytest tests

clean:
	rm -rf demo-work work
