"""The messages between a replica and its engine core process (core.py), typed.

Each crosses the socket pickled (`multiprocessing.connection` framing). The
replica sends `Start` once, then `AddRequest`, `Abort`, `Call` and `Shutdown`;
the core answers `Ready` (or `Failed`) once, then one `StepOutputs`
(request.py) per loop iteration that produced anything, a `Reply` per `Call`,
and an `ExpertWindow` whenever its expert-load window closes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moeflow.serving.request import StepOutputs
from moeflow.serving.sampling import SamplingParams

__all__ = ["Abort", "AddRequest", "Call", "CoreInfo", "ExpertWindow", "Failed", "Ready", "Reply", "Shutdown",
           "Start", "StepOutputs"]


# ---------------------------------------------------------------------- replica -> core

@dataclass
class Start:
    settings: dict  # ServeSettings.model_dump()
    specs: dict  # adapter name -> AdapterSpec (local paths)


@dataclass
class AddRequest:
    req_id: str
    prompt_ids: list[int]
    params: SamplingParams
    adapter: str | None
    model_name: str


@dataclass
class Abort:
    req_id: str


@dataclass
class Call:
    """An adapter change or a question (EngineCore.OPS / QUESTIONS), answered by a `Reply`."""

    call_id: int
    op: str
    args: tuple


@dataclass
class Shutdown:
    pass


# ---------------------------------------------------------------------- core -> replica

@dataclass
class CoreInfo:
    """What the replica needs to know of the core's model and engine."""

    pid: int
    max_model_len: int
    vocab_size: int
    config: dict  # EngineConfig fields
    image_text: bool
    experts: dict  # RemoteExperts' fields


@dataclass
class Ready:
    info: CoreInfo


@dataclass
class Failed:
    reason: str  # one line: the replica raises it as its start-up failure


@dataclass
class Reply:
    call_id: int
    ok: bool
    value: Any  # the answer, or the exception


@dataclass
class ExpertWindow:
    counts: list[list[int]]  # a closed window's tokens per [layer][expert]
