# Quick start: `make demo`, `make test`. `make setup` is idempotent.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)

.PHONY: setup demo test test-all bench clean

setup: $(STAMP)

# the venv's own pip is enough (no self-upgrade); installs byte-compile (pip's default): with
# PYTHONDONTWRITEBYTECODE set, as on some hosts, nothing else would, and every Ray worker would
# compile torch/transformers from source at each import
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[test]'
	rm -f $(VENV)/.installed-* && touch $@

demo: setup
	$(BIN)/moeflow demo

test: setup
	$(BIN)/python -m pytest -m "not slow" tests

test-all: setup
	$(BIN)/python -m pytest tests

clean:
	rm -rf demo-work work
