"""Request schemas of the OpenAI-compatible API, and the OpenAPI document they produce.

Every field is typed strictly (a boolean is not a token id or a count), bounded
as the engine will compute it (moeflow.serving.sampling), and every string must
be valid Unicode. OpenAI fields this server does not implement (logit_bias,
tools, response_format other than text, best_of, suffix) are accepted only at
their no-op value and otherwise refused with a 400 naming the field; the schema
says so (bounds of 0, empty arrays), so it stays true to what the server does.
vLLM's sampling extras (top_k, min_p, repetition_penalty, min_tokens) and the
penalties are implemented (moeflow.serving.sampling). A field the server does
not know is a 400 naming it, never silently ignored. OpenAI's cross-field rules
hold: stream_options needs stream, top_logprobs needs logprobs, min_tokens <=
max_tokens, best_of >= n.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    model_validator,
)

from moeflow.serving.sampling import MAX_LOGPROBS, MAX_REPETITION_PENALTY, MAX_STOPS, SEED_MAX, SEED_MIN

MAX_PROMPTS = 64  # prompts in one /v1/completions request (each takes an engine slot)
MAX_N = 16  # choices per prompt (n); prompts x n is also bounded by MAX_PROMPTS
UNSUPPORTED = {"logit_bias", "response_format", "best_of", "suffix", "tools", "tool_choice", "functions"}


def _no_lone_surrogates(value: Any, path: str = "body") -> None:
    """Raise ValueError naming the first string (at any depth) that is not valid Unicode."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"{path}: not valid Unicode (lone surrogate at index {exc.start})") from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _no_lone_surrogates(k, path)
            _no_lone_surrogates(v, f"{path}.{k}" if path != "body" else str(k))
    elif isinstance(value, list):
        # only strings and containers can hold text: a list of numbers (a token-id prompt) is
        # passed over by its types alone (element by element, 4,096 ids took ~0.9 ms a request
        # on the replica's event loop)
        if set(map(type, value)) <= _NUMBERS:
            return
        for i, v in enumerate(value):
            _no_lone_surrogates(v, f"{path}.{i}")


_NUMBERS = {int, float, bool}


def _unsupported(default: Any, why: str):
    """A validator accepting only the field's no-op value."""
    def check(value):
        if value is not None and value != default and not (default == {} and not value) \
                and not (default == [] and not value):
            raise ValueError(f"is not supported by this server ({why})")
        return value
    return AfterValidator(check)


def _integral(value: Any) -> Any:
    """JSON integers, and floats with no fraction (JSON Schema's `integer` allows 1.0); never booleans."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


Int = Annotated[StrictInt, BeforeValidator(_integral)]


def _integral_ids(value: Any) -> Any:
    """`_integral` over a list of token ids in one call; pydantic then checks the ints in its own
    code. (Int's validator per element took ~1 ms for a 4,096-token prompt.)"""
    if isinstance(value, list) and float in set(map(type, value)):
        return [int(v) if type(v) is float and v.is_integer() else v for v in value]
    return value


Float = StrictFloat  # accepts ints, refuses booleans and numeric strings
Penalty = Annotated[Float | None, Field(ge=-2, le=2)]  # null: 0
StopText = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[Annotated[StrictInt, Field(ge=0)]], Field(min_length=1),
                     BeforeValidator(_integral_ids)]


class _Body(BaseModel):
    # an unknown field is a 400 naming it (a vLLM extra this server lacks must not pass silently);
    # NaN/Infinity JSON literals: 400
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _unicode(cls, data: Any) -> Any:
        _no_lone_surrogates(data)
        return data


class StreamOptions(_Body):
    include_usage: StrictBool = False


class ResponseFormat(_Body):
    type: Literal["text"] = Field(description="only plain text: json_object/json_schema are not supported")


class _Req(_Body):
    model: StrictStr = Field(min_length=1)
    max_tokens: Int | None = Field(default=None, ge=1)
    temperature: Float = Field(default=1.0, ge=0, le=2, description="below 1e-5: greedy")
    top_p: Float = Field(default=1.0, gt=0, le=1)
    seed: Int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stop: StopText | Annotated[list[StopText], Field(max_length=MAX_STOPS)] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: Int = Field(default=1, ge=1, le=MAX_N, description="choices per prompt (a seed s gives choice i seed s+i)")
    ignore_eos: StrictBool = False  # vLLM extension, used by benchmarks for fixed output lengths
    user: StrictStr | None = None  # accepted, unused (as in vLLM)
    frequency_penalty: Penalty = None
    presence_penalty: Penalty = None
    # vLLM's sampling extras (sent through the OpenAI client's extra_body)
    top_k: Int | None = Field(default=None, ge=-1, description="0 or -1: all tokens")
    min_p: Float = Field(default=0.0, ge=0, le=1)
    repetition_penalty: Float = Field(default=1.0, gt=0, le=MAX_REPETITION_PENALTY)
    min_tokens: Int = Field(default=0, ge=0)
    # OpenAI fields not implemented: refused unless at their no-op value
    logit_bias: Annotated[dict[str, Float] | None, Field(max_length=0),
                          _unsupported({}, "no logit bias")] = None
    response_format: ResponseFormat | None = None

    @model_validator(mode="after")
    def _cross_fields(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        limit = getattr(self, "max_completion_tokens", None) or self.max_tokens
        if limit is not None and self.min_tokens > limit:
            raise ValueError(f"min_tokens: must be <= max_tokens ({limit}), got {self.min_tokens}")
        return self


class CompletionRequest(_Req):
    prompt: (Annotated[str, Field(min_length=1)] | Annotated[list[Annotated[str, Field(min_length=1)]],
                                                             Field(min_length=1, max_length=MAX_PROMPTS)]
             | TokenIds | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)])
    echo: StrictBool = False
    logprobs: Int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    best_of: Annotated[Int | None, Field(ge=1, le=1), _unsupported(1, "n=1 only")] = None
    suffix: Annotated[str | None, Field(max_length=0), _unsupported("", "no insertion")] = None

    @model_validator(mode="after")
    def _best_of_n(self):
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of: must be >= n ({self.n}), got {self.best_of}")
        return self


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: StrictStr | None = None  # OpenAI's participant name: accepted, not shown to the model


class ChatRequest(_Req):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: StrictBool = False
    top_logprobs: Int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    max_completion_tokens: Int | None = Field(default=None, ge=1)
    tools: Annotated[list[dict[str, Any]] | None, Field(max_length=0),
                     _unsupported([], "no tool calling")] = None
    tool_choice: Annotated[Literal["none"] | None, _unsupported("none", "no tool calling")] = None
    functions: Annotated[list[dict[str, Any]] | None, Field(max_length=0),
                         _unsupported([], "no tool calling")] = None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: only allowed when logprobs is true")
        return self


class TokenizeRequest(_Body):
    """vLLM's /tokenize body: `prompt`, or chat `messages` (rendered by the chat template)."""

    model: StrictStr = Field(min_length=1)
    prompt: StrictStr | None = None  # bounded by max_request_bytes (413), as every body
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: StrictBool = True

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt: give either prompt or messages")
        return self


class DetokenizeRequest(_Body):
    model: StrictStr = Field(min_length=1)
    tokens: Annotated[list[Annotated[StrictInt, Field(ge=0)]], BeforeValidator(_integral_ids)]


class LoadLoraRequest(_Body):
    lora_name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoraRequest(_Body):
    lora_name: str = Field(min_length=1, max_length=128)


# ------------------------------------------------------------------ errors and the OpenAPI document


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorDetail


_WHY = {400: "invalid request (the field is named in error.param)", 401: "missing or wrong API key",
        403: "the registered version's gate verdict is FAIL (a server started with --force loads it)",
        404: "unknown model or adapter",
        409: "the adapter is in use (unload), or the registered version has no gate verdict yet (load)",
        413: "request body too large",
        429: "server busy: retry later", 500: "internal error", 503: "the engine stopped serving"}


def errors(*codes: int) -> dict:
    """`responses=` entries for error statuses, all in OpenAI's error shape."""
    return {c: {"model": ErrorResponse, "description": _WHY[c]} for c in codes}


def true_openapi(schema: dict) -> dict:
    """Remove FastAPI's 422 entries (this server answers 400 for invalid bodies); errors are JSON."""
    for ops in schema.get("paths", {}).values():
        for op in ops.values():
            responses = op.get("responses", {})
            responses.pop("422", None)
            for code, resp in responses.items():  # errors are JSON even on text/plain routes
                if int(code) >= 400 and "text/plain" in resp.get("content", {}):
                    resp["content"] = {"application/json": resp["content"].pop("text/plain")}
    comps = schema.get("components", {}).get("schemas", {})
    comps.pop("HTTPValidationError", None)
    comps.pop("ValidationError", None)
    return schema
