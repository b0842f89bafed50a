"""Many adapters in one packed paged forward (lora_batch.py's token -> slot map, issue 48):
the delta of every token is its row's adapter's, in both of BatchedLora's plans; a paged step
of several adapters and base rows is one forward whose greedy tokens equal each request run
alone; a failing mixed forward still fails only its own row."""

from __future__ import annotations

import pytest
import torch

from moeflow.serving import lora_batch
from moeflow.serving.adapters import AdapterRegistry, make_spec
from moeflow.serving.engine import Engine, EngineConfig, SamplingParams
from moeflow.serving.lora_batch import BatchedLora
from moeflow_testing.serving import IdTokenizer, make_lora_adapter
from moeflow_testing.tiny import build_debug_model

NEW = 6
ADAPTERS = ("a0", "a1", "a2")


class Toy(torch.nn.Module):
    """A projection on every token, then a head on the kept positions (as lm_head after
    transformers' logits_to_keep)."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 6)
        self.head = torch.nn.Linear(6, 5)

    def forward(self, x, keep):
        return self.head(self.proj(x)[:, keep])


def _adapters(gen: torch.Generator) -> dict[str, dict]:
    """Three adapters of ranks 2, 3, 4 on `proj`; two of them also on `head`."""
    out: dict[str, dict] = {}
    for i, name in enumerate(ADAPTERS):
        r = 2 + i
        out[name] = {"proj": (torch.randn(r, 8, generator=gen), torch.randn(6, r, generator=gen), 0.5 + i)}
        if i:
            out[name]["head"] = (torch.randn(r, 6, generator=gen), torch.randn(5, r, generator=gen), 2.0)
    return out


def _reference(toy: Toy, adapters: dict, x: torch.Tensor, slots: list[str | None], keep) -> torch.Tensor:
    """Token by token, each with its own adapter's scale * B @ A added ([N, I] in, [K, 5] out)."""
    def lin(name, mod, v, who):
        out = mod(v)
        if who is not None and name in adapters[who]:
            a, b, s = adapters[who][name]
            out = out + s * (v @ a.T @ b.T)
        return out
    h = torch.stack([lin("proj", toy.proj, x[t], slots[t]) for t in range(x.shape[0])])
    return torch.stack([lin("head", toy.head, h[t], slots[t]) for t in keep])


@pytest.mark.parametrize("plan", ["dense", "runs"])
def test_every_packed_token_gets_its_rows_adapter(plan, monkeypatch):
    if plan == "runs":
        monkeypatch.setattr(lora_batch, "_DENSE_FLOPS", 0)
    gen = torch.Generator().manual_seed(0)
    toy = Toy().eval()
    adapters = _adapters(gen)
    batched = BatchedLora.over_base(toy, adapters)
    rows = ["a1", None, "a0", "a2", "a1"]  # a base row; a1's rows apart (two runs of one slot)
    counts = [1, 3, 1, 4, 2]
    slots = [r for r, n in zip(rows, counts) for _ in range(n)]  # [T]
    x = torch.randn(1, len(slots), 8, generator=gen)
    keep = torch.tensor([0, 3, 4, 8, 10])  # each row's last token
    with torch.no_grad():
        batched.select([batched.slot[r] if r else 0 for r in rows], counts, keep)
        got = toy(x, keep)[0]
        assert {p[0] for p in batched._plans.values()} == {plan}
        batched.clear()
        want = _reference(toy, adapters, x[0], slots, keep.tolist())
        assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
        # a padded batch ([B, C, I]): every column takes its row's slot
        xb = torch.randn(3, 4, 8, generator=gen)
        batched.select([2, 0, 3])
        got = toy(xb, torch.arange(4))
        batched.clear()
        for b, who in enumerate(("a1", None, "a2")):
            assert torch.allclose(got[b], _reference(toy, adapters, xb[b], [who] * 4, range(4)), atol=1e-5)
        batched.close()
        assert torch.equal(toy(x, keep), Toy.forward(toy, x, keep))  # the modules given back


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Tiny Qwen3-MoE and three attention adapters."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("packed-mixed")
    base = build_debug_model("qwen3_moe", root / "base")
    paths = {n: make_lora_adapter(base, root / "adapters" / n, seed=10 + i) for i, n in enumerate(ADAPTERS)}
    return {"base": base, "paths": paths, "root": root}


def _engine(world, **cfg) -> Engine:
    from moeflow.model.models import load_model

    reg = AdapterRegistry(world["root"] / "adapters")
    for n, path in world["paths"].items():
        reg.add(make_spec(n, path))
    return Engine(load_model(world["base"], torch.float32), IdTokenizer(), EngineConfig(**cfg), reg)


# (adapter, prompt): three adapters and the base, prompts of several lengths, two rows per adapter
REQUESTS = [(a, [(5 + 7 * i + j) % 90 + 4 for j in range(3 + 5 * (i % 4))])
            for i, a in enumerate([None, "a0", "a1", "a2", "a2", "a1", "a0", None])]


def _run(engine: Engine, requests, names=None) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for i, (adapter, prompt) in enumerate(requests):
        name = (names or {}).get(i, str(i))
        out[name] = []

        def sink(d, name=name):
            out[name].extend(d.token_ids)
            if d.finish_reason == "error":
                out[name + ":error"] = [1]
        engine.submit(name, prompt, SamplingParams(max_tokens=NEW, ignore_eos=True), sink, adapter=adapter)
    engine.run_until_idle()
    return out


def _alone(world) -> dict[str, list[int]]:
    engine = _engine(world, max_loras=4)
    out = {}
    for i, req in enumerate(REQUESTS):
        out.update(_run(engine, [req], {0: str(i)}))
    engine.stop()
    return out


@pytest.fixture(scope="module")
def alone(world):
    return _alone(world)


def test_a_mixed_paged_step_is_one_forward_with_each_requests_own_tokens(world, alone):
    # the adapters change what is generated: the equality below is not vacuous
    assert len({tuple(alone[str(i)]) for i in range(4)}) == 4
    # a small token budget: prompt chunks of several adapters beside decodes of others
    engine = _engine(world, max_loras=4, max_num_batched_tokens=16, long_prefill_token_threshold=6)
    runner = engine.core.runner
    real, mixes = runner.packed, []

    def counted(rows, *args):
        mixes.append({s.adapter for s, _ in rows})
        return real(rows, *args)
    for n in ADAPTERS:  # resident before the requests: they all run from the first step
        engine.call(lambda n=n: engine.core.tiers.load_now(engine.core.registry.get(n), set())).result()
    runner.packed = counted
    out = _run(engine, REQUESTS)
    assert engine.core.kv is not None and runner.lora_mode() == "batched"
    assert {None, *ADAPTERS} in mixes  # one packed forward of every adapter and base rows
    assert out == alone
    engine.stop()


def test_a_failing_mixed_forward_fails_only_the_row_at_fault(world, alone):
    engine = _engine(world, max_loras=4)
    runner = engine.core.runner
    real = runner.packed

    def flaky(rows, *args):  # the row of request "bad" breaks the forward it is in
        if any(s.req_id == "bad" for s, _ in rows):
            raise RuntimeError("kernel fault")
        return real(rows, *args)
    runner.packed = flaky
    out = _run(engine, REQUESTS + [("a1", [9, 9, 9])], {len(REQUESTS): "bad"})
    assert out["bad:error"] and not engine.core.running
    assert {k: v for k, v in out.items() if not k.startswith("bad")} == alone
    engine.stop()
