"""The front end of the engine: one interface whether the core runs on a thread of the
replica (engine.py, `Engine`) or in a process of its own (core.py, `CoreClient`).

As vLLM V1's `AsyncLLM` over its `EngineCoreClient`: the front end checks a
request (check_request), counts it against the queue limits (a refusal is
answered at once), tracks it in the output processor (outputs.py: text, stop
strings, metrics), and hands it to the core, which answers with token ids.
What differs between the two is only the transport, which each subclass
provides: `_add`, `_abort`, `health`, `run`, `stop`.

    engine.submit(req_id, ids, params, sink, adapter, model_name)   # deltas with text arrive on sink
    engine.run("load_or_check", spec).result()                      # adapter changes, expert questions
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from moeflow.core.errors import UserError
from moeflow.serving.errors import STOPPED, EngineDead
from moeflow.serving.outputs import OutputProcessor
from moeflow.serving.request import CoreStats, Sink, StepOutputs
from moeflow.serving.sampling import SamplingParams, check_request
from moeflow.serving.scheduler import EngineConfig, QueueLimits

if TYPE_CHECKING:
    from moeflow.model.multimodal import ImagePrompt
    from moeflow.serving.metrics import ServingMetrics

log = logging.getLogger("moeflow.serving")

IMAGES_IN_PROCESS = "image inputs need the in-process engine (deploy.engine_process: false)"


class EngineClient(ABC):
    """What a replica (service.py) uses of its engine, in process or not.

    Attributes a subclass sets: `max_model_len`, `vocab_size`, `config` (EngineConfig),
    `image_text` (the model takes images), `experts` (what loadbook.Reporter reads).
    """

    max_model_len: int
    vocab_size: int
    config: EngineConfig
    image_text: bool
    experts: Any
    takes_images = False  # whether submit accepts `image` (the model lives in this process)

    def __init__(self, tokenizer: Any, config: EngineConfig, metrics: "ServingMetrics | None"):
        self.config, self.metrics = config, metrics
        self.limits = QueueLimits(config)
        self.outputs = OutputProcessor(tokenizer, self.limits, metrics)
        self.stats: CoreStats | None = None  # the core's load, as its last step said
        self.resident_loras = 0  # adapters resident in the core, as its last stats said

    @property
    @abstractmethod
    def dead(self) -> str | None:
        """Why the core stopped serving (None while it serves)."""

    # ------------------------------------------------------------ requests

    def submit(self, req_id: str, prompt_ids: list[int], params: SamplingParams, sink: Sink,
               adapter: str | None = None, model_name: str = "base", image: "ImagePrompt | None" = None) -> None:
        """Queue a request (thread-safe); deltas with their text arrive on `sink`.

        Raises:
            UserError: a request that can never run; EngineBusy / EngineDead: refused now.
        """
        if image is not None and not self.takes_images:
            raise UserError(IMAGES_IN_PROCESS)
        check_request(prompt_ids, params, self.max_model_len, self.vocab_size)
        self.reserve([len(prompt_ids)])
        self.outputs.add(req_id, model_name, len(prompt_ids), sink, params.stop, params.min_tokens)
        try:
            self._add(req_id, list(prompt_ids), params, adapter, model_name, image)
        except BaseException:
            self.outputs.drop(req_id)
            raise

    def reserve(self, lengths: list[int], dry_run: bool = False) -> None:
        """Count prompts against the queue limits (all or none); EngineBusy/EngineDead if refused.

        Args:
            lengths: prompt lengths in tokens.
            dry_run: only check (a multi-prompt request checks all before submitting any).
        """
        if self.dead is not None:
            raise EngineDead(f"{STOPPED}: {self.dead}")
        self.limits.reserve(lengths, dry_run)

    def ask(self, op: str, *args: Any, timeout: float = 120.0) -> Any:
        """run() and wait for the answer (at most `timeout` s)."""
        return self.run(op, *args).result(timeout=timeout)

    def _on_step(self, step: StepOutputs) -> None:
        """A core step's outputs (the core's thread in process, the reader thread otherwise)."""
        for req_id in self.outputs.process(step):
            self._abort(req_id)  # ended here (a stop string): the core would go on
        if step.stats is not None:
            self.stats = step.stats
            self.resident_loras = step.stats.resident_loras
            if self.metrics:
                self.metrics.queue_counts(step.stats.running, step.stats.waiting, step.stats.cached_tokens)
                self.metrics.prefix_cache(step.stats.prefix_queries, step.stats.prefix_hits)
                if step.stats.adapters is not None:
                    self.metrics.lora_tiers(step.stats.adapters)
                if step.stats.kv_usage is not None:  # a paged cache: blocks used / blocks
                    self.metrics.kv_usage.set(step.stats.kv_usage)
        if step.dead is not None:
            log.error("engine core unhealthy: %s", step.dead)

    # ------------------------------------------------------------ the transport

    @abstractmethod
    def _add(self, req_id: str, prompt_ids: list[int], params: SamplingParams, adapter: str | None,
             model_name: str, image: "ImagePrompt | None") -> None:
        """Hand a checked, counted request to the core."""

    def abort(self, req_id: str) -> None:
        """Stop a request (finished ones are ignored); its last delta comes from the core."""
        if req_id in self.outputs:
            self._abort(req_id)

    @abstractmethod
    def _abort(self, req_id: str) -> None:
        """Tell the core to stop a request."""

    @abstractmethod
    def health(self) -> None:
        """Raise EngineDead when the core cannot serve (Ray Serve's check_health)."""

    @abstractmethod
    def run(self, op: str, *args: Any) -> Future:
        """An adapter change (EngineCore.OPS) or a question (EngineCore.QUESTIONS) by name."""

    @abstractmethod
    def stop(self) -> None:
        """Stop the core; requests in flight end with an error."""
