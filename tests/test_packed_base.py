"""LoRA over a frozen quantised base: experts stay packed, decoded one expert per matmul;
logits, loss and LoRA gradients equal the bf16-dequantised base's."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def releases(tmp_path_factory):
    from moeflow_testing.releases import ct_release, mxfp4_release
    from moeflow_testing.tiny import build_debug_model

    root = tmp_path_factory.mktemp("packed")
    qwen = build_debug_model("qwen3_moe", root / "qwen")
    oss = build_debug_model("gpt_oss", root / "oss")
    return {"mxfp4-gpt-oss": mxfp4_release(oss, root / "oss-mxfp4"),
            "int4": ct_release(qwen, root / "int4", "int4-group-asym"),
            "fp8": ct_release(qwen, root / "fp8", "fp8-block")}


def _lora_step(model):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                            target_modules=["q_proj", "v_proj"]))
    ids = torch.arange(48).reshape(2, 24) * 5 % 300
    loss = peft(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in peft.named_parameters() if p.grad is not None}
    return loss.detach(), grads


@pytest.mark.parametrize("name", ["mxfp4-gpt-oss", "int4", "fp8"])
def test_packed_base_equals_dequantised_base(releases, name):
    from moeflow.model.packed_base import PackedExperts, load_packed

    packed, held = load_packed(releases[name])
    plain, none = load_packed(releases[name], packed=False)
    assert held and not none and all(isinstance(v, PackedExperts) for v in held.values())
    experts = dict(plain.named_parameters())
    for pname, pw in held.items():  # stored bytes: a fraction of the decoded tensor's
        assert pw.nbytes < 0.6 * experts[pname].numel() * 2  # of bf16
    ids = torch.arange(32).reshape(2, 16) * 3 % 300
    for n, t in packed.named_buffers():  # rebuilt after the meta build (rotary frequencies)
        assert torch.isfinite(t).all(), n
    with torch.no_grad():
        la, lb = packed(input_ids=ids).logits, plain(input_ids=ids).logits
        assert torch.equal(la, lb), (la - lb).abs().max()
    before = sum(pw.decodes for pw in held.values())
    (loss_a, grads_a), (loss_b, grads_b) = _lora_step(packed), _lora_step(plain)
    assert torch.equal(loss_a, loss_b) and grads_a.keys() == grads_b.keys() and grads_a
    assert all(torch.equal(grads_a[k], grads_b[k]) for k in grads_a)
    # every expert matmul decoded its weight in forward and again in backward (none saved)
    forward = sum(pw.decodes for pw in held.values()) - before
    assert forward > 0 and forward % 2 == 0
