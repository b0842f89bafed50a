"""The HTTP API's errors, all in OpenAI's shape `{"error": {"message", "type", "param", "code"}}`.

`APIError` (an answer of the HTTP layer itself); the library's error kinds
(errors.py) mapped to statuses, in this one place (`status_of`); the app's exception
handlers (`install_handlers`: ours, invalid bodies named by field, unknown routes, bugs);
and an engine-side failure as a status (`error_status`) or a stream's last event
(`stream_error`). The routes are in api.py.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from moeflow.core.errors import UserError
from moeflow.serving.errors import (
    AdapterInUse,
    EngineBusy,
    EngineDead,
    ModelNotFound,
    RequestError,
    VerdictFailed,
    VerdictPending,
    failure_kind,
)
from moeflow.serving.schemas import UNSUPPORTED, ChatRequest, CompletionRequest, LoadLoraRequest

log = logging.getLogger("moeflow.serving")
_FIELDS = set(CompletionRequest.model_fields) | set(ChatRequest.model_fields)
_PARAMS = _FIELDS | set(LoadLoraRequest.model_fields)


class APIError(Exception):
    """An answer of the HTTP layer itself (the library raises errors.py's kinds instead)."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.kind = kind or _KINDS.get(status, "InternalServerError")


_KINDS = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
          404: "NotFoundError", 405: "BadRequestError",
          409: "ConflictError", 413: "BadRequestError", 429: "RateLimitError", 503: "ServiceUnavailableError"}
# the library's errors (moeflow.serving.errors) as HTTP statuses: the one place they are mapped.
# First match in the error's class order, so a subclass is listed before its base.
_STATUS: list[tuple[type[Exception], int]] = [(ModelNotFound, 404), (AdapterInUse, 409), (VerdictFailed, 403),
                                              (VerdictPending, 409), (RequestError, 400),
                                              (EngineBusy, 429), (EngineDead, 503)]


def status_of(kind: type[Exception]) -> int:
    """The HTTP status of a library error kind (500: a failure that is nobody's request's fault)."""
    return next((code for cls, code in _STATUS if issubclass(kind, cls)), 500)


def install_handlers(app: FastAPI) -> None:
    """Every error in OpenAI's shape: ours, invalid bodies, unknown routes, auth, and bugs."""

    @app.exception_handler(APIError)
    async def _api_error(_req: Request, exc: APIError):
        return _error(exc.status, exc.message, exc.param, exc.kind)

    async def _library(_req: Request, exc: Exception) -> JSONResponse:
        code = status_of(type(exc))
        return _error(code, str(exc), getattr(exc, "param", None), _KINDS.get(code, "InternalServerError"))

    for kind, _ in _STATUS:
        app.add_exception_handler(kind, _library)

    @app.exception_handler(UserError)
    async def _user_error(_req: Request, exc: UserError):
        named = str(exc).split(":")[0].split(" ")[0]  # our messages start with the field they are about
        return _error(400, str(exc), named if named in _PARAMS else None, "BadRequestError")

    @app.exception_handler(RequestValidationError)
    async def _invalid(_req: Request, exc: RequestValidationError):
        field, message = _describe(exc.errors())
        return _error(400, message, field, "BadRequestError")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_req: Request, exc: StarletteHTTPException):
        message = "route not found" if exc.status_code == 404 else str(exc.detail)
        response = _error(exc.status_code, message, None, _KINDS.get(exc.status_code, "BadRequestError"))
        response.headers.update(exc.headers or {})  # 405 keeps its Allow header
        return response

    @app.exception_handler(Exception)
    async def _bug(_req: Request, exc: Exception):
        log.exception("unhandled error")
        return _error(500, f"internal error: {type(exc).__name__}: {exc}", None, "InternalServerError")


def _loc(loc: tuple) -> list:
    """A pydantic error location without "body" and without union-branch tags (`list[...]`, `constrained-str`)."""
    return [p for i, p in enumerate(loc) if p != "body" and (isinstance(p, int) or i <= 1 or
                                                             not ("[" in p or "-" in p))]


def _describe(errs: Sequence[Any]) -> tuple[str, str]:
    """(param, one-line message) for pydantic errors; union branches of one field are merged."""
    if not errs:
        return "body", "invalid request body"
    first = errs[0]
    path = _loc(first["loc"])
    unknown = [".".join(str(p) for p in _loc(e["loc"])) for e in errs if e["type"] == "extra_forbidden"]
    if unknown:  # vLLM's answer when it rejects extras: a 400 naming them
        return unknown[0], (f"unknown field{'s' if len(unknown) > 1 else ''}: {', '.join(unknown[:8])} "
                            "(not implemented by this server; see /openapi.json)")
    if first["type"] == "json_invalid":
        return "body", f"body: not valid JSON ({first.get('ctx', {}).get('error', first['msg'])})"
    if not path:
        msg = first["msg"].removeprefix("Value error, ")
        named = msg.split(":")[0].split(".")[0]
        return (named, msg) if named in _FIELDS else ("body", f"body: {msg}")
    top = str(path[0])
    if top in UNSUPPORTED:
        return top, f"{top}: not supported by this server (accepted only at its default)"
    msgs = []
    for err in errs:
        loc = _loc(err["loc"])
        if loc and str(loc[0]) == top:
            msg = f"{'.'.join(str(p) for p in loc)}: {err['msg'].removeprefix('Value error, ')}"
            if msg not in msgs:
                msgs.append(msg)
    return top, "; or ".join(msgs[:4])


def _error(status: int, message: str, param: str | None, kind: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}},
                        status_code=status)


def error_status(error: str | None) -> int:
    """An engine-side failure's status: 404 for an adapter unloaded meanwhile, 503 for a dead engine."""
    return status_of(failure_kind(error))


def stream_error(error: str | None) -> dict:
    """An engine-side failure as the last event of a stream, in OpenAI's error shape."""
    code = error_status(error)
    kind = _KINDS.get(code, "InternalServerError")
    return {"error": {"message": error, "type": kind, "param": "model" if code == 404 else None, "code": code}}

