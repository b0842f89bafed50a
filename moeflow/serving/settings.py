"""What a replica serves (`ServeSettings`), shared by the replica (service.py) and its engine
core process (core.py), and where a replica finds a path (`on_this_node`)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from moeflow.core import storage


class ServeSettings(BaseModel):
    """Everything a replica needs to build its engine (JSON-able: sent to Ray)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    base_dir: str  # converted HF checkpoint
    served_model_name: str | None = None  # default: the base dir's name
    adapters: dict[str, str] = Field(default_factory=dict)  # name -> local dir or models:/ URI
    adapter_root: str | None = None  # runtime load_lora_adapter reads only under here
    merge: str | None = None  # merged mode: this adapter merged into the base, no LoRA at run time
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: bf16 on GPU, fp32 on CPU
    engine: dict = Field(default_factory=dict)  # EngineConfig fields
    api_key: str | None = None
    torch_threads: int = Field(default=1, ge=1)
    expert_window_steps: int = Field(default=32, ge=1)
    expert_balance_threshold: float = Field(default=0.3, ge=0, le=1)
    download_dir: str | None = None  # models:/ adapters land here
    max_request_bytes: int = Field(default=16 * 2 ** 20, ge=1024)  # larger bodies: 413 before parsing
    # tokens per streamed chunk after the first (vLLM's --stream-interval): 1 sends every token;
    # more cut the per-chunk cost of the HTTP path (SSE framing, the Serve proxy hop) on busy replicas
    stream_interval: int = Field(default=1, ge=1)
    tracking_uri: str | None = None  # MLflow store models:/ URIs resolve against (None: they are refused)
    # `serve`/`deploy --force`: registered versions without a PASS gate verdict load at run time
    # too (each such load logged); otherwise a runtime load of one is refused (403 FAIL, 409 none)
    allow_ungated: bool = False
    # transformers experts kernel (the operators stage's serving choice: eager | grouped_mm |
    # batched_mm); None: transformers' default. Ignored by families without the switch
    experts_implementation: str | None = None
    # local path -> store URI it was fetched from (workdir in a store): a replica on another node
    # fetches the same files into its own cache (moeflow.core.storage); base_dir/adapters may be URIs too
    stored: dict[str, str] = Field(default_factory=dict)
    # expert-parallel size the placement is for: `moeflow_expert_tokens_total`'s ep_rank label
    ep_size: int = Field(default=1, ge=1)
    # run the engine core (scheduling + forwards) in its own process beside the replica (core.py):
    # the replica's HTTP, tokenising and detokenising no longer share a GIL with the forwards.
    # auto: the core process unless the model takes images (they need the engine in the
    # replica's process); the same default as deploy.engine_process
    engine_process: bool | Literal["auto"] = "auto"

    def name(self) -> str:
        return self.served_model_name or Path(self.base_dir).name


def on_this_node(path: str, stored: dict[str, str]) -> str:
    """A path this replica can open: a store URI, or a path fetched from the store on another
    node (`stored`), fetched into this node's cache (moeflow.core.storage); else `path` as is."""
    if storage.is_uri(path):
        return storage.localize(path)
    if not Path(path).exists():
        for local, uri in stored.items():
            if path == local or path.startswith(local.rstrip("/") + "/"):
                return storage.localize(uri + path[len(local.rstrip("/")):])
    return path
