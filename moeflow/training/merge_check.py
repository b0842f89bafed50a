"""Logits check of a merged kept release: the merged checkpoint against base + adapter.

The reference is the kept base decoded (moeflow.packed_base.load_packed, packed=False)
with the adapter applied by PEFT, unmerged; the candidate is the merged checkpoint as
the local engine loads it (routed experts packed). Both run in float32 on fixed token
ids. A merge that touched no packed weight must agree to 1e-5 (relative to the largest
logit); one that requantised experts is measured (max abs error, cosine, mean KL) and
the numbers are recorded: the per-value bound is checked where the weights are written.

Memory: both models whole, in float32 (the reference decodes every expert): meant for
checkpoints that fit one host; larger merges pass `check_logits=False` and rely on the
per-tensor checksums and the requantisation bound.
"""

from __future__ import annotations

from pathlib import Path

import torch

from moeflow.errors import UserError

TOLERANCE = 1e-5  # relative to the largest |logit|: float32 rounding of W + dW vs x·W + x·A·B


def _ids(vocab: int) -> torch.Tensor:
    return (torch.arange(48).reshape(3, 16) * 7919 + 13) % vocab  # [B, T] fixed, spread over vocab


def logits_check(base_dir: str | Path, adapter_dir: str | Path, merged_dir: str | Path,
                 requantized: bool) -> dict:
    """{"max_abs_err", "scale", "cosine", "kl_mean", "tolerance" | None, "passed"}.

    Raises:
        UserError: a merge without requantisation whose logits differ beyond TOLERANCE.
    """
    # lazy: peft: heavy, loaded only when a merge is checked
    from peft import PeftModel

    from moeflow.packed_base import load_packed

    plain, _ = load_packed(base_dir, torch.float32, packed=False)
    ref_model = PeftModel.from_pretrained(plain, str(adapter_dir), torch_device="cpu").eval()
    ids = _ids(ref_model.get_input_embeddings().num_embeddings)
    with torch.no_grad():
        ref = ref_model(input_ids=ids).logits.float()  # [B, T, V]
    del ref_model, plain
    cand_model, _ = load_packed(merged_dir, torch.float32)
    with torch.no_grad():
        cand = cand_model(input_ids=ids).logits.float()  # [B, T, V]
    err = float((cand - ref).abs().max())
    scale = max(1.0, float(ref.abs().max()))
    cos = float(torch.nn.functional.cosine_similarity(cand.flatten(), ref.flatten(), dim=0))
    lp, lq = torch.log_softmax(ref, -1), torch.log_softmax(cand, -1)
    kl = float((lp.exp() * (lp - lq)).sum(-1).mean())
    out = {"max_abs_err": err, "scale": scale, "cosine": cos, "kl_mean": kl,
           "tolerance": None if requantized else TOLERANCE * scale}
    out["passed"] = requantized or err <= TOLERANCE * scale
    if not out["passed"]:
        raise UserError(f"{merged_dir}: merged logits differ from base + adapter by {err:.2e} "
                        f"(tolerance {TOLERANCE * scale:.1e}): not written")
    return out
