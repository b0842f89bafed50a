"""Random LoRA adapters in standard PEFT format, for serving tests and benchmarks,
and the other helpers they share (an id tokenizer, a server without Ray).

A freshly initialised LoRA has lora_B = 0, so it equals the base model; these
adapters draw lora_B at random so each adapter visibly changes the output.
"""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import torch

from moeflow.model.models import load_model

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
# prompts of mixed lengths: served together, their rows decode with padding
MIXED_PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13], list(range(20, 60)), [3, 4]]


class IdTokenizer:
    """Token ids as text, enough for the engine's detokeniser (its slow-tokenizer path):
    an engine over a model built without a tokenizer."""

    is_fast = False

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def make_lora_adapter(base_dir: str | Path, out_dir: str | Path, *, seed: int = 0,
                      rank: int = 4, scale: float = 0.5, experts: bool = False) -> Path:
    """Write a random PEFT LoRA adapter for the model at `base_dir`.

    Args:
        base_dir: HF model dir the adapter belongs to.
        out_dir: where adapter_config.json + adapter_model.safetensors go.
        seed: adapters with different seeds give different outputs.
        rank: LoRA rank.
        scale: std of the random lora_B entries.
        experts: also adapt the fused expert weights (PEFT `target_parameters`).

    Returns:
        `out_dir`.
    """
    # lazy: peft: heavy, loaded only when this runs
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = load_model(base_dir, torch.float32)  # the class the server loads
    cfg = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=ATTENTION,
                     target_parameters=EXPERTS if experts else None)
    peft_model = get_peft_model(model, cfg)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * scale)
    peft_model.save_pretrained(str(out_dir))
    return Path(out_dir)


def poison_adapter(src: str | Path, out_dir: str | Path) -> Path:
    """A copy of the adapter at `src` whose weights are all NaN (hostile-input tests)."""

    # lazy: safetensors: heavy, loaded only when this runs
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out_dir)
    weights = Path(out_dir) / "adapter_model.safetensors"
    save_file({k: torch.full_like(v, float("nan")) for k, v in load_file(weights).items()}, weights)
    return Path(out_dir)


class LocalServer:
    """The API of one in-process Service on uvicorn (no Ray): tests and benchmarks.

    Args:
        settings: ServeSettings.
        port: TCP port on 127.0.0.1.

    Use as a context manager; `url` is the base URL, `service` the replica.
    """

    def __init__(self, settings, port: int):
        # lazy: uvicorn: heavy, loaded only when this runs;
        # loads fastapi, prometheus_client, starlette, which importing this module does not
        import uvicorn

        from moeflow.serving.api import create_app
        from moeflow.serving.service import Service

        self.service = Service(settings)
        self.url = f"http://127.0.0.1:{port}"
        config = uvicorn.Config(create_app(self.service), host="127.0.0.1", port=port, log_level="warning",
                                lifespan="off")
        self.server = uvicorn.Server(config)

    def __enter__(self) -> "LocalServer":
        self.thread = threading.Thread(target=self.server.run, name="moeflow-uvicorn", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.service.close()
