# Quick start: `make demo`, `make test`. `make setup` is idempotent.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
HASH := $(shell cat pyproject.toml | sha1sum | cut -c1-12)
STAMP := $(VENV)/.installed-$(HASH)
TEST_STAMP := $(VENV)/.installed-test-$(HASH)

.PHONY: setup setup-test demo lint test test-unit test-all clean

setup: $(STAMP)
setup-test: $(TEST_STAMP)

# `make demo` installs moeflow alone; `make test` adds the test extras (pytest, the OpenAI
# client, lm-eval, schemathesis: ~1 minute more on 2 cores) on top of the same .venv.
# Byte-compile on both cores after installing (pip compiles one file at a time: over a minute
# of `make demo` on 2 cores). It must happen: with PYTHONDONTWRITEBYTECODE set, as on some hosts,
# every process -- each Ray worker -- would otherwise compile torch and transformers from
# source at every import. Files that do not compile (templates, other Pythons) stay source, as
# pip leaves them; packages' own tests/ folders are never imported. No pip self-upgrade.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --no-compile --disable-pip-version-check -e .
	$(BIN)/python -m compileall -q -j 0 -x '/tests/' $(VENV)/lib > /dev/null || true
	rm -f $(VENV)/.installed-* && touch $@

# The monitoring tests run Prometheus' own `promtool` (no PyPI package ships it): Debian's
# `prometheus` package brings it, installed here when missing and this user may (root, apt-get).
$(TEST_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet --no-compile --disable-pip-version-check -e '.[test]'
	command -v promtool > /dev/null || { command -v apt-get > /dev/null && [ "$$(id -u)" = 0 ] && \
	  { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus > /dev/null 2>&1 || \
	    { apt-get update -qq > /dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus > /dev/null 2>&1; }; }; } || \
	  echo "promtool not found and not installable here: tests/test_monitoring.py needs it (apt-get install prometheus)"
	$(BIN)/python -m compileall -q -j 0 -x '/tests/' $(VENV)/lib > /dev/null || true
	touch $@

demo: setup
	$(BIN)/moeflow demo

# Lint (ruff: errors, import order) and types (mypy) of the product's code; part of `make test`.
lint: setup-test
	$(BIN)/ruff check moeflow tasks workflows
	$(BIN)/mypy

test: lint
	$(BIN)/python -m pytest -m "not slow" tests

# The pure tier: no Ray, MLflow, HTTP or subprocess (tests/conftest.py marks the rest
# `integration`); under two minutes.
test-unit: setup-test
	$(BIN)/python -m pytest -m "not slow and not integration" tests

test-all: setup-test
	$(BIN)/python -m pytest tests

clean:
	rm -rf demo-work work
