"""Why the serving library refuses a request, in its own terms (no HTTP here).

`Service` and the engine raise these; the HTTP layer (api_errors.py) maps each kind
to a status code in one place. `param` names the request field at fault
(OpenAI's error shape carries it), or None.

A request that fails on the engine thread ends with an error `Delta` instead
of an exception; its message starts with one of the prefixes below, and
`failure_kind` reads it back.
"""

from __future__ import annotations

from moeflow.core.errors import UserError

UNLOADED = "adapter unloaded"  # the error of a sequence whose adapter went away meanwhile
STOPPED = "the engine stopped serving"  # the error of every request once the engine is dead


class RequestError(UserError):
    """A request the server cannot answer as asked: a bad field value."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message, self.param = message, param


class ModelNotFound(RequestError):
    """The named model, or the adapter to unload, is not served here."""


class AdapterInUse(RequestError):
    """An adapter cannot be unloaded while requests use it."""


class VerdictFailed(RequestError):
    """A registered model version whose gate verdict is FAIL (moeflow.evaluation.verdict)."""


class VerdictPending(RequestError):
    """A registered model version not gated yet: no verdict to serve it on."""


class EngineBusy(UserError):
    """The queue is full: retry later."""


class EngineDead(RuntimeError):
    """The engine cannot serve any more (the replica must be replaced)."""


def failure_kind(error: str | None) -> type[Exception]:
    """The kind of failure an engine-side error message reports (see the prefixes above)."""
    if (error or "").startswith(UNLOADED):
        return ModelNotFound
    if STOPPED in (error or ""):
        return EngineDead
    return RuntimeError
