"""Plain PyTorch pieces of fine-tuning: steps, routing stats, spikes, checkpoint state."""

from __future__ import annotations

import math

import pytest
import torch

from moeflow.core.config import LoraSection, OptimizerSection
from moeflow.model import routing as R
from moeflow.training import data as D
from moeflow.training import state as S
from moeflow.training import steps as T
from moeflow.training.lora import apply_lora

OPT = OptimizerSection(lr=5e-3, weight_decay=0.0, betas=(0.9, 0.999), warmup_steps=2,
                       schedule="cosine", max_grad_norm=1.0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from moeflow_testing.tiny import build_debug_model

    return build_debug_model("qwen3_moe", tmp_path_factory.mktemp("m") / "model",
                             dtype="float32")


def _peft(path, targets=("attention",)):
    model, tok = T.load_base(str(path), "float32")
    lora = LoraSection(rank=4, alpha=8, dropout=0.0, target_modules=list(targets))
    peft_model, _, _ = apply_lora(model, lora)
    return peft_model, tok


def _batch(tok, n=6):
    recs = [{"prompt": f"reverse: {w}\nanswer:", "completion": " " + w[::-1]}
            for w in ["a b c", "d e f", "g h", "i j k l", "m n o", "p q"][:n]]
    return D.pack(D.tokenize(recs, tok), 32, tok.pad_token_id)


def test_routing_stats_on_known_counts():
    counts = torch.tensor([[4.0, 4.0, 4.0, 4.0], [16.0, 0.0, 0.0, 0.0]])  # [L=2, E=4]
    stats = R.load_stats(counts)
    assert stats["entropy"][0] == pytest.approx(1.0) and stats["entropy"][1] == pytest.approx(0.0)
    assert stats["max_over_mean"] == pytest.approx([1.0, 4.0])
    assert stats["dead_fraction"] == pytest.approx([0.0, 0.75])
    flat = R.step_metrics(counts, [0, 3])
    assert flat["routing/layer3/dead_fraction"] == pytest.approx(0.75)
    assert flat["routing/mean_entropy"] == pytest.approx(0.5)


def test_heatmap_figure_is_closed_after_logging():
    import matplotlib.pyplot as plt

    from moeflow.training.tracker import Tracker

    before = set(plt.get_fignums())
    fig = R.heatmap_figure(torch.ones(2, 4), [0, 1], "load")  # [L=2, E=4]
    Tracker(None, None, enabled=False).figure(fig, "routing/heatmap.png")
    assert set(plt.get_fignums()) == before  # pyplot would keep it alive otherwise


def test_spike_detector():
    det = R.SpikeDetector(window=10, k=3.0, min_history=5)
    assert all(det.update(2.0 + 0.01 * (i % 3)) is None for i in range(10))
    spike = det.update(5.0)
    assert spike and spike["z"] > 3 and det.update(2.0) is None


def test_schedule_warmup_then_cosine():
    model = torch.nn.Linear(2, 2)
    opt, sched = T.make_optimizer(model, OPT, max_steps=10)
    lrs = []
    for _ in range(10):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert lrs[0] == pytest.approx(OPT.lr / 2) and lrs[1] == pytest.approx(OPT.lr)
    assert lrs[-1] < lrs[2] and lrs[-1] == pytest.approx(
        OPT.lr * 0.5 * (1 + math.cos(math.pi * 7 / 8)))


def test_train_steps_lower_the_loss_and_tap_routing(tiny):
    model, tok = _peft(tiny)
    rows = _batch(tok)
    tap = T.RouterTap(model, top_k=2)
    assert tap.layer_ids == [0, 1]
    opt, sched = T.make_optimizer(model, OPT, max_steps=30)
    losses = []
    for _ in range(30):
        r = T.forward_backward(model, rows, 1.0, tap, num_experts=8)
        T.optimizer_step(model, opt, sched, 1.0)
        losses.append(r["loss"])
    assert losses[-1] < losses[0] - 0.5
    assert r["counts"].shape == (2, 8)
    assert r["counts"].sum(-1).tolist() == [2.0 * rows["real"].sum()] * 2  # every real token x k
    assert r["aux_loss"] > 0 and r["tokens"] == int((rows["labels"] != -100).sum())
    assert T.allreduce_lora_grads(model, world=1) == 0


def test_checkpoint_state_round_trip(tiny, tmp_path):
    model, tok = _peft(tiny)
    rows = _batch(tok)
    opt, sched = T.make_optimizer(model, OPT, max_steps=10)
    for _ in range(3):
        T.forward_backward(model, rows, 1.0, None, 0)
        T.optimizer_step(model, opt, sched, 1.0)
    S.save_checkpoint(tmp_path / "ck", model, opt, sched, 3, {"base_exact_match": 0.1},
                      {"routing_total": torch.ones(2, 8)})
    assert (tmp_path / "ck/adapter/adapter_model.safetensors").is_file()
    fresh, _ = _peft(tiny)
    opt2, sched2 = T.make_optimizer(fresh, OPT, max_steps=10)
    step, extra, tensors = S.load_checkpoint(tmp_path / "ck", fresh, opt2, sched2)
    assert step == 3 and extra == {"base_exact_match": 0.1}
    assert torch.equal(tensors["routing_total"], torch.ones(2, 8))
    assert sched2.get_last_lr() == sched.get_last_lr()
    # one more identical step on both gives identical adapters
    for m, o, s in ((model, opt, sched), (fresh, opt2, sched2)):
        T.forward_backward(m, rows, 1.0, None, 0)
        T.optimizer_step(m, o, s, 1.0)
    a = {n: p for n, p in model.named_parameters() if p.requires_grad}
    b = {n: p for n, p in fresh.named_parameters() if p.requires_grad}
    assert all(torch.allclose(a[n], b[n], atol=1e-6) for n in a)


def test_resume_refuses_an_adapter_missing_lora_tensors(tiny, tmp_path):
    """A LoRA tensor absent from the checkpoint used to stay at its fresh init, silently."""
    model, _ = _peft(tiny, targets=("q_proj",))
    opt, sched = T.make_optimizer(model, OPT, max_steps=10)
    S.save_checkpoint(tmp_path / "ck", model, opt, sched, 1, {})
    wider, _ = _peft(tiny, targets=("q_proj", "v_proj"))
    opt2, sched2 = T.make_optimizer(wider, OPT, max_steps=10)
    with pytest.raises(RuntimeError, match="adapter lacks .* LoRA tensor.*v_proj"):
        S.load_checkpoint(tmp_path / "ck", wider, opt2, sched2)


def test_eval_loss_skips_rows_without_loss_tokens(tiny):
    model, tok = _peft(tiny)
    rows = _batch(tok, n=2)
    empty = {k: v[:1].clone() for k, v in rows.items()}
    empty["labels"][:] = D.IGNORE  # a row that carries no loss
    both = {k: torch.cat([rows[k], empty[k]]) for k in rows}
    assert T.eval_loss(model, both, batch_size=1) == pytest.approx(
        T.eval_loss(model, rows, batch_size=1))


def test_packed_examples_do_not_attend_to_each_other(tiny):
    """With the config's use_cache=True, transformers skipped its packed-sequence mask:
    losses of packed rows mixed examples (the finetune eval_loss differed by ~1%)."""
    model, tok = _peft(tiny)
    assert model.config.use_cache  # the checkpoint's default, as in any HF config
    recs = [{"prompt": f"reverse: {w}\nanswer:", "completion": " " + w[::-1]}
            for w in ["a b c", "d e f g"]]
    exs = D.tokenize(recs, tok)
    packed = D.pack(exs, 64, tok.pad_token_id)  # [R=1, S]: both examples in one row
    alone = [D.pack([e], 64, tok.pad_token_id) for e in exs]
    assert packed["input_ids"].shape[0] == 1
    total, count = T.eval_loss_sum(model, packed, 4)
    parts = [T.eval_loss_sum(model, rows, 4) for rows in alone]
    assert count == sum(c for _, c in parts)
    assert total == pytest.approx(sum(t for t, _ in parts), rel=1e-5)
    r = T.forward_backward(model, packed, 1.0, None, 0)  # the training forward, too
    assert r["loss"] == pytest.approx(total / count, rel=1e-5)


def test_generation_and_exact_match(tiny):
    model, tok = _peft(tiny)
    exs = D.tokenize([{"prompt": "reverse: a b\nanswer:", "completion": " b a"}] * 3, tok)
    preds = T.generate_completions(model, exs, tok.pad_token_id, tok.eos_token_id, tok)
    assert len(preds) == 3 and len(set(preds)) == 1  # greedy + left padding: deterministic
    assert T.exact_hits([" b a", "x", "b a "], exs) == [True, False, True]


def test_loss_spike_is_logged_with_its_routing(tmp_path):
    from mlflow.tracking import MlflowClient

    from moeflow.training.tracker import Tracker, log_step

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(tracking_uri=uri)
    run_id = client.create_run(client.create_experiment(
        "spikes", artifact_location=str(tmp_path / "art"))).info.run_id
    tracker = Tracker(run_id, uri, enabled=True)
    det = R.SpikeDetector(window=5, k=3.0, min_history=5)
    counts = torch.tensor([[6.0, 2.0, 0.0, 0.0]])  # [L=1, E=4]
    spikes = [log_step(tracker, det, {"loss": loss, "comm_bytes": 64}, counts, [0], step)
              for step, loss in enumerate([2.0, 2.1, 2.0, 2.1, 2.0, 9.0], start=1)]
    tracker.flush()
    assert spikes[:5] == [None] * 5 and spikes[5]["z"] > 3
    event = client.list_artifacts(run_id, "events")
    assert [a.path for a in event] == ["events/loss_spike_step000006.json"]
    run = client.get_run(run_id)
    assert run.data.metrics["train/loss_spike"] == 1.0
    assert run.data.metrics["routing/layer0/dead_fraction"] == 0.5
    assert run.data.metrics["comm/allreduce_bytes_per_step"] == 64
    assert len(client.get_metric_history(run_id, "train/loss")) == 6


def test_router_tap_finds_a_lora_wrapped_router():
    """Router LoRA wraps the gate in PEFT's ParamWrapper (`gate.base_layer`): the tap
    found no router then, and routing statistics silently vanished."""
    from transformers import AutoModelForCausalLM

    from moeflow_testing.tiny import debug_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(debug_config("qwen3_moe"))
    lora = LoraSection(rank=4, alpha=8, dropout=0.0, target_modules=["router", "experts"])
    peft_model, _, _ = apply_lora(model, lora)
    tap = T.RouterTap(peft_model, top_k=2)
    assert tap.layer_ids == [0, 1]
    peft_model(input_ids=torch.randint(0, 500, (1, 8)))  # [B=1, S=8]
    assert tap.counts(8, None).sum(-1).tolist() == [16.0, 16.0]  # 8 tokens x k=2 per layer


def test_routed_experts_and_tap_on_gating_routers():
    """The router's [T, K] choice is read whatever it appends; JetMoE's `*Gating` routers
    (sorted positions first, logits last) are found by the anatomy and counted from logits."""
    from moeflow.serving.metrics import ExpertLoad
    from moeflow_testing.tiny_auto import tiny_config, tiny_model

    logits = torch.randn(5, 4)  # [T, E]
    idx = logits.topk(2, -1).indices  # [T, K]
    extra = torch.bincount(idx.reshape(-1), minlength=4)  # an appended int output [E]
    assert torch.equal(R.routed_experts((logits, logits.softmax(-1)[:, :2], idx, extra), 2, 4), idx)
    assert torch.equal(R.routed_experts((idx.reshape(-1), torch.rand(10), logits), 2, 4), idx)
    assert R.routed_experts((torch.rand(10),), 2, 4) is None
    cfg = tiny_config("jetmoe", vocab_size=64)
    model = tiny_model("jetmoe", config=cfg).eval()
    k, e = cfg.num_experts_per_tok, cfg.num_local_experts
    tap = T.RouterTap(model, top_k=k)
    load = ExpertLoad(model)
    assert tap.layer_ids == [0, 0, 1, 1]  # the MLP's and the attention experts' routers
    with torch.no_grad():
        model(input_ids=torch.randint(0, 64, (2, 5)))
    assert tap.counts(e, None).sum(-1).tolist() == [10.0 * k] * 4  # every token x k
    assert load.total.sum(-1).tolist() == [10 * k] * 4


def test_the_router_aux_loss_leaves_a_packed_rows_padding_alone(tiny):
    """A packed row's padding is a segment of zero embeddings whose hidden states stay zero, where
    RMSNorm's backward multiplies by 1 / sqrt(eps): transformers' aux loss (no attention mask in a
    packed forward) sends the padding gradient, which a deep model's backward blows up to NaN. The
    stage's loss counts the real tokens only: the same as transformers' over the row without its
    padding, and no gradient reaches the padding."""
    model, tok = _peft(tiny)
    rows = _batch(tok, 2)  # one row: two examples, then padding
    real = rows["real"]
    n = int(real.sum())
    assert n < real.shape[1]  # the row has padding
    embed = model.get_input_embeddings()

    def forward(upto):
        emb = embed(rows["input_ids"][:, :upto]).detach().requires_grad_(True)
        out = model(inputs_embeds=emb, position_ids=T.packed_positions(model, rows["position_ids"][:, :upto]),
                    use_cache=False, output_router_logits=True)
        return emb, out
    emb, out = forward(None)
    ours = T.router_aux_loss(model, out, real)
    _, trimmed = forward(n)  # the real tokens alone: their routing is the same (padding is its own segment)
    assert ours.item() == pytest.approx(trimmed.aux_loss.item(), rel=1e-5)
    assert ours.item() != pytest.approx(out.aux_loss.item(), rel=1e-5)  # transformers' counts the padding
    base = model.get_base_model()
    cls = type(base)
    base.__class__ = type(f"FSDP{cls.__name__}", (cls,), {"__module__": __name__})  # as FSDP2's fully_shard
    try:  # a subclass made in another module: the family's function is found through its bases
        assert T.router_aux_loss(model, out, real).item() == ours.item()
    finally:
        base.__class__ = cls
    ours.backward(retain_graph=True)
    assert emb.grad[0, n:].abs().max() == 0 and emb.grad[0, :n].abs().max() > 0
    emb.grad = None
    out.aux_loss.backward()
    assert emb.grad[0, n:].abs().max() > 0  # what the stage no longer does


def test_a_family_without_a_maskable_aux_loss_keeps_its_own_and_says_so(tiny, monkeypatch, caplog):
    import sys

    model, tok = _peft(tiny)
    rows = _batch(tok, 2)
    out = model(input_ids=rows["input_ids"], position_ids=T.packed_positions(model, rows["position_ids"]),
                use_cache=False, output_router_logits=True)
    module = sys.modules[type(model.get_base_model()).__module__]
    monkeypatch.delattr(module, "load_balancing_loss_func")
    monkeypatch.setattr(T, "_WARNED", [])
    with caplog.at_level("WARNING", logger="moeflow.training"):
        assert T.router_aux_loss(model, out, rows["real"]) is out.aux_loss
    assert "over padding too" in caplog.text and "router_aux_loss_coef" in caplog.text
