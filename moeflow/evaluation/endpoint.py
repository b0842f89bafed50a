"""Endpoint runner: evaluate a deployed OpenAI-compatible server (httpx).

Uses the completions API the way lm-eval's `local-completions` model does:
- log-likelihood: `prompt` = context + continuation, `echo: true`,
  `logprobs: 1`, `max_tokens: 1`, `temperature: 0`; the continuation's score is
  the sum of the echoed `token_logprobs` of the tokens that cover it (found by
  `text_offset`, so no local tokenizer is needed);
- generation: `max_tokens`, `temperature: 0`, `stop`.

The completions API carries no images, so multimodal tasks are skipped here
with a note. `lm_eval` suite tasks run here through lm-eval's own
`local-completions` model (lmeval.py).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx

from moeflow.core.errors import UserError
from moeflow.evaluation.lmeval import run_lm_eval_task
from moeflow.evaluation.record import assemble
from moeflow.evaluation.runnable import runnable_tasks
from moeflow.evaluation.runners import task_outputs
from moeflow.evaluation.suite import Suite


class EndpointRunner:
    """Runner against `<base_url>/v1/completions`.

    Args:
        base_url: server root or its `/v1` URL.
        model: model (or adapter) name to send in every request.
        api_key: bearer token, if the server wants one.
        rolling_prefix: text prepended to whole-text perplexity so the first
            token is scored too (the end-of-text token, as the in-process runner does).
        concurrency: requests in flight (results keep request order).
    """

    multimodal = False

    def __init__(self, base_url: str, model: str, *, api_key: str | None = None,
                 timeout: float = 120.0, rolling_prefix: str = "<|endoftext|>",
                 concurrency: int = 4):
        url = base_url.rstrip("/")
        self.url = url if url.endswith("/v1") else url + "/v1"
        self.model = model
        self.rolling_prefix = rolling_prefix
        self.concurrency = concurrency
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(base_url=self.url, timeout=timeout, headers=headers)

    def close(self) -> None:
        self.client.close()

    def _complete(self, payload: dict) -> dict:
        try:
            resp = self.client.post("/completions", json={"model": self.model, **payload})
        except httpx.HTTPError as exc:
            raise UserError(f"endpoint {self.url}: {type(exc).__name__}: {exc}") from None
        if resp.status_code != 200:
            raise UserError(f"endpoint {self.url}/completions: HTTP {resp.status_code}: "
                            f"{resp.text[:200]}")
        try:
            body = resp.json()
        except ValueError:  # json.JSONDecodeError: a proxy's HTML page, a truncated body
            raise UserError(f"endpoint {self.url}/completions: response is not JSON: "
                            f"{resp.text[:200]!r}") from None
        if not isinstance(body, dict) or not body.get("choices"):
            raise UserError(f"endpoint {self.url}/completions: response has no choices")
        return body["choices"][0]

    def _map(self, fn, items: list) -> list:
        with ThreadPoolExecutor(max_workers=self.concurrency) as pool:
            return list(pool.map(fn, items))

    def loglikelihood(self, pairs: list[tuple[str, str]]) -> list[tuple[float, int]]:
        """Sum of log p(continuation | context) per pair, and its token count."""
        return self._map(lambda p: self._one_loglik(*p), pairs)

    def _one_loglik(self, context: str, continuation: str) -> tuple[float, int]:
        if not context:
            context = self.rolling_prefix
        prompt = context + continuation
        choice = self._complete({"prompt": prompt, "max_tokens": 1, "temperature": 0,
                                 "logprobs": 1, "echo": True})
        lp = choice.get("logprobs") or {}
        offsets, values = lp.get("text_offset"), lp.get("token_logprobs")
        if not offsets or values is None:
            raise UserError(f"endpoint {self.url}: no echoed logprobs (text_offset, "
                            f"token_logprobs); log-likelihood tasks need echo + logprobs")
        total, count = 0.0, 0
        ends = list(offsets[1:]) + [len(prompt) + 1]
        for start, end, value in zip(offsets, ends, values):
            # tokens that overlap the continuation; the generated token starts at len(prompt)
            if end > len(context) and start < len(prompt):
                if value is None:
                    raise UserError(f"endpoint {self.url}: no logprob for a continuation "
                                    f"token at offset {start}")
                total += value
                count += 1
        return total, count

    def generate(self, prompts: list[str], max_new_tokens: int, stop: list[str]) -> list[str]:
        """Greedy completions (the scorer cuts at every stop string)."""
        def one(prompt: str) -> str:
            payload = {"prompt": prompt, "max_tokens": max_new_tokens, "temperature": 0}
            if stop:
                payload["stop"] = stop[:4]  # the OpenAI API takes at most 4
            return self._complete(payload).get("text", "")

        return self._map(one, prompts)


def evaluate_endpoint(suite: Suite, base_url: str, model: str, *, tokenizer: str | None = None,
                      **kwargs) -> dict:
    """Evaluate a served model on a suite; the result has the same shape as `evaluate`.

    Args:
        suite: the loaded suite.
        base_url: server URL; model: the name to request (base or adapter).
        tokenizer: served model's local HF tokenizer dir, for `lm_eval` tasks
            (overrides the task's `tokenizer` key).
        kwargs: `EndpointRunner` options.
    """

    runner = EndpointRunner(base_url, model, **kwargs)
    try:
        tasks, skipped = runnable_tasks(suite, False, "the completions API carries no images",
                                        endpoint=True)
        raw = {t.name: (run_lm_eval_task(t, base_url, model, tokenizer or t.spec.tokenizer)
                        if t.spec.type == "lm_eval" else task_outputs(runner, t, t.records))
               for t in tasks}
    finally:
        runner.close()
    return assemble(suite, raw, skipped, model=f"{runner.url}#{model}", adapter=None,
                    settings={"endpoint": runner.url, "model": model})
