"""The engine in the replica's process: the front end (client.py) over an `EngineCore`
(engine_core.py) that runs on a thread of its own.

The core's outputs (token ids) reach the output processor on the core's
thread, once per loop iteration; the sinks are called there. Tests and
benchmarks drive the same object without a thread (`run_until_idle`).

    engine = Engine(model, tokenizer, EngineConfig(), registry, metrics, experts)
    engine.submit("r1", ids, SamplingParams(max_tokens=8), sink)
    engine.run_until_idle()   # or engine.start(): the core's own thread
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Callable

from moeflow.model.models import is_image_text
from moeflow.serving.adapters import AdapterRegistry
from moeflow.serving.client import EngineClient
from moeflow.serving.engine_core import EngineCore
from moeflow.serving.errors import UNLOADED, EngineBusy, EngineDead
from moeflow.serving.request import Delta
from moeflow.serving.sampling import SamplingParams, check_request
from moeflow.serving.scheduler import EngineConfig

if TYPE_CHECKING:
    from moeflow.model.multimodal import ImagePrompt
    from moeflow.serving.metrics import ExpertLoad, ServingMetrics

__all__ = ["UNLOADED", "Delta", "Engine", "EngineBusy", "EngineConfig", "EngineDead", "SamplingParams",
           "check_request"]


class Engine(EngineClient):
    """The in-process engine: front end and core in one process, the core on its own thread.

    Args:
        model: a transformers causal LM (eval mode), shared by all adapters.
        tokenizer: its tokenizer (text, stop strings).
        config: EngineConfig.
        registry: the core's servable adapters (None: base only).
        metrics: optional ServingMetrics (moeflow.serving.metrics).
        experts: optional ExpertLoad tracker hooked into the model.
    """

    takes_images = True

    def __init__(self, model: Any, tokenizer: Any, config: EngineConfig | None = None,
                 registry: AdapterRegistry | None = None, metrics: "ServingMetrics | None" = None,
                 experts: "ExpertLoad | None" = None):
        self.core = EngineCore(model, config, registry, experts, emit=self._on_step)
        super().__init__(tokenizer, self.core.config, metrics)
        self.max_model_len, self.vocab_size = self.core.max_model_len, self.core.vocab_size
        self.experts = experts
        self.image_text = is_image_text(model)

    @property
    def dead(self) -> str | None:
        return self.core.dead

    @property
    def base(self) -> Any:
        """The served model (images need it to lay out their positions)."""
        return self.core.base

    def _add(self, req_id: str, prompt_ids: list[int], params: SamplingParams, adapter: str | None,
             model_name: str, image: "ImagePrompt | None") -> None:
        self.core.add_request(req_id, prompt_ids, params, adapter, model_name, image)

    def _abort(self, req_id: str) -> None:
        self.core.abort(req_id)

    def health(self) -> None:
        self.core.health()

    def run(self, op: str, *args: Any) -> Future:
        return self.core.run(op, *args)

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run `fn` on the core's thread between steps (tests)."""
        return self.core.call(fn)

    def warm_up(self) -> None:
        self.core.warm_up()

    def start(self) -> None:
        self.core.start()

    def stop(self) -> None:
        self.core.stop()

    def run_until_idle(self, max_steps: int = 100000) -> None:
        """Step the core on this thread until nothing is waiting or running (tests, benchmarks)."""
        self.core.run_until_idle(max_steps)
