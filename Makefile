# Quick start: `make demo`, `make test`. `make setup` is idempotent.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)

.PHONY: setup demo test test-all bench clean

setup: $(STAMP)

# Byte-compile on both cores after installing (pip compiles one file at a time: over a minute
# of `make demo` on 2 cores). It must happen: with PYTHONDONTWRITEBYTECODE set, as on some hosts,
# every process -- each Ray worker -- would otherwise compile torch and transformers from
# source at every import. Files that do not compile (templates, other Pythons) stay source, as
# pip leaves them; packages' own tests/ folders are never imported. No pip self-upgrade.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --no-compile --disable-pip-version-check -e '.[test]'
	$(BIN)/python -m compileall -q -j 0 -x '/tests/' $(VENV)/lib > /dev/null || true
	rm -f $(VENV)/.installed-* && touch $@

demo: setup
	$(BIN)/moeflow demo

test: setup
	$(BIN)/python -m pytest -m "not slow" tests

test-all: setup
	$(BIN)/python -m pytest tests

clean:
	rm -rf demo-work work
