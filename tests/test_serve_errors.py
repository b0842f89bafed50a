"""The serving library's seams: errors without HTTP (mapped once in api_errors.py), the engine's
components (held, not inherited), KV planning as a pure function of lengths and group keys."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest

from moeflow.serving import kv_plan
from moeflow.serving.api_errors import status_of
from moeflow.serving.engine import Engine
from moeflow.serving.engine_core import EngineCore
from moeflow.serving.errors import (STOPPED, UNLOADED, AdapterInUse, EngineBusy, EngineDead, ModelNotFound,
                                    RequestError, failure_kind)
from moeflow.serving.runner import ModelRunner

SERVING = Path(__file__).resolve().parents[1] / "moeflow" / "serving"
LIBRARY = ["engine", "request", "scheduler", "kv_cache", "kv_plan", "runner", "sampling", "outputs",
           "detokenize", "errors", "service", "delivery", "adapters"]


@pytest.mark.parametrize("kind, status", [(ModelNotFound, 404), (AdapterInUse, 409), (RequestError, 400),
                                          (EngineBusy, 429), (EngineDead, 503), (RuntimeError, 500)])
def test_each_library_error_has_one_status(kind, status):
    assert status_of(kind) == status


def test_an_engine_side_failure_reads_back_as_its_kind():
    assert failure_kind(f"{UNLOADED}: The model `a` does not exist") is ModelNotFound
    assert failure_kind(f"{STOPPED}: 3 engine steps in a row failed") is EngineDead
    assert failure_kind("decode failed: kernel fault") is RuntimeError
    assert failure_kind(None) is RuntimeError


@pytest.mark.parametrize("module", LIBRARY)
def test_the_library_knows_nothing_of_http(module):
    tree = ast.parse((SERVING / f"{module}.py").read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    http = ("moeflow.serving.api", "moeflow.serving.api_errors", "moeflow.serving.middleware")
    assert not [n for n in names if n.split(".")[0] in ("fastapi", "starlette") or n in http]


def test_the_engine_holds_its_runner():
    assert not issubclass(Engine, ModelRunner) and not issubclass(EngineCore, ModelRunner)
    assert "core" in Engine.__init__.__code__.co_names  # the front end holds a core
    assert "runner" in EngineCore.__init__.__code__.co_names  # which holds the runner


def _seq(n: int, adapter: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(num_prompt=n, adapter=adapter)


def test_fresh_prompts_prefill_together_per_key_and_compatible_length():
    seqs = [_seq(500), _seq(10), _seq(12, "a"), _seq(40), _seq(8)]
    groups = kv_plan.prefill_groups(seqs, lambda s: s.adapter)
    lengths = sorted(sorted(s.num_prompt for s in g) for g in groups)
    assert lengths == [[8, 10, 40], [12], [500]]  # 500 would pad the short ones past 2x: alone
    assert kv_plan.compatible_widths(10, 84) and not kv_plan.compatible_widths(10, 85)


@pytest.mark.parametrize("header, status", [(b"Bearer k3y", 200), (b"bearer k3y", 200), (b"BEARER  k3y", 200),
                                            (b"Bearer nope", 401), (b"k3y", 401), (b"Basic k3y", 401)])
def test_the_bearer_scheme_is_case_insensitive(header, status):
    import asyncio

    from moeflow.serving.middleware import Gate

    sent = []

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "path": "/v1/models", "headers": [(b"authorization", header)]}
    asyncio.run(Gate(app, 1 << 20, "k3y")(scope, receive, send))
    assert sent[0]["status"] == status
