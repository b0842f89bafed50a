"""Token-weighted loss: a step's gradient weighs every target token the same, whichever
micro-batch and data-parallel rank it is in (gloo on CPU, real processes)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moeflow.core.config import LoraSection
from moeflow.training import data as D
from moeflow.training import steps as T
from moeflow.training.lora import apply_lora
from tests.conftest import free_port

WORDS = ["a b c d e f g h", "i j", "k l m n o p", "q", "r s t u", "v w x y z a b", "c d", "e f g"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from moeflow_testing.tiny import build_debug_model

    return build_debug_model("qwen3_moe", tmp_path_factory.mktemp("m") / "model", dtype="float32")


def _model(path):
    torch.manual_seed(0)
    model, tok = T.load_base(str(path), "float32")
    lora = LoraSection(rank=4, alpha=8, dropout=0.0, target_modules=["attention"])
    peft_model, _, _ = apply_lora(model, lora)
    for name, p in peft_model.named_parameters():  # B = 0 at init would zero A's gradient
        if p.requires_grad and "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02, generator=torch.Generator().manual_seed(len(name)))
    return peft_model, tok


def _micro_batches(tok) -> list[dict]:
    """Four micro-batches of one packed row each, with very different target-token counts."""
    recs = [{"prompt": f"copy: {w}\nanswer:", "completion": " " + w * (i % 3 + 1)}
            for i, w in enumerate(WORDS)]
    rows = D.pack(D.tokenize(recs, tok), 48, tok.pad_token_id)
    batches = [{k: v[i:i + 1] for k, v in rows.items()} for i in range(rows["input_ids"].shape[0])]
    counts = [T.loss_tokens(b) for b in batches]
    assert len(batches) >= 4 and len(set(counts[:4])) > 1, counts  # uneven, or the test proves nothing
    return batches[:4]


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()
            if p.requires_grad and p.grad is not None}


def _rank(rank: int, world: int, port: int, path: str, batches: list[dict], out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        model, _ = _model(path)
        per = len(batches) // world
        mine = batches[rank * per:(rank + 1) * per]
        r = T.accumulate(model, mine, None, 8, world)
        T.allreduce_lora_grads(model, world, average=False)
        if rank == 0:
            torch.save({"grads": _grads(model), "token_total": r["token_total"]}, out)
    finally:
        dist.destroy_process_group()


def test_two_ranks_of_n_equal_one_rank_of_2n(tiny, tmp_path):
    model, tok = _model(tiny)
    batches = _micro_batches(tok)
    single = T.accumulate(model, batches, None, 8, world=1)
    want = _grads(model)
    assert single["token_total"] == sum(T.loss_tokens(b) for b in batches)

    out = tmp_path / "rank0.pt"
    mp.spawn(_rank, args=(2, free_port(), str(tiny), batches, str(out)), nprocs=2, join=True)
    got = torch.load(out)
    assert got["token_total"] == single["token_total"]
    assert want.keys() == got["grads"].keys() and want
    for name, g in want.items():
        torch.testing.assert_close(got["grads"][name], g, rtol=1e-4, atol=1e-7, msg=name)

    # the test can fail: a mean of per-micro-batch means gives a different gradient here
    model.zero_grad(set_to_none=True)
    for b in batches:
        T.forward_backward(model, b, 1.0 / len(batches), None, 8)
    naive = _grads(model)
    assert any(not torch.allclose(naive[n], want[n], rtol=1e-3, atol=1e-6) for n in want)


def test_step_loss_is_token_mean(tiny):
    """The step's reported loss sum / token total is the mean loss per target token."""
    model, tok = _model(tiny)
    batches = _micro_batches(tok)
    r = T.accumulate(model, batches, None, 8, world=1)
    per_batch = [T.forward_backward(model, b, 1.0, None, 8) for b in batches]
    mean = sum(p["loss_sum"] for p in per_batch) / sum(p["tokens"] for p in per_batch)
    assert r["loss_sum"] / r["token_total"] == pytest.approx(mean, rel=1e-5)


def _diverge(model, poisoned: bool) -> None:
    """Gradients on every LoRA tensor, one of them NaN where `poisoned`."""
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.ones_like(p)
    if poisoned:
        next(p for p in model.parameters() if p.requires_grad).grad[0].fill_(float("nan"))


def _optimizer(model):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)


def test_a_non_finite_gradient_stops_training_before_the_adapter_changes(tiny):
    from moeflow.core.errors import UserError

    model, _ = _model(tiny)
    opt, sched = _optimizer(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    _diverge(model, poisoned=True)
    with pytest.raises(UserError, match="gradient norm is nan on some rank at step 1, in the first step"):
        T.optimizer_step(model, opt, sched, 1.0)
    for n, p in model.named_parameters():
        if p.requires_grad:
            assert torch.equal(p, before[n]) and p.grad is None, n  # untouched, grads dropped
    _diverge(model, poisoned=False)  # the test can fail: finite gradients do step
    T.optimizer_step(model, opt, sched, 1.0)
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters() if p.requires_grad)
    _diverge(model, poisoned=True)  # after an update: the learning rate is what to change
    with pytest.raises(UserError, match="at step 2, training diverged .lower optimizer.lr"):
        T.optimizer_step(model, opt, sched, 1.0)


def _diverging_rank(rank: int, world: int, port: int, path: str, out: str) -> None:
    from moeflow.core.errors import UserError

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        model, _ = _model(path)
        opt, sched = _optimizer(model)
        _diverge(model, poisoned=rank == 1)  # one rank's gradient only
        try:
            T.optimizer_step(model, opt, sched, 1.0)
            said = "stepped"
        except UserError:
            said = "stopped"
        with open(f"{out}.{rank}", "w") as f:
            f.write(said)
    finally:
        dist.destroy_process_group()


def test_every_rank_stops_when_one_ranks_gradient_is_not_finite(tiny, tmp_path):
    """No rank steps on (and none waits for the others in the next step's collectives)."""
    out = tmp_path / "said"
    mp.spawn(_diverging_rank, args=(2, free_port(), str(tiny), str(out)), nprocs=2, join=True)
    assert [(tmp_path / f"said.{r}").read_text() for r in range(2)] == ["stopped", "stopped"]
