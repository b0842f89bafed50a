"""One request inside the engine core (`Sequence`), what a core step reports (`CoreOutput`,
`StepOutputs`) and what the front end hands a request's sink (`Delta`).

As vLLM V1 splits them: the core returns token ids (with the finish reasons it
can see: EOS, max_tokens, the context full, an abort or a failure) and the
logprobs it computed from the logits; the front end's output processor
(outputs.py) turns them into text, applies stop strings and records the
request metrics. The same dataclasses cross the process boundary when the
core runs in its own process (core.py), so the in-process engine and the core
process produce exactly the same messages.

Shared by every engine component (scheduler, KV planning, model runner,
output processor); it imports none of them, so they do not import each other
for their types.
"""

from __future__ import annotations

import functools
import operator
import time
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    import torch

    from moeflow.model.multimodal import ImagePrompt
    from moeflow.serving.adapter_tiers import TierStats
    from moeflow.serving.kv_cache import KVBatch
    from moeflow.serving.sampling import SamplingParams

# a sampled token's (token id, logprob, top [(token id, logprob)]); a prompt's first token has no logprob
TokenLogprob = tuple[int, float, list[tuple[int, float]]]
PromptLogprob = tuple[int, "float | None", list[tuple[int, float]]]


class Positional:
    """A dataclass that pickles as its class and its field values in order, not as a dict of
    field names per object: half the bytes and about half the time both ways for a step's 16
    outputs (by hand), on the messages that cross the core's socket every step."""

    __slots__ = ()

    def __reduce__(self):
        return type(self), _values(type(self))(self)


@functools.cache
def _values(cls: type) -> Callable[[Any], tuple]:
    """A dataclass's field values in order, as one tuple (its fields are two or more)."""
    return operator.attrgetter(*(f.name for f in fields(cls)))


@dataclass
class Delta:
    """What the front end sends a request's sink: new tokens with their text."""

    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprob] | None = None  # on the first delta, when asked for
    finish_reason: str | None = None  # stop | length | abort | error
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass
class CoreOutput(Positional):
    """One request's result of one core step: token ids, no text.

    `finish_reason` "stop" from the core means the last token is an EOS (it adds no text);
    stop strings are the front end's.
    """

    req_id: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprob] | None = None
    finish_reason: str | None = None
    error: str | None = None


@dataclass
class CoreStats:
    """The core's load after a step: requests running and waiting per served model, tokens
    cached for the running ones, adapters resident, the prefix cache's token counts, the
    adapter tiers' counters."""

    running: dict[str, int]
    waiting: dict[str, int]
    cached_tokens: int
    resident_loras: int
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache, since the start
    prefix_hits: int = 0  # of them found there
    adapters: "TierStats | None" = None  # evictions, host-memory hits, cold reads (adapter_tiers.py)
    kv_usage: float | None = None  # paged KV cache: blocks used / blocks (None: not paged)


@dataclass
class StepOutputs(Positional):
    """Everything one iteration of the core loop reports, in one message.

    Args:
        outputs: per-request results (several for one request when it also finished).
        admitted: requests that left the core's queue this iteration (queue time, queue limits).
        stats: the load after the iteration (None: unchanged since the last message).
        dead: why the core stopped serving, once it did.
    """

    outputs: list[CoreOutput] = field(default_factory=list)
    admitted: list[str] = field(default_factory=list)
    stats: CoreStats | None = None
    dead: str | None = None


@dataclass(eq=False)
class Sequence:
    """One prompt being served in the core (identity semantics: compared by object)."""

    req_id: str
    model_name: str  # served name (metrics label)
    adapter: str | None
    tokens: list[int]  # prompt + generated
    num_prompt: int
    params: "SamplingParams"
    arrival: float = field(default_factory=time.monotonic)
    kv: "KVBatch | None" = None  # the batch whose cache holds this sequence's tokens
    num_cached: int = 0  # tokens in the cache (pads excluded)
    generator: "torch.Generator | None" = None
    prompt_lp: list[PromptLogprob] = field(default_factory=list)
    finished: bool = False
    image: "ImagePrompt | None" = None  # images in the prompt (multimodal models)
    preempted: int = 0  # times its KV blocks were taken back (it computes its tokens again)

    @property
    def out_ids(self) -> list[int]:
        return self.tokens[self.num_prompt:]

    @property
    def is_prefill(self) -> bool:
        # a preempted sequence computes its prompt and its output so far again
        return self.num_cached < self.num_prompt or len(self.tokens) - self.num_cached > 1


Sink = Callable[[Delta], None]
