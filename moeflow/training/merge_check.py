"""Logits check of a merged kept release: the merged checkpoint against base + adapter.

The reference is the kept base decoded (moeflow.model.packed_base.load_packed, packed=False)
with the adapter applied by PEFT, unmerged; the candidate is the merged checkpoint as
the local engine loads it (routed experts packed). Both run in float32 on fixed token
ids. A merge that touched no packed weight must agree to 1e-5 (relative to the largest
logit); one that requantised experts is measured (max abs error, cosine, mean KL) and
the numbers are recorded: the per-value bound is checked where the weights are written.

Memory: whole, both models in float32 (the reference decodes every expert, one model at
a time). A merge whose decoded model does not fit the host twice over is checked layer by
layer instead (moeflow.quant.streamed over moeflow.training.merge_stream: one decoded layer at a time): the
reference is the base streamed with each layer's adapter delta added to its float32
weights as the layer is built (W + dW, PEFT's own deltas), the candidate the merged
checkpoint streamed; same ids, same numbers recorded (`"streamed": true`).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from moeflow.checkpoint import formats
from moeflow.checkpoint.parse import read_checkpoint
from moeflow.core.errors import UserError

TOLERANCE = 1e-5  # relative to the largest |logit|: float32 rounding of W + dW vs x·W + x·A·B


def _ids(vocab: int) -> torch.Tensor:
    return (torch.arange(48).reshape(3, 16) * 7919 + 13) % vocab  # [B, T] fixed, spread over vocab


def decoded_bytes(model_dir: str | Path) -> int:
    """Bytes of a checkpoint's model in float32, packed weights decoded (headers only)."""
    ckpt = formats.logical_view(read_checkpoint(model_dir))
    return 4 * sum(int(torch.Size(t.shape).numel()) for t in ckpt.tensors.values())


def host_bytes() -> int:
    """This host's physical memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def logits_check(base_dir: str | Path, adapter_dir: str | Path, merged_dir: str | Path,
                 requantized: bool, deltas: dict, streamed: bool | None = None) -> dict:
    """{"max_abs_err", "scale", "cosine", "kl_mean", "tolerance" | None, "passed", "streamed"}.

    Args:
        deltas: {model parameter: () -> its float32 delta}, the adapter's by PEFT's rule
            (merge_kept.adapter_deltas): what the streamed reference adds to each layer.
        streamed: layer by layer (None: when the decoded model exceeds half this host).

    Raises:
        UserError: a merge without requantisation whose logits differ beyond TOLERANCE.
    """
    if streamed is None:
        streamed = 2 * decoded_bytes(merged_dir) > host_bytes()
    ref, cand = _streamed(Path(base_dir), deltas, Path(merged_dir)) if streamed \
        else _whole(Path(base_dir), Path(adapter_dir), Path(merged_dir))
    err = float((cand - ref).abs().max())
    scale = max(1.0, float(ref.abs().max()))
    cos = float(torch.nn.functional.cosine_similarity(cand.flatten(), ref.flatten(), dim=0))
    lp, lq = torch.log_softmax(ref, -1), torch.log_softmax(cand, -1)
    kl = float((lp.exp() * (lp - lq)).sum(-1).mean())
    out = {"max_abs_err": err, "scale": scale, "cosine": cos, "kl_mean": kl,
           "tolerance": None if requantized else TOLERANCE * scale, "streamed": streamed}
    out["passed"] = requantized or err <= TOLERANCE * scale
    if not out["passed"]:
        raise UserError(f"{merged_dir}: merged logits differ from base + adapter by {err:.2e} "
                        f"(tolerance {TOLERANCE * scale:.1e}): not written")
    return out


def _whole(base_dir: Path, adapter_dir: Path, merged_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(reference, candidate) logits [B, T, V], each model loaded whole."""
    # lazy: peft: heavy, loaded only when a merge is checked
    from peft import PeftModel

    from moeflow.model.packed_base import load_packed

    plain, _ = load_packed(base_dir, torch.float32, packed=False)
    ref_model = PeftModel.from_pretrained(plain, str(adapter_dir), torch_device="cpu").eval()
    ids = _ids(ref_model.get_input_embeddings().num_embeddings)
    with torch.no_grad():
        ref = ref_model(input_ids=ids).logits.float()  # [B, T, V]
    del ref_model, plain
    cand_model, _ = load_packed(merged_dir, torch.float32)
    with torch.no_grad():
        cand = cand_model(input_ids=ids).logits.float()  # [B, T, V]
    return ref, cand


def _streamed(base_dir: Path, deltas: dict, merged_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(reference, candidate) logits [B, T, V], each checkpoint run one layer at a time."""
    # lazy: the streamed forward loads transformers' layers and the quant sources
    from moeflow.training.merge_stream import streamed_model

    ref_model = streamed_model(base_dir)
    layered = {i: ref_model.layer_prefix(i) for i in range(ref_model.num_layers)}
    with torch.no_grad():
        for name, delta in deltas.items():  # outside the layers (embeddings, head): once
            if not any(name.startswith(p) for p in layered.values()):
                ref_model.front.model.get_parameter(name).add_(delta())

    def add_deltas(i: int, layer) -> list:
        prefix = layered[i]
        with torch.no_grad():
            for name, delta in deltas.items():
                if name.startswith(prefix):
                    layer.get_parameter(name[len(prefix):]).add_(delta())
        return []

    ids = _ids(ref_model.front.head.weight.shape[0])
    batches = [{"input_ids": ids}]
    ref = ref_model.logits(batches, on_layer=add_deltas)[0].float()
    del ref_model
    cand = streamed_model(merged_dir).logits(batches)[0].float()
    return ref, cand
