"""One request inside the engine (`Sequence`) and what a step produced for it (`Delta`).

Shared by every engine component (scheduler, KV planning, model runner,
output processor); it imports none of them, so they do not import each other
for their types.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import torch

    from moeflow.multimodal import ImagePrompt
    from moeflow.serving.detokenize import Detokenizer
    from moeflow.serving.kv_cache import KVBatch
    from moeflow.serving.sampling import SamplingParams

# a sampled token's (token id, logprob, top [(token id, logprob)]); a prompt's first token has no logprob
TokenLogprob = tuple[int, float, list[tuple[int, float]]]
PromptLogprob = tuple[int, "float | None", list[tuple[int, float]]]


@dataclass
class Delta:
    """What one step produced for one request (sent to the request's sink)."""

    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprob] | None = None  # on the first delta, when asked for
    finish_reason: str | None = None  # stop | length | abort | error
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass(eq=False)
class Sequence:
    """One prompt being served (identity semantics: sequences are compared by object)."""

    req_id: str
    model_name: str  # served name (metrics label)
    adapter: str | None
    tokens: list[int]  # prompt + generated
    num_prompt: int
    params: "SamplingParams"
    sink: Callable[[Delta], None]
    detok: "Detokenizer"
    arrival: float = field(default_factory=time.monotonic)
    kv: "KVBatch | None" = None  # the batch whose cache holds this sequence's tokens
    num_cached: int = 0  # tokens in the cache (pads excluded)
    generator: "torch.Generator | None" = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    prompt_lp: list[PromptLogprob] = field(default_factory=list)
    finished: bool = False
    image: "ImagePrompt | None" = None  # images in the prompt (multimodal models)
    queued: bool = False  # counted in the queued tokens until admitted or finished

    @property
    def out_ids(self) -> list[int]:
        return self.tokens[self.num_prompt:]

    @property
    def is_prefill(self) -> bool:
        return self.num_cached < self.num_prompt

    @property
    def text(self) -> str:
        return self.detok.text
