"""Sampling parameters, their validation, and the sampler (a row alone, or a step's rows together).

Validation follows vLLM's `SamplingParams`: every field is checked as it will
be computed (float32 on the model's logits), so a value that passes can never
produce NaN probabilities or an empty distribution inside a batched step.

The order is vLLM's: `min_tokens` (EOS masked), then the penalties on the raw
logits (`repetition_penalty` over prompt and output tokens, as transformers'
RepetitionPenaltyLogitsProcessor; `presence_penalty`/`frequency_penalty` over
output tokens, OpenAI's formula), then greedy argmax, or temperature, `min_p`,
`top_k` and `top_p` before drawing. Logprobs are of the raw logits (vLLM's default).

Axis legend: V vocab.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from moeflow.core.errors import UserError

# below this a temperature is greedy: logits / T overflows float32 (max ~3.4e38) for T ~< 1e-37,
# and long before that softmax is one-hot anyway (vLLM clamps to 1e-2 for the same reason)
MIN_TEMPERATURE = 1e-5
SEED_MIN, SEED_MAX = -(2 ** 63), 2 ** 64 - 1  # what torch.Generator.manual_seed accepts
MAX_LOGPROBS = 20
MAX_STOPS = 16
TOP_P_FIRST = 1024  # top_p looks among this many most likely tokens before sorting them all
CPU_GROUP_LOGITS = 1 << 18  # sample_rows on a CPU: rows at a time, up to 1 MiB of float32 logits
MAX_REPETITION_PENALTY = 100.0  # logits of ~±30 stay finite in float32 at any penalty up to this


@dataclass
class SamplingParams:
    """Per-request generation settings (OpenAI fields)."""

    max_tokens: int = 16
    temperature: float = 0.0  # 0 (or below MIN_TEMPERATURE): greedy
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None  # top-k logprobs per generated token
    prompt_logprobs: int | None = None  # echo: logprobs of the prompt tokens
    ignore_eos: bool = False
    top_k: int = 0  # 0 or -1: every token (vLLM)
    min_p: float = 0.0  # drop tokens below min_p x the top token's probability
    repetition_penalty: float = 1.0  # > 1 discourages tokens of the prompt and output
    presence_penalty: float = 0.0  # subtracted once from every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    min_tokens: int = 0  # EOS cannot end the output before this many tokens

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    @property
    def penalised(self) -> bool:
        """True when the logits change before the greedy/sampling choice."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0 or self.min_tokens > 0)

    def check(self) -> None:
        """Raise UserError naming the first field that cannot be computed."""
        _int("max_tokens", self.max_tokens, 1, None)
        _float("temperature", self.temperature, 0.0, 2.0, low_open=False)
        _float("top_p", self.top_p, 0.0, 1.0, low_open=True)
        if self.seed is not None:
            _int("seed", self.seed, SEED_MIN, SEED_MAX)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _int(name, getattr(self, name), 0, MAX_LOGPROBS)
        _int("top_k", self.top_k, -1, None)
        _float("min_p", self.min_p, 0.0, 1.0, low_open=False)
        _float("repetition_penalty", self.repetition_penalty, 0.0, MAX_REPETITION_PENALTY, low_open=True)
        for name in ("presence_penalty", "frequency_penalty"):
            _float(name, getattr(self, name), -2.0, 2.0, low_open=False)
        _int("min_tokens", self.min_tokens, 0, self.max_tokens)
        if not isinstance(self.stop, list) or len(self.stop) > MAX_STOPS:
            raise UserError(f"stop: at most {MAX_STOPS} strings")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise UserError("stop: stop strings must be non-empty")
            check_text(s, "stop")


def _int(name: str, value, low: int, high: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise UserError(f"{name}: must be an integer (got {value!r})")
    if value < low or (high is not None and value > high):
        bound = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise UserError(f"{name}: must be {bound} (got {value})")


def _float(name: str, value, low: float, high: float, low_open: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise UserError(f"{name}: must be a finite number (got {value!r})")
    if value > high or value < low or (low_open and value <= low):
        raise UserError(f"{name}: must be in {'(' if low_open else '['}{low}, {high}] (got {value})")


def check_text(text: str, name: str) -> None:
    """Refuse strings that are not valid Unicode (lone surrogates cannot be encoded or tokenised)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise UserError(f"{name}: not valid Unicode (lone surrogate at index {exc.start})") from None


def check_request(prompt_ids: list[int], params: SamplingParams, max_model_len: int, vocab: int) -> None:
    """Raise UserError for a request that can never run: an empty or too long prompt, token ids
    outside the vocabulary, invalid sampling fields (the front end, before queueing)."""
    if not prompt_ids:
        raise UserError("prompt: must not be empty")
    params.check()
    total = len(prompt_ids) + params.max_tokens
    if total > max_model_len:
        raise UserError(f"This model's maximum context length is {max_model_len} tokens; "
                        f"the prompt has {len(prompt_ids)} and max_tokens is {params.max_tokens}")
    if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in prompt_ids):
        raise UserError(f"prompt: token ids must be in [0, {vocab})")


def make_generator(seed: int | None, device=None) -> torch.Generator | None:
    """A per-request generator on the model's device (sampling runs there); negative seeds map
    onto the unsigned 64-bit range."""
    if seed is None:
        return None
    return torch.Generator(device=device or "cpu").manual_seed(seed % 2 ** 64)


def penalise(params: SamplingParams, logits: torch.Tensor, tokens: list[int], num_prompt: int,
             eos_ids: set[int] | frozenset = frozenset()) -> torch.Tensor:
    """The float32 logits [V] after min_tokens and the penalties (a new tensor; `logits` is kept).

    Args:
        tokens: the sequence so far, prompt then output.
        num_prompt: how many of `tokens` are the prompt.
        eos_ids: token ids that end the output (masked while under min_tokens).
    """
    out = logits.clone()
    generated = tokens[num_prompt:]
    if len(generated) < params.min_tokens and eos_ids:
        out[list(eos_ids)] = -math.inf
    if params.repetition_penalty != 1.0 and tokens:
        seen = torch.tensor(sorted(set(tokens)), device=out.device)
        score = out[seen]
        out[seen] = torch.where(score < 0, score * params.repetition_penalty, score / params.repetition_penalty)
    if (params.presence_penalty or params.frequency_penalty) and generated:
        ids, counts = torch.unique(torch.tensor(generated, device=out.device), return_counts=True)
        out[ids] -= params.frequency_penalty * counts.to(out.dtype) + params.presence_penalty
    return out


def distribution(params: SamplingParams, logits: torch.Tensor) -> torch.Tensor:
    """The probabilities [V] a non-greedy draw uses: temperature, then min_p, top_k, top_p
    (unnormalised where tokens were dropped; `draw` does not need a sum of 1)."""
    probs = torch.softmax(logits / params.temperature, dim=-1)  # [V]
    if params.min_p > 0.0:  # relative to the top token: a row never loses its top token
        probs = torch.where(probs < params.min_p * probs.max(), torch.zeros_like(probs), probs)
    if 0 < params.top_k < probs.shape[-1]:
        kth = torch.topk(probs, params.top_k).values[-1]
        probs = torch.where(probs < kth, torch.zeros_like(probs), probs)
    if params.top_p < 1.0:
        probs = probs / probs.sum()  # top_p's mass counts only what min_p/top_k kept
        # the most likely TOP_P_FIRST tokens first: when they hold top_p's mass the cut falls among
        # them and the whole sort is not needed (152k tokens: 0.9 ms against 13 ms, by hand)
        sorted_p, order = torch.topk(probs, min(TOP_P_FIRST, probs.shape[-1]))
        mass = torch.cumsum(sorted_p, 0)
        if len(sorted_p) < len(probs) and float(mass[-1]) < params.top_p:
            sorted_p, order = torch.sort(probs, descending=True)
            mass = torch.cumsum(sorted_p, 0)
        keep = mass - sorted_p < params.top_p
        keep[0] = True  # the top token always stays, even when top_p rounds to 0 in float32 (1e-46)
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
    return probs


def sample(params: SamplingParams, logits: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from float32 logits [V] under `params` (already checked; penalties applied)."""
    if params.greedy:
        return int(torch.argmax(logits))
    return draw(distribution(params, logits), generator)


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token id from float32 probabilities [V] (unnormalised allowed) by their inverse CDF:
    one uniform number from the request's generator, a running sum, a binary search.

    `torch.multinomial` draws one random number per token to take a single sample: 3.1 ms for a
    152k vocabulary on one CPU thread, against 0.2 ms here (by hand). Each token's share of the
    draw is its probability to within half a float32 ulp of the running sum at it (3e-8 of a sum
    of 1); a float64 sum would take 1.3 ms. A token of probability 0 is never drawn: the running
    sum does not grow at it, and the search stops at the first sum above the uniform number.
    """
    cdf = torch.cumsum(probs, 0)  # [V]
    u = torch.rand(1, generator=generator, dtype=cdf.dtype, device=probs.device) * cdf[-1]
    tok = int(torch.searchsorted(cdf, u, right=True))
    if tok == len(cdf):  # u x the sum rounded up to the sum: the token where the sum reached it
        tok = int(torch.searchsorted(cdf, cdf[-1:]))
    return tok


def sample_rows(params: list[SamplingParams], logits: torch.Tensor,
                generators: list[torch.Generator | None]) -> list[int]:
    """One token per row of float32 logits [S, V], each row under its own non-greedy `params`
    (checked; penalties applied) and drawn with its own generator: `distribution` and `draw`
    on the whole batch, as vLLM's sampler does, so a step pays each op once, not once a row,
    and reads the tokens back once. Each row's uniform number comes from its own generator,
    as `draw` takes it, so a seeded request draws what it would alone (up to float rounding).

    On a CPU the rows go through in groups of at most CPU_GROUP_LOGITS logits: each op of a
    [16, 152k] batch streams it through memory where one row stays in a core's cache, and row
    by row took 5.0 ms against 16.3 ms for the whole batch (by hand); small vocabularies still
    go as one batch.

    Axis legend: S sampled rows.
    """
    s, v = logits.shape
    group = max(1, CPU_GROUP_LOGITS // v) if logits.device.type == "cpu" else s
    if group < s:
        return [t for i in range(0, s, group)
                for t in _sample_group(params[i:i + group], logits[i:i + group], generators[i:i + group])]
    return _sample_group(params, logits, generators)


def _sample_group(params: list[SamplingParams], logits: torch.Tensor,
                  generators: list[torch.Generator | None]) -> list[int]:
    """`sample_rows` on one group of rows."""
    s, v = logits.shape
    dev = logits.device
    temps = torch.tensor([p.temperature for p in params], device=dev)[:, None]  # [S, 1]
    probs = torch.softmax(logits / temps, dim=-1)  # [S, V]
    if any(p.min_p > 0.0 for p in params):  # min_p 0: a threshold of 0 drops nothing
        floor = torch.tensor([p.min_p for p in params], device=dev)[:, None] * probs.amax(dim=-1, keepdim=True)
        probs = torch.where(probs < floor, torch.zeros_like(probs), probs)
    ks = [p.top_k if 0 < p.top_k < v else 0 for p in params]
    if any(ks):
        at = torch.tensor([max(k - 1, 0) for k in ks], device=dev)[:, None]  # each row's k-th place
        kth = torch.topk(probs, max(ks)).values.gather(1, at)  # [S, 1]
        kth = torch.where(torch.tensor(ks, device=dev)[:, None] > 0, kth, torch.zeros_like(kth))  # no top_k: 0
        probs = torch.where(probs < kth, torch.zeros_like(probs), probs)
    nucleus = [i for i, p in enumerate(params) if p.top_p < 1.0]
    if nucleus:  # top_p as `distribution`, on its rows together
        rows = torch.tensor(nucleus, device=dev)
        part = probs[rows]
        part = part / part.sum(dim=-1, keepdim=True)
        top_p = torch.tensor([params[i].top_p for i in nucleus], device=dev)[:, None]  # [N, 1]
        sorted_p, order = torch.topk(part, min(TOP_P_FIRST, v))
        mass = torch.cumsum(sorted_p, dim=-1)
        if sorted_p.shape[-1] < v and bool((mass[:, -1:] < top_p).any()):
            sorted_p, order = torch.sort(part, dim=-1, descending=True)
            mass = torch.cumsum(sorted_p, dim=-1)
        keep = mass - sorted_p < top_p
        keep[:, 0] = True
        probs[rows] = torch.zeros_like(part).scatter(1, order, torch.where(keep, sorted_p, 0.0))
    cdf = torch.cumsum(probs, dim=-1)  # [S, V]
    u = torch.cat([torch.rand(1, generator=g, dtype=cdf.dtype, device=dev) for g in generators])[:, None]
    toks = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)  # [S, 1]
    over = toks == v  # as in `draw`: rounded up to the sum, the token where the sum reached it
    if bool(over.any()):
        toks = torch.where(over, torch.searchsorted(cdf, cdf[:, -1:]), toks)
    return toks[:, 0].tolist()


def topk(logprobs: torch.Tensor, k: int) -> list[tuple[int, float]]:
    """The k most likely (token id, logprob) pairs of a [V] row."""
    if k <= 0:
        return []
    vals, idx = torch.topk(logprobs, min(k, logprobs.shape[-1]))
    return list(zip(idx.tolist(), vals.tolist()))


def find_stop(text: str, stops: list[str]) -> int | None:
    """Index of the earliest stop string in `text`, or None."""
    hits = [text.find(s) for s in stops if s and s in text]
    return min(hits) if hits else None



def greedy_and_finite(logits: torch.Tensor) -> tuple[list[int], list[bool]]:
    """For float32 logits [B, V]: each row's argmax and whether the row is sound, in one pass
    (the sampler then runs only for the rows that sample).

    A row is sound when its largest logit is finite. `max` propagates NaN, so a NaN anywhere,
    a +inf anywhere, or a row of nothing but -inf fails it; a -inf beside finite logits is a
    masked token, not a fault. One reduction, where `isfinite(...).all()` beside the argmax
    wrote a [B, V] mask: for 16 rows of a 152k vocabulary `generate`'s argmax takes 0.88-0.97x
    the CPU this does, against 0.27x before (benchmarks/bench_sampler.py).
    """
    values, greedy = logits.max(dim=-1)
    return greedy.tolist(), torch.isfinite(values).tolist()
