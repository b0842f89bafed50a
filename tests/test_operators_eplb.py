"""EPLB placement (moeflow/operators/eplb.py) and `moeflow eplb`: valid maps, better
balance than the contiguous split, the hierarchical constraints, bad input -> exit 2."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest

from moeflow.core.errors import UserError
from moeflow.operators import eplb as E


def zipf_load(layers: int, experts: int, seed: int = 0, tokens: int = 100_000) -> np.ndarray:
    """Per-layer Zipf-like loads (exponent 0.6-1.1), hot experts at random ids."""
    rng = np.random.default_rng(seed)
    out = np.empty((layers, experts))
    for layer in range(layers):
        p = 1.0 / np.arange(1, experts + 1) ** rng.uniform(0.6, 1.1)
        out[layer] = rng.multinomial(tokens, p[rng.permutation(experts)] / p.sum())
    return out


def _check_maps(w, phy2log, log2phy, logcnt, num_replicas):
    layers, experts = w.shape
    assert phy2log.shape == (layers, num_replicas) and logcnt.shape == (layers, experts)
    assert (logcnt >= 1).all() and (logcnt.sum(1) == num_replicas).all()
    for layer in range(layers):
        assert (np.bincount(phy2log[layer], minlength=experts) == logcnt[layer]).all()
        for e in range(experts):
            slots = log2phy[layer, e][log2phy[layer, e] >= 0]
            assert len(slots) == logcnt[layer, e] and (phy2log[layer, slots] == e).all()


@pytest.mark.parametrize("groups,nodes", [(1, 1), (8, 2), (8, 4), (6, 4)])
def test_placement_is_valid_and_balances(groups, nodes):
    w = zipf_load(6, 48 if groups == 6 else 64)
    ep, redundant = 8, 8
    phy2log, log2phy, logcnt = E.rebalance_experts(w, w.shape[1] + redundant, groups, nodes, ep)
    _check_maps(w, phy2log, log2phy, logcnt, w.shape[1] + redundant)
    loads = E.rank_load_placed(w, phy2log, logcnt, ep)
    assert np.allclose(loads.sum(1), w.sum(1))  # every token lands somewhere, once
    before = E.balancedness(E.rank_load_contiguous(w, ep))
    after = E.balancedness(loads)
    assert (after >= before - 1e-12).all() and after.mean() > before.mean() + 0.2
    if groups % nodes == 0 and nodes > 1:  # hierarchical: a node holds whole groups, replicas stay home
        size, slots = w.shape[1] // groups, phy2log.shape[1] // nodes
        for layer in range(w.shape[0]):
            for n in range(nodes):
                held = set(phy2log[layer, n * slots:(n + 1) * slots] // size)
                assert len(held) == groups // nodes


def test_global_placement_is_nearly_perfect_on_a_deepseek_shaped_load():
    w = zipf_load(8, 256, seed=1)
    phy2log, _, logcnt = E.rebalance_experts(w, 288, 1, 1, 32)
    assert E.balancedness(E.rank_load_placed(w, phy2log, logcnt, 32)).mean() > 0.99


def test_packing_beats_plain_greedy():
    """The exchange step fixes what longest-first alone leaves: {5,4,3,3,3,2} into 2 packs of 3."""
    w = np.array([5.0, 4, 3, 3, 3, 2])
    pack_of = E.pack(w, 2)
    loads = np.bincount(pack_of, weights=w)
    assert sorted(np.bincount(pack_of)) == [3, 3] and loads.max() == 10


@pytest.mark.parametrize("weight,args,message", [
    (np.ones(4), (4, 1, 1, 2), "layers x experts matrix"),
    (np.array([[1.0, -2, 3, 4]]), (4, 1, 1, 2), "negative token count -2"),
    (np.ones((2, 8)), (10, 1, 1, 4), "EP size 4 does not divide experts + redundant = 10"),
    (np.ones((2, 8)), (8, 1, 3, 4), "nodes 3 do not divide EP size 4"),
    (np.ones((2, 8)), (6, 1, 1, 2), "physical experts 6 < logical experts 8"),
])
def test_bad_input_names_the_value(weight, args, message):
    with pytest.raises(UserError, match=re.escape(message)):
        E.rebalance_experts(weight, *args)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "workflows.cli", "eplb", *args],
                          capture_output=True, text=True, timeout=300)


def test_cli_json_and_bad_input(tmp_path):
    load = tmp_path / "load.json"
    w = zipf_load(3, 16)
    load.write_text(json.dumps(w.tolist()))
    out = _cli(str(load), "--ep", "4", "--redundant", "4", "--json")
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert set(got) == {"balancedness_before", "balancedness_after", "layers", "physical_to_logical"}
    assert [r["layer"] for r in got["layers"]] == [0, 1, 2]
    assert np.isclose(got["balancedness_after"], np.mean([r["after"] for r in got["layers"]]), atol=1e-5)
    assert got["balancedness_after"] > got["balancedness_before"]
    assert np.array(got["physical_to_logical"]).shape == (3, 20)
    bad = _cli(str(load), "--ep", "4", "--nodes", "3")
    assert bad.returncode == 2 and "nodes 3 do not divide EP size 4" in bad.stderr, bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1 and "Traceback" not in bad.stderr


def test_command_table_and_bad_files(tmp_path, capsys):
    from workflows.commands.operators import eplb as eplb_cmd

    w = zipf_load(3, 16)
    np.save(tmp_path / "load.npy", w)
    eplb_cmd(str(tmp_path / "load.npy"), ep=4, redundant=4, nodes=2, groups=4, as_json=False)
    printed = capsys.readouterr().out
    assert "hierarchical" in printed and "mean" in printed
    ragged = tmp_path / "ragged.json"
    ragged.write_text("[[1, 2], [3]]")
    negative = tmp_path / "negative.json"
    negative.write_text('{"counts": [[1, -5, 2, 2]]}')  # an operators expert_load.json
    flat = tmp_path / "flat.json"
    flat.write_text("[1, 2, 3, 4]")
    for path, ep, message in ((ragged, 2, "ragged.json"), (negative, 2, "negative token count -5"),
                              (flat, 2, "got shape [4]"), (tmp_path / "load.npy", 3, "EP size 3 does not divide"),
                              (tmp_path / "missing.json", 2, "no such load file")):
        with pytest.raises(UserError, match=re.escape(message)):
            eplb_cmd(str(path), ep=ep, redundant=0, nodes=1, groups=1, as_json=True)


def test_serving_prefers_a_plain_kernel_on_a_tie():
    from moeflow.operators.opbench import choose

    def row(name, fwd, train):
        return {"implementation": name, "available": True, "forward_s": fwd, "train_s": train}

    rows = [row("eager", 3.0, 9.0), row("grouped_mm", 1.03, 4.0), row("split_lora", 1.0, 3.0)]
    assert choose(rows) == {"serving": "grouped_mm", "training": "split_lora"}  # 3% apart: a tie
    rows[2]["forward_s"] = 0.8  # 22% faster: a real win
    assert choose(rows)["serving"] == "split_lora"
    assert choose([row("batched_mm", 1.0, 1.0), {"implementation": "x", "available": False}])["serving"] == "batched_mm"


def test_block_shape_reads_a_router_whose_weight_is_inside_a_linear():
    """AFMoE's router keeps its [experts, hidden] weight in a `gate` linear (no `weight` of
    its own): the kernel timing read `router.weight` and failed the operators stage."""
    from moeflow.operators.opbench import block_shape, meta_block
    from moeflow_testing.tiny_auto import tiny_config

    config = tiny_config("afmoe")
    block, router, _ = meta_block(config)
    assert not hasattr(router, "weight")
    shape = block_shape(block, router)
    assert shape["hidden"] == config.hidden_size and shape["experts"] == config.num_experts
