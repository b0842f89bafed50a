"""Expert-load profile: tokens routed to each (MoE layer, expert) on a calibration set.

The counts come from the routers' own decisions (a forward hook on every
router `find_routers` finds), so they are what an engine running this model
would dispatch — no re-implementation of any family's gating. Padding tokens
are excluded: the hook keeps only the positions the attention mask marks real.
Big calibration sets are split over Ray tasks (each loads the model once and
returns its partial matrix); the sum is the profile. A model larger than a device is
profiled layer-streamed (moeflow.quant.streamed): one decoder layer resident at a time, the
routers of each layer hooked as it is built; the counts are the loaded model's.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from moeflow.core.errors import UserError
from moeflow.evaluation.suite import load_suite
from moeflow.model.models import load_model

TEXT_KEYS = ("prompt", "text", "context", "question")  # first present key is a record's text


def record_text(rec: dict) -> str | None:
    """The text of one calibration record: a prompt (plus its completion), text,
    multiple-choice context, question, or chat messages joined; None if it has none."""
    if isinstance(rec.get("messages"), list):
        parts = [m.get("content") for m in rec["messages"] if isinstance(m, dict)]
        return "\n".join(p for p in parts if isinstance(p, str)) or None
    for key in TEXT_KEYS:
        if isinstance(rec.get(key), str) and rec[key]:
            extra = rec.get("completion") if key == "prompt" else None
            return rec[key] + (extra if isinstance(extra, str) else "")
    return None


def calibration_texts(path: str | None, limit: int | None = None) -> tuple[list[str], str]:
    """Calibration texts from a JSONL file, or the golden suite's prompts when None.

    Args:
        path: JSONL of records with prompt / text / context / question / messages.
        limit: keep at most this many texts (None: all).

    Returns:
        (texts, source description).
    """
    if path is None:
        suite = load_suite()
        texts = [t for task in suite.tasks for rec in task.records if (t := record_text(rec))]
        source = f"{suite.path} (golden suite prompts)"
    else:
        texts = list(_read_jsonl(Path(path)))
        source = str(path)
    if not texts:
        raise UserError(f"{source}: no calibration text (records need prompt, text, context, "
                        "question or messages)")
    return texts[:limit] if limit else texts, source


def _read_jsonl(path: Path):
    if not path.is_file():
        raise UserError(f"operators.calibration_file: {path} does not exist")
    with path.open() as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UserError(f"{path}:{lineno}: invalid JSON: {exc.msg}") from None
            text = record_text(rec) if isinstance(rec, dict) else None
            if text is None:
                raise UserError(f"{path}:{lineno}: no prompt, text, context, question or messages")
            yield text


class RouterCounter:
    """Forward hooks on every router; `counts` [L, E] tokens per (MoE layer, expert).

    Args:
        model: a loaded transformers MoE model (or one on the meta device, with `attach`
            False: hooks then go on each built layer through `attach_layer`).
    """

    def __init__(self, model, attach: bool = True):
        # lazy: loads torch, which importing this module does not
        from moeflow.model.routing import find_routers

        routers = find_routers(model)
        if not routers:
            raise UserError(f"{type(model).__name__}: no MoE router found (not a mixture-of-experts model)")
        self.names = [name for name, _, _ in routers]
        self.layer_ids = [int(m.group(1)) if (m := re.search(r"layers\.(\d+)\.", n)) else i
                          for i, n in enumerate(self.names)]
        self.num_experts = max(e for _, _, e in routers)
        self.counts = np.zeros((len(routers), self.num_experts), dtype=np.int64)  # [L, E]
        self.mask = None  # [B*T] bool, real (non-padding) positions of the current batch
        self._handles = [m.register_forward_hook(self._hook(i)) for i, (_, m, _) in enumerate(routers)
                         if attach]

    def attach_layer(self, prefix: str, layer) -> list:
        """Hooks on the routers of one built decoder layer whose name in the whole model
        starts with `prefix` ("model.layers.3."); returns the handles."""
        return [layer.get_submodule(name[len(prefix):]).register_forward_hook(self._hook(i))
                for i, name in enumerate(self.names) if name.startswith(prefix)]

    def _hook(self, layer: int):
        # lazy: torch: heavy, loaded only when this runs
        import torch

        def count(module, _inputs, output):
            indices = output[-1]  # [T, top_k] expert ids per token (flattened batch)
            if indices.is_floating_point():  # router logits [T, E]: the router takes their top_k
                indices = indices.topk(module.top_k, dim=-1).indices
            indices = indices.reshape(-1, indices.shape[-1])  # [T, k]
            if self.mask is not None and self.mask.numel() == indices.shape[0]:
                indices = indices[self.mask]
            hist = torch.bincount(indices.reshape(-1), minlength=self.num_experts)  # [E]
            self.counts[layer] += hist.cpu().numpy()
        return count

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def count_tokens(model, tokenizer, texts: list[str], batch_size: int = 8, max_tokens: int = 512):
    """Run `texts` through `model` and count routed tokens.

    Returns:
        (counter with counts [L, E], number of real tokens).
    """
    # lazy: torch: heavy, loaded only when this runs
    import torch

    counter = RouterCounter(model)
    device = next(model.parameters()).device
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokens = 0
    try:
        with torch.inference_mode():
            for start in range(0, len(texts), batch_size):
                batch = tokenizer(texts[start:start + batch_size], return_tensors="pt", padding=True,
                                  truncation=True, max_length=max_tokens).to(device)
                mask = batch["attention_mask"].reshape(-1).bool()  # [B*T]
                counter.mask = mask
                tokens += int(mask.sum())
                model(**batch)
    finally:
        counter.remove()
    return counter, tokens


def count_tokens_streamed(model_dir: str, tokenizer, texts: list[str], dtype, device: str,
                          batch_size: int = 8, max_tokens: int = 512, meter=None):
    """`count_tokens` on the layer-streamed model: one decoder layer resident at a time.

    Returns:
        (counter with counts [L, E], number of real tokens).
    """
    # lazy: loads torch, which importing this module does not
    from moeflow.quant.streamed import StreamedModel

    model = StreamedModel(model_dir, dtype, device, meter=meter)
    counter = RouterCounter(model.source.fam.meta, attach=False)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    batches = [tokenizer(texts[start:start + batch_size], return_tensors="pt", padding=True,
                         truncation=True, max_length=max_tokens)
               for start in range(0, len(texts), batch_size)]
    masks = [b["attention_mask"].reshape(-1).bool().to(model.device) for b in batches]  # [B*T] each

    def on_batch(k: int) -> None:
        counter.mask = masks[k]
    model.hidden_states(batches, on_layer=lambda i, layer: counter.attach_layer(model.layer_prefix(i), layer),
                        on_batch=on_batch)
    return counter, int(sum(int(m.sum()) for m in masks))


def profile_local(model_dir: str, texts: list[str], dtype: str = "float32", batch_size: int = 8,
                  max_tokens: int = 512, device: str = "cpu", streamed: bool = False) -> dict:
    """Load the model once (or stream it a layer at a time) and profile `texts` (one process).

    Returns:
        {"counts": [[...]] (L x E), "layers", "routers", "tokens", "memory": [this process's
         peak above its level before the first tensor was read (moeflow.core.memmeter)]}.
    """
    # lazy: torch, transformers: heavy, loaded only when this runs
    import torch
    from transformers import AutoTokenizer

    from moeflow.core.memmeter import PeakMemory

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    meter = PeakMemory(device)
    if streamed:
        counter, tokens = count_tokens_streamed(model_dir, tokenizer, texts, getattr(torch, dtype), device,
                                                batch_size, max_tokens, meter)
    else:
        meter.start()
        model = load_model(model_dir, getattr(torch, dtype)).to(device).eval()
        counter, tokens = count_tokens(model, tokenizer, texts, batch_size, max_tokens)
    return {"counts": counter.counts.tolist(), "layers": counter.layer_ids,
            "routers": counter.names, "tokens": tokens, "memory": [meter.record()]}


def profile(model_dir: str, texts: list[str], *, dtype: str = "float32", shard_size: int = 256,
            batch_size: int = 8, max_tokens: int = 512, device: str = "cpu", streamed: bool = False) -> dict:
    """Profile over Ray tasks of `shard_size` texts when Ray runs and there is more than
    one shard (each task takes one GPU when `device` is cuda); in this process otherwise.
    `streamed`: each process runs the model layer by layer (`count_tokens_streamed`).

    Returns:
        {"counts" [L][E], "layers", "routers", "tokens", "shards"}.
    """
    shards = [texts[i:i + shard_size] for i in range(0, len(texts), shard_size)]
    # lazy: ray: heavy, loaded only when this runs
    import ray

    # on GPUs, shards need a free one each: this task's own GPU is not released while it waits
    # for them (Ray frees only CPUs of a blocked task), so with none free it profiles here
    no_free_gpu = device == "cuda" and ray.is_initialized() and ray.available_resources().get("GPU", 0) < 1
    if len(shards) == 1 or not ray.is_initialized() or no_free_gpu:
        return dict(profile_local(model_dir, texts, dtype, batch_size, max_tokens, device, streamed), shards=1)
    task = ray.remote(num_cpus=1, num_gpus=1 if device == "cuda" else 0)(profile_local)
    parts = ray.get([task.remote(model_dir, s, dtype, batch_size, max_tokens, device, streamed) for s in shards])
    counts = np.sum([np.asarray(p["counts"]) for p in parts], axis=0)
    return {"counts": counts.tolist(), "layers": parts[0]["layers"], "routers": parts[0]["routers"],
            "tokens": sum(p["tokens"] for p in parts), "shards": len(shards),
            "memory": [m for p in parts for m in p["memory"]]}


def hot_experts(counts: np.ndarray, factor: float = 2.0, limit: int = 8) -> list[list[int]]:
    """Per layer, the experts holding more than `factor` x the mean load, hottest first
    (at most `limit`)."""
    out = []
    for row in counts:
        mean = row.mean()
        hot = [int(e) for e in np.argsort(-row, kind="stable") if mean > 0 and row[e] > factor * mean]
        out.append(hot[:limit])
    return out


def heatmap(counts: np.ndarray, layer_ids: list[int], title: str):
    """Figure: share of each layer's tokens per expert (layers down, experts across)."""
    # lazy: matplotlib: heavy, loaded only when this runs
    import matplotlib

    matplotlib.use("Agg")  # headless: no display in Ray workers
    import matplotlib.pyplot as plt

    share = counts / np.maximum(counts.sum(1, keepdims=True), 1)  # [L, E]
    layers, experts = share.shape
    fig, ax = plt.subplots(figsize=(min(16, 3 + experts * 0.12), min(12, 2 + layers * 0.3)))
    img = ax.imshow(share, aspect="auto", cmap="viridis", interpolation="nearest")
    ax.set_xlabel("expert")
    ax.set_ylabel("decoder layer")
    step = max(1, layers // 16)
    ax.set_yticks(range(0, layers, step), [str(layer_ids[i]) for i in range(0, layers, step)])
    ax.set_title(title)
    fig.colorbar(img, ax=ax, label="share of the layer's routed tokens")
    fig.tight_layout()
    return fig
