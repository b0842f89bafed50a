"""moeflow.checkpoint.requant: a merged weight quantised back into each compressed-tensors
format of the tiny releases (and DeepSeek's FP8 blocks): the release's own part names,
dtypes and shapes; compressed-tensors' own decoder reads it back; every value within the
format's documented bound, which is tight (the worst value reaches more than half of it)."""

from __future__ import annotations

import pytest
import torch

from moeflow_testing.releases import SCHEMES

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    from moeflow_testing.tiny import build_debug_model

    root = tmp_path_factory.mktemp("requant")
    return root, build_debug_model("qwen3_moe", root / "qwen", dtype="float32")


def _heavy(w: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # heavy-tailed: some values far outside the release's range, most near it
    return torch.randn(w.shape, generator=g) * w.std() * 0.3 * torch.exp(torch.randn(w.shape, generator=g))


@pytest.mark.parametrize("name", SCHEMES)
def test_requantised_parts_match_the_release_and_stay_within_the_bound(qwen, name):
    from moeflow.checkpoint.formats import _ct_decode, find_packed, read
    from moeflow.checkpoint.parse import read_checkpoint
    from moeflow.checkpoint.requant import requantize, unsupported
    from moeflow_testing.releases import ct_release

    root, src = qwen
    packed, _ = find_packed(read_checkpoint(ct_release(src, root / name, name, experts_only=True)))
    worst = 0.0
    for i, (key, info) in enumerate(sorted(packed.items())[:6]):
        assert unsupported(info) is None
        merged = read(info) + _heavy(read(info), i)
        parts, stats = requantize(info, merged)
        stored = {p.name: p for _, p in info.parts}
        assert parts.keys() == stored.keys()
        assert all(tuple(parts[k].shape) == tuple(p.shape) and str(parts[k].dtype) == str(p.torch_dtype)
                   for k, p in stored.items())
        back = _ct_decode(info, {role: parts[p.name] for role, p in info.parts})
        assert float((back - merged).abs().max()) == pytest.approx(stats["max_abs"], rel=1e-6)
        assert stats["within_bound"] and 0 < stats["rel_rms"] < 0.3, (key, stats)
        worst = max(worst, stats["max_over_bound"])
    assert 0.5 < worst <= 1.0


def test_fp8_weight_scale_inv_blocks_within_the_bound():
    from moeflow.checkpoint import fp8
    from moeflow.checkpoint.requant import fp8_blocks

    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 64, 48, generator=g) * torch.exp(torch.randn(3, 64, 48, generator=g))  # [E, R, C]
    parts, stats = fp8_blocks("w", "w_scale_inv", w, (16, 16))
    assert parts["w"].dtype == torch.float8_e4m3fn and tuple(parts["w_scale_inv"].shape) == (3, 4, 3)
    back = fp8.dequantize(parts["w"], parts["w_scale_inv"], (16, 16), torch.float32)
    assert float((back - w).abs().max()) == stats["max_abs"]
    assert stats["within_bound"] and 0.5 < stats["max_over_bound"] <= 1.0
