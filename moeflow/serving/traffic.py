"""Traffic profiles: what users will send, as a validated YAML, and the requests it yields.

    from moeflow.serving.traffic import load_profile, generate
    profile = load_profile("configs/traffic/demo.yaml")
    reqs = generate(profile, models=["demo", "reverse"], vocab=512, max_model_len=512)

A profile names the arrival process (Poisson at `rate`, gamma with
`burstiness` as `vllm bench serve` draws it, or bursts of `burst_size`
requests sent at once), a mix of request classes (each
with its prompt and output length distributions and a share of the traffic),
adapter popularity (weights or Zipf over the served adapters), the share of
requests that carry an image (image-text models), how many requests, and the
latency SLOs with the attainment percentile they must hold at. Requests are
drawn once per (profile, seed), so every candidate configuration is driven by
exactly the same arrivals and lengths.
"""

from __future__ import annotations

import base64
import io
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal, Union

from pydantic import Field, ValidationError, model_validator

from moeflow.core.config import read_yaml
from moeflow.core.errors import UserError
from moeflow.core.sections import Section

# ------------------------------------------------------------------ schema


class Fixed(Section):
    dist: Literal["fixed"]
    value: int = Field(ge=1)

    def draw(self, rng: random.Random) -> int:
        return self.value


class Uniform(Section):
    """Uniform in [mean * (1 - range_ratio), mean * (1 + range_ratio)] (vllm's --random-range-ratio)."""

    dist: Literal["uniform"]
    mean: int = Field(ge=1)
    range_ratio: float = Field(default=0.0, ge=0, lt=1)

    def draw(self, rng: random.Random) -> int:
        lo, hi = int(self.mean * (1 - self.range_ratio)), int(self.mean * (1 + self.range_ratio))
        return max(1, rng.randint(lo, hi))


class LogNormal(Section):
    """Lognormal around `median` (long-tailed lengths, as real chat logs are), clipped."""

    dist: Literal["lognormal"]
    median: int = Field(ge=1)
    sigma: float = Field(default=0.5, ge=0)
    min: int = Field(default=1, ge=1)
    max: int | None = Field(default=None, ge=1)

    def draw(self, rng: random.Random) -> int:
        value = int(round(rng.lognormvariate(math.log(self.median), self.sigma)))
        return max(self.min, min(value, self.max or value))


class Jsonl(Section):
    """Real prompts: each request's prompt text is one line's `field`, drawn at random."""

    dist: Literal["jsonl"]
    path: str  # JSONL file, one object per line
    field: str = "prompt"  # the key holding the prompt text


LengthDist = Annotated[Union[Fixed, Uniform, LogNormal], Field(discriminator="dist")]
PromptDist = Annotated[Union[Fixed, Uniform, LogNormal, Jsonl], Field(discriminator="dist")]


class Arrivals(Section):
    """When requests arrive: one at a time (Poisson or gamma gaps), or in bursts of
    `burst_size` sent at once (a fan-out: an agent's tool calls, a batch job's chunks),
    the bursts spaced by gamma gaps with mean burst_size / rate."""

    process: Literal["poisson", "gamma", "bursts"] = "poisson"
    rate: float = Field(gt=0)  # requests per second (the rate the SLOs must hold at)
    # gamma shape (vllm bench serve --burstiness) of the gaps: 1 = Poisson, < 1 burstier, > 1 steadier
    burstiness: float = Field(default=1.0, gt=0)
    burst_size: int = Field(default=1, ge=1)  # process: bursts, requests sent together

    @model_validator(mode="after")
    def _bursts(self) -> "Arrivals":
        if self.burst_size > 1 and self.process != "bursts":
            raise ValueError("burst_size needs process: bursts")
        return self

    def group(self) -> int:
        """Requests that arrive together (a replay is best cut at a multiple of this)."""
        return self.burst_size if self.process == "bursts" else 1


class RequestClass(Section):
    name: str
    share: float = Field(gt=0)  # relative weight among the classes
    prompt_len: PromptDist  # tokens (synthetic) or real prompts (jsonl)
    output_len: LengthDist  # max_tokens, generated in full (ignore_eos), as vllm bench serve does


class Adapters(Section):
    popularity: Literal["weights", "zipf", "uniform"] = "uniform"
    # served names to send to; None: every served adapter (and `include_base`)
    names: list[str] | None = None
    weights: dict[str, float] | None = None  # popularity: weights (name -> relative weight)
    zipf_s: float = Field(default=1.0, gt=0)  # popularity: zipf, k-th name weighted 1/k^s
    include_base: bool = False  # also send requests to the base model

    @model_validator(mode="after")
    def _weights(self) -> "Adapters":
        if self.popularity == "weights" and not self.weights:
            raise ValueError("popularity: weights needs a `weights` mapping (name -> weight)")
        if self.weights and any(w < 0 for w in self.weights.values()):
            raise ValueError("weights must be >= 0")
        return self


class Images(Section):
    share: float = Field(default=0.0, ge=0, le=1)  # of requests carrying one image
    width: int = Field(default=32, ge=8)
    height: int = Field(default=32, ge=8)


class Slo(Section):
    ttft_ms: float | None = Field(default=None, gt=0)  # time to first token
    tpot_ms: float | None = Field(default=None, gt=0)  # time per output token after the first
    e2el_ms: float | None = Field(default=None, gt=0)  # end-to-end latency
    percentile: float = Field(default=99, gt=0, le=100)  # share of requests that must meet them

    @model_validator(mode="after")
    def _some(self) -> "Slo":
        if self.ttft_ms is None and self.tpot_ms is None and self.e2el_ms is None:
            raise ValueError("set at least one of ttft_ms, tpot_ms, e2el_ms")
        return self

    def limits(self) -> dict[str, float]:
        """{metric: limit ms} of the SLOs that are set (vllm's --goodput keys)."""
        return {k: v for k, v in (("ttft", self.ttft_ms), ("tpot", self.tpot_ms),
                                  ("e2el", self.e2el_ms)) if v is not None}


class TrafficProfile(Section):
    name: str = "traffic"
    arrivals: Arrivals
    mix: list[RequestClass] = Field(min_length=1)
    adapters: Adapters = Field(default_factory=Adapters)
    images: Images = Field(default_factory=Images)
    num_requests: int | None = Field(default=None, ge=1)  # the whole replay
    duration_s: float | None = Field(default=None, gt=0)  # or: rate x duration requests
    slo: Slo
    seed: int = 0

    @model_validator(mode="after")
    def _length(self) -> "TrafficProfile":
        if (self.num_requests is None) == (self.duration_s is None):
            raise ValueError("set exactly one of num_requests, duration_s")
        return self

    def total_requests(self) -> int:
        if self.num_requests:
            return self.num_requests
        assert self.duration_s is not None  # _length: one of the two is set
        return max(1, round(self.arrivals.rate * self.duration_s))


REPO = Path(__file__).resolve().parents[2]  # shipped profiles: configs/traffic/


def profile_path(path: str) -> Path:
    """A profile path as given, else relative to the repo (shipped configs/traffic/)."""
    p = Path(path)
    if p.is_file() or p.is_absolute():
        return p
    shipped = REPO / p
    return shipped if shipped.is_file() else p


def load_profile(path: str | Path) -> TrafficProfile:
    """Read and validate a profile; one UserError line naming the bad key."""

    return validate_profile(read_yaml(path, "traffic profile"), str(path))


def validate_profile(raw: dict, source: str = "<profile>") -> TrafficProfile:
    if not isinstance(raw, dict):
        raise UserError(f"{source}: a traffic profile must be a mapping")
    try:
        profile = TrafficProfile.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        # drop pydantic's union tags ("uniform", "function-after[...]") from the location
        loc = [str(p) for p in err["loc"] if not (isinstance(p, str) and ("[" in p or p in
               ("fixed", "uniform", "lognormal", "jsonl")))]
        key = ".".join(loc) or "<root>"
        msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
        more = f" (+{len(exc.errors()) - 1} more)" if len(exc.errors()) > 1 else ""
        raise UserError(f"{source}: `{key}`: {msg}{more}") from None
    for i, klass in enumerate(profile.mix):
        if isinstance(klass.prompt_len, Jsonl) and not Path(klass.prompt_len.path).is_file():
            raise UserError(f"{source}: `mix.{i}.prompt_len.path`: {klass.prompt_len.path} does not exist")
    return profile


# ------------------------------------------------------------------ requests


@dataclass
class Request:
    """One request of a replay. `prompt` is token ids (synthetic) or text (real prompts)."""

    arrival_s: float  # offset from the start of the replay
    model: str  # served model name (base or adapter)
    prompt: list[int] | str
    max_tokens: int
    klass: str  # the mix class it came from
    image: str | None = None  # data: URL of a PNG, for image-text models


def arrival_times(n: int, rate: float, burstiness: float, rng: random.Random,
                  process: str = "gamma", burst_size: int = 1) -> list[float]:
    """Offsets (s) of `n` arrivals: gamma inter-arrival gaps with mean 1/rate (vllm's draw);
    with process "bursts", `burst_size` arrivals at each offset, gaps of mean burst_size/rate."""
    size = burst_size if process == "bursts" else 1
    t, out = 0.0, []
    for i in range(n):
        out.append(t)
        if (i + 1) % size:
            continue  # the rest of this burst arrives at the same instant
        if process == "poisson" or burstiness == 1.0:
            t += rng.expovariate(rate / size)
        else:
            t += rng.gammavariate(burstiness, size / (rate * burstiness))
    return out


def adapter_weights(spec: Adapters, served: list[str], base: str | None) -> dict[str, float]:
    """{served name: weight} the requests are spread over; UserError for unserved names."""
    names = list(spec.names) if spec.names is not None else [m for m in served if m != base]
    if spec.include_base and base and base not in names:
        names.append(base)
    weights = spec.weights or {}  # popularity: weights has a mapping (Adapters._weights)
    if spec.popularity == "weights":
        names = list(weights)
    missing = [n for n in names if n not in served]
    if missing:
        raise UserError(f"traffic profile `adapters`: {missing[0]!r} is not served "
                        f"(served: {', '.join(served)})")
    if not names:
        names = [base] if base else served[:1]  # nothing but the base is served
    if spec.popularity == "weights":
        return {n: float(weights[n]) for n in names}
    if spec.popularity == "zipf":
        return {n: 1.0 / (k + 1) ** spec.zipf_s for k, n in enumerate(names)}
    return {n: 1.0 for n in names}


def _jsonl_prompts(spec: Jsonl) -> list[str]:
    out = []
    for i, line in enumerate(Path(spec.path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            text = json.loads(line)[spec.field]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise UserError(f"{spec.path}:{i}: expected a JSON object with a {spec.field!r} string") from None
        out.append(str(text))
    if not out:
        raise UserError(f"{spec.path}: no prompts")
    return out


def _png(width: int, height: int, rng: random.Random) -> str:
    # lazy: PIL: heavy, loaded only when this runs
    from PIL import Image

    img = Image.new("RGB", (width, height), tuple(rng.randrange(256) for _ in range(3)))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def generate(profile: TrafficProfile, *, models: list[str], base: str | None = None, vocab: int,
             max_model_len: int | None = None, rate: float | None = None,
             num_requests: int | None = None, seed: int | None = None) -> list[Request]:
    """Draw the profile's requests (deterministic for a seed).

    Args:
        models: served model names (/v1/models); base: the base model's name among them.
        vocab: prompt token ids are drawn in [10, vocab) (no tokenizer variance between runs).
        max_model_len: prompt + output is clipped to fit (prompt shortened first).
        rate / num_requests / seed: override the profile's (rate sweeps, short probes).
    Returns:
        requests sorted by arrival offset.
    """
    rng = random.Random(profile.seed if seed is None else seed)
    n = num_requests or profile.total_requests()
    arr = profile.arrivals
    times = arrival_times(n, rate or arr.rate, arr.burstiness, rng, arr.process, arr.burst_size)
    weights = adapter_weights(profile.adapters, models, base)
    names, wts = list(weights), list(weights.values())
    shares = [c.share for c in profile.mix]
    real = {i: _jsonl_prompts(c.prompt_len) for i, c in enumerate(profile.mix) if isinstance(c.prompt_len, Jsonl)}
    out = []
    for t in times:
        i = rng.choices(range(len(profile.mix)), shares)[0]
        klass = profile.mix[i]
        max_tokens = klass.output_len.draw(rng)
        if isinstance(klass.prompt_len, Jsonl):  # the profile's own prompts (`real`)
            prompt: list[int] | str = rng.choice(real[i])
        else:
            length = klass.prompt_len.draw(rng)
            if max_model_len:
                max_tokens = min(max_tokens, max_model_len - 1)
                length = max(1, min(length, max_model_len - max_tokens))
            prompt = [rng.randrange(10, vocab) for _ in range(length)]
        image = None
        if profile.images.share and rng.random() < profile.images.share:
            image = _png(profile.images.width, profile.images.height, rng)
        out.append(Request(t, rng.choices(names, wts)[0], prompt, max_tokens, klass.name, image))
    return out
