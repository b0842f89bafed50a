"""The experts' grouped GEMM inside compiled forwards (moeflow/model/grouped_gemm.py): on CPU in
float32 a compiled experts forward computing with SPLIT_IMPL calls torch's native grouped GEMM
(`moeflow::grouped_mm`), not transformers' per-expert Python loop, and gives the eager
forward's output; with gradients on it keeps transformers' differentiable path; and compiled
serving switches a grouped_mm model to it."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.moe import grouped_mm_experts_forward

from moeflow.model.split_lora import SPLIT_IMPL, split_lora_experts_forward
from moeflow.serving.runner import ModelRunner
from moeflow_testing.tiny_auto import tiny_model


@pytest.fixture()
def model():
    torch.manual_seed(0)
    return tiny_model("qwen3_moe").eval().float()


def _experts(model):
    return next(m for m in model.modules() if hasattr(m, "gate_up_proj") and hasattr(m, "has_gate"))


def _inputs(experts, tokens: int, top_k: int = 2):
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(tokens, experts.gate_up_proj.shape[-1], generator=g)
    scores = torch.rand(tokens, experts.num_experts, generator=g)
    weights, index = scores.topk(top_k, dim=-1)
    return hidden, index, weights


def _compiled_graph(fn):
    """fn compiled (dynamic shapes), and the FX graphs Dynamo handed the backend."""
    graphs: list[str] = []

    def backend(gm, example_inputs):
        graphs.append(str(gm.graph))
        return gm.forward
    torch._dynamo.reset()
    return torch.compile(fn, backend=backend, dynamic=True), graphs


def test_a_compiled_experts_forward_calls_the_native_grouped_gemm_and_matches_eager(model):
    experts = _experts(model)
    compiled, graphs = _compiled_graph(lambda h, i, w: split_lora_experts_forward(experts, h, i, w))
    with torch.no_grad():
        for tokens in (3, 16, 7):  # one graph for every row count
            h, i, w = _inputs(experts, tokens)
            want = grouped_mm_experts_forward(experts, h, i, w)
            torch.testing.assert_close(compiled(h, i, w), want, rtol=1e-5, atol=1e-6)
    assert graphs and all("moeflow.grouped_mm" in g for g in graphs), graphs
    assert not any("grouped_mm_fallback" in g for g in graphs)


def test_with_gradients_on_the_compiled_forward_keeps_the_differentiable_path(model):
    experts = _experts(model)
    compiled, graphs = _compiled_graph(lambda h, i, w: split_lora_experts_forward(experts, h, i, w))
    h, i, w = _inputs(experts, 5)
    out = compiled(h, i, w)
    out.sum().backward()  # the moeflow operator has no backward: it must not be in this graph
    assert experts.gate_up_proj.grad is not None and experts.gate_up_proj.grad.abs().sum() > 0
    assert graphs and not any("moeflow.grouped_mm" in g for g in graphs)
    torch.testing.assert_close(out.detach(), grouped_mm_experts_forward(experts, h, i, w).detach(),
                               rtol=1e-5, atol=1e-6)


def test_compiled_serving_computes_grouped_mm_experts_with_the_split_implementation(model):
    assert model.config._experts_implementation == "grouped_mm"
    ModelRunner(model)  # eager serving: as it was
    assert model.config._experts_implementation == "grouped_mm"
    ModelRunner(model, compile=True)
    assert model.config._experts_implementation == SPLIT_IMPL
    other = tiny_model("qwen3_moe").eval().float()
    other.set_experts_implementation("batched_mm")
    ModelRunner(other, compile=True)  # another kernel: left as chosen
    assert other.config._experts_implementation == "batched_mm"
