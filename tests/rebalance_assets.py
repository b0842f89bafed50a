"""The demo deployment for the operations tests: the demo base through convert, plan and
operators (EP 2) in a test's own MLflow store, served on the test's Ray, and skewed traffic
(spelling prompts route most tokens of MoE layer 1 to experts that share an EP rank)."""

from __future__ import annotations

import random
import shutil
import string
import threading
from pathlib import Path

import httpx

from tests.conftest import REPO

SKEWED = ["the word {w} is spelled", "the word {w} is spelled {s}"]


def demo_operators_run(root: Path) -> tuple[str, str, dict]:
    """(tracking uri, pipeline run id, operators record) of convert -> plan -> operators."""
    from moeflow.core.config import load_config
    from workflows.runner import run_pipeline
    from workflows.selection import enable_only

    model = root / "model"
    shutil.copytree(REPO / "assets" / "demo-base", model)
    uri = f"sqlite:///{root}/mlflow.db"
    cfg = load_config(str(REPO / "configs" / "demo.yaml"), [
        f"model.path={model}", f"workdir={root / 'runs'}", f"tracking.uri={uri}",
        "operators.dispatch=false"])
    cfg = enable_only(cfg, ["operators"])
    outcome = run_pipeline(cfg, use_cache=False)
    assert outcome.status == "FINISHED", outcome.stages
    from moeflow.core import tracking as T

    client = T.client_for(uri)
    tags = T.get_pipeline_run(client, outcome.run_id).data.tags
    record = T.read_result(client.get_run(tags[T.STAGE_RUN_PREFIX + "operators"]))
    convert = T.read_result(client.get_run(tags[T.STAGE_RUN_PREFIX + "convert"]))
    return uri, outcome.run_id, dict(record, convert_dir=convert["output_dir"])


def skewed_prompt(rng: random.Random) -> str:
    word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 6)))
    return rng.choice(SKEWED).format(w=word, s=" ".join(word[:2]))


class Clients:
    """`n` threads sending greedy completions of fixed prompts in a loop; every answer is
    checked against the first answer that prompt got. Like the OpenAI SDK (its default
    `max_retries=2`), a request whose connection was dropped before any response is sent
    again, at most twice; those are counted in `dropped`, and only a request that still has no
    answer, or gets an error status, in `failed`."""

    RETRIES = 2  # the OpenAI SDK's default

    def __init__(self, url: str, model: str, n: int = 16, max_tokens: int = 8, seed: int = 0):
        rng = random.Random(seed)
        self.prompts = [skewed_prompt(rng) for _ in range(n)]
        self.url, self.model, self.max_tokens = url, model, max_tokens
        self.expected: dict[str, str] = {}
        self.ok = self.failed = self.mismatched = self.dropped = 0
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(p,), daemon=True) for p in self.prompts]

    def _one(self, client: httpx.Client, prompt: str) -> str:
        body = {"model": self.model, "prompt": prompt, "max_tokens": self.max_tokens, "temperature": 0}
        for attempt in range(self.RETRIES + 1):
            try:
                r = client.post("/v1/completions", json=body)
                break
            except (httpx.RemoteProtocolError, httpx.ConnectError) as exc:  # no response at all
                if attempt == self.RETRIES:
                    raise
                with self._lock:
                    self.dropped += 1
                    self.errors.append(f"{prompt!r} (sent again): {exc}")
        r.raise_for_status()
        return r.json()["choices"][0]["text"]

    def _run(self, prompt: str) -> None:
        with httpx.Client(base_url=self.url, timeout=120) as client:
            while not self._stop.is_set():
                try:
                    text = self._one(client, prompt)
                except Exception as exc:  # noqa: BLE001 - every failure is counted and shown
                    with self._lock:
                        self.failed += 1
                        self.errors.append(f"{prompt!r}: {exc}")
                    continue
                with self._lock:
                    want = self.expected.setdefault(prompt, text)
                    self.ok += 1
                    if text != want:
                        self.mismatched += 1
                        self.errors.append(f"{prompt!r}: {text!r} != {want!r}")

    def start(self) -> "Clients":
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=180)
