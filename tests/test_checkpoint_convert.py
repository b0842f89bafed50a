"""Convert every supported family's debug model, verify, and export back.

One module-scoped build and conversion per family; the tests then check the
runtime layout, the manifest, the verification report and the round trip.
"""

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
import xxhash
from safetensors import safe_open

from moeflow.checkpoint import fp8
from moeflow.checkpoint.convert import convert_checkpoint
from moeflow.checkpoint.export import export_hf
from moeflow.checkpoint.families import load_family
from moeflow.checkpoint.verify import verify_converted
from moeflow.core.errors import UserError
from moeflow_testing.tiny import FAMILIES, build_debug_model, build_fp8_debug_model

CORPUS = ["reverse: a b c\nanswer: c b a"] * 8
ALL = sorted(FAMILIES) + ["fp8"]


def _tensors(path):
    out = {}
    for shard in sorted(path.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            for k in f.keys():
                out[k] = (shard.name, f.get_tensor(k))
    return out


def _bytes(t):
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("convert")
    src = {fam: build_debug_model(fam, root / "src" / fam, corpus=CORPUS) for fam in FAMILIES}
    src["fp8"] = build_fp8_debug_model(root / "src" / "fp8", corpus=CORPUS)
    results = {fam: convert_checkpoint(path, root / "out" / fam) for fam, path in src.items()}
    return root, src, results


@pytest.mark.parametrize("fam", ALL)
def test_convert_verifies(work, fam):
    _, _, results = work
    result = results[fam]
    report = result["report"]
    assert report["passed"] and report["mismatches"] == 0 and not report["failures"]
    assert report["kinds"]["experts"]["tensors"] >= 2
    fn = report["functional"]
    assert fn["missing"] == [] and fn["unexpected"] == [] and fn["mismatched"] == []
    # FP8: the source is dequantised by transformers itself and rounded to bf16
    # like the output, so logits match exactly too
    assert fn["logits_equal"] is True and fn["logits_max_abs_diff"] == 0.0
    if fam == "fp8":
        assert 0 < report["kinds"]["experts"]["max_abs_err"] < 0.01  # one bf16 rounding
    assert {"output_dir", "manifest", "manifest_sha256", "family", "source_dir"} <= set(result)


@pytest.mark.parametrize("fam", ALL)
def test_runtime_layout_one_file_per_layer(work, fam):
    from transformers.core_model_loading import rename_source_key

    _, _, results = work
    out = Path(results[fam]["output_dir"])
    config = json.loads((out / "config.json").read_text())
    family = load_family(config)
    tensors = _tensors(out)
    assert set(tensors) == set(family.shapes) - family.optional_keys()
    for name, (_, t) in tensors.items():
        assert tuple(t.shape) == family.shapes[name]
        # loading applies no conversion: from_pretrained's renaming keeps every name
        # (a rename that would leave the model falls back to the key, as transformers
        # does), and the only converter that still matches is Qwen3-VL's shape-checked
        # Transpose, a no-op on runtime shapes
        renamed, pattern = rename_source_key(name, family.renamings, family.converters,
                                             family.base_model_prefix, family.meta_state)
        if renamed not in family.shapes:
            renamed, pattern = name, None
        assert renamed == name
        if pattern is not None:
            ops = next(c for c in family.converters if pattern in c.source_patterns).operations
            assert [type(op).__name__ for op in ops] == ["Transpose"] and ops[0].check_dims
    layers = (config.get("text_config") or config)["num_hidden_layers"]
    files = {f for f, _ in tensors.values()}
    assert {f"model-layer-{i:05d}.safetensors" for i in range(layers)} <= files
    assert "model-embed-head.safetensors" in files
    if fam in ("qwen3_vl_moe", "ernie4_5_vl_moe", "llama4"):
        assert "model-vision.safetensors" in files
    experts = [n for n in tensors if ".experts." in n and "vision" not in n]
    assert experts and all(tensors[n][0].startswith("model-layer-") for n in experts)
    assert (out / "tokenizer.json").is_file() and (out / "chat_template.jinja").is_file()


def test_manifest_checksums_and_sources(work):
    _, src, results = work
    for fam, result in results.items():
        manifest_path = result["manifest"]
        raw = open(manifest_path, "rb").read()
        assert hashlib.sha256(raw).hexdigest() == result["manifest_sha256"]
        manifest = json.loads(raw)
        assert manifest["checksum"] == "xxh3_128"  # the default, named in the manifest
        tensors = _tensors(Path(result["output_dir"]))
        source = _tensors(src[fam])
        for name, entry in manifest["tensors"].items():
            assert xxhash.xxh3_128(_bytes(tensors[name][1])).hexdigest() == entry["xxh3_128"], name
            assert "sha256" not in entry
            assert entry["shape"] == list(tensors[name][1].shape)
            assert entry["sources"] and all(s in source for s in entry["sources"])
            assert entry["transform"]["ops"] or entry["transform"]["converter"] == "rename"


def test_fused_experts_built_from_per_expert_sources(work):
    _, src, results = work
    out = _tensors(Path(results["mixtral"]["output_dir"]))
    source = _tensors(src["mixtral"])
    gate_up = out["model.layers.1.mlp.experts.gate_up_proj"][1]  # [E, 2I, H]
    for e in range(4):
        w1 = source[f"model.layers.1.block_sparse_moe.experts.{e}.w1.weight"][1]  # [I, H]
        w3 = source[f"model.layers.1.block_sparse_moe.experts.{e}.w3.weight"][1]
        assert torch.equal(gate_up[e], torch.cat([w1, w3], dim=0))
    # Qwen3-VL-MoE: on-disk [E, H, 2I] becomes runtime [E, 2I, H]
    vl_src = _tensors(src["qwen3_vl_moe"])["model.language_model.layers.0.mlp.experts.gate_up_proj"][1]
    vl_out = _tensors(Path(results["qwen3_vl_moe"]["output_dir"]))
    assert torch.equal(vl_out["model.language_model.layers.0.mlp.experts.gate_up_proj"][1],
                       vl_src.transpose(1, 2))


def test_fp8_dequantised(work):
    _, src, results = work
    out = Path(results["fp8"]["output_dir"])
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    tensors = _tensors(out)
    assert not any(n.endswith("_scale_inv") for n in tensors)
    source = _tensors(src["fp8"])
    w = source["model.layers.1.self_attn.q_b_proj.weight"][1]
    s = source["model.layers.1.self_attn.q_b_proj.weight_scale_inv"][1]
    got = tensors["model.layers.1.self_attn.q_b_proj.weight"][1]
    assert got.dtype == torch.bfloat16
    ref = w.float() * s.repeat_interleave(16, 0).repeat_interleave(16, 1)  # [128, 32]
    assert torch.equal(got, ref.to(torch.bfloat16))
    assert torch.equal(got, fp8.dequantize(w, s, (16, 16), torch.bfloat16))
    gate_up = tensors["model.layers.2.mlp.experts.gate_up_proj"][1]  # [E, 2I, H]
    g3 = fp8.dequantize(source["model.layers.2.mlp.experts.3.gate_proj.weight"][1],
                        source["model.layers.2.mlp.experts.3.gate_proj.weight_scale_inv"][1],
                        (16, 16), torch.bfloat16)
    assert torch.equal(gate_up[3, :48], g3)


def test_fp8_partial_edge_blocks():
    """DeepSeek's block formula, including a partial last block (576 = 4.5 x 128)."""
    w = torch.randn(5, 7) * 3
    q, s = fp8.quantize(w, (2, 4))  # scale grid [3, 2]: partial blocks on both axes
    assert tuple(s.shape) == (3, 2)
    got = fp8.dequantize(q, s, (2, 4), torch.float32)
    for i in range(5):
        for j in range(7):
            assert got[i, j] == q[i, j].float() * s[i // 2, j // 4]
    assert (got - w).abs().max() <= 0.07 * w.abs().max()


@pytest.mark.parametrize("fam", sorted(FAMILIES))
def test_export_round_trip_bit_identical(work, fam, tmp_path):
    _, src, results = work
    result = export_hf(results[fam]["output_dir"], tmp_path / "hf")
    a, b = _tensors(src[fam]), _tensors(tmp_path / "hf")
    assert set(a) == set(b)
    for name, (shard, t) in a.items():
        assert b[name][0] == shard and b[name][1].dtype == t.dtype and b[name][1].shape == t.shape
        assert _bytes(b[name][1]) == _bytes(t), name
    assert result["tensors"] == len(a)
    assert json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())["weight_map"] == \
        json.loads((src[fam] / "model.safetensors.index.json").read_text())["weight_map"]


def test_fp32_target_and_logits(work, tmp_path):
    _, src, _ = work
    result = convert_checkpoint(src["mixtral"], tmp_path / "f32", dtype="fp32")
    manifest = json.loads(open(result["manifest"]).read())
    assert {e["dtype"] for e in manifest["tensors"].values()} == {"F32"}
    assert result["report"]["functional"]["logits_equal"] is True


def test_sha256_checksum_and_older_manifests(work, tmp_path):
    """--checksum sha256 writes sha256 entries; a manifest from before the choice
    (sha256 entries, no "checksum" field) still verifies and exports."""
    _, src, _ = work
    result = convert_checkpoint(src["qwen3_moe"], tmp_path / "sha", checksum="sha256", verify=False)
    out = Path(result["output_dir"])
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["checksum"] == "sha256"
    tensors = _tensors(out)
    for name, entry in manifest["tensors"].items():
        assert hashlib.sha256(_bytes(tensors[name][1])).hexdigest() == entry["sha256"], name
    del manifest["checksum"]
    (out / "manifest.json").write_text(json.dumps(manifest))
    report = verify_converted(out, src["qwen3_moe"], functional=False)
    assert report["passed"] and report["mismatches"] == 0
    back = export_hf(out, tmp_path / "hf")
    assert back["checksum"] == "sha256" and len(back["digests"]) == back["tensors"]
    with pytest.raises(UserError, match="--checksum md5"):
        convert_checkpoint(src["qwen3_moe"], tmp_path / "md5", checksum="md5")


def test_byte_copy_path_matches_torch_path(work, tmp_path, monkeypatch):
    """Same-dtype groups are copied file to file (bytecopy.py); the layout measured by
    the probe is the expected one, and the files equal the torch path's, byte for byte."""
    from moeflow.checkpoint import bytecopy
    from moeflow.checkpoint.parse import read_checkpoint
    from moeflow.checkpoint.plan import plan_conversion

    _, src, results = work
    ckpt = read_checkpoint(src["qwen3_moe"])
    family = load_family(ckpt.config)
    groups = {g["first"]: g for g in plan_conversion(ckpt, family)["groups"]}
    gate_up = groups["model.layers.1.mlp.experts.gate_up_proj"]
    lay = bytecopy.layout(family, gate_up, ckpt.tensors)
    gate = ckpt.tensors["model.layers.1.mlp.experts.0.gate_proj.weight"]  # [I, H]
    numel = gate.shape[0] * gate.shape[1]
    assert lay["unit"] == "experts"
    assert lay["runs"][gate_up["first"]] == [(0, 0, numel), (1, 0, numel)]  # gate_e then up_e
    assert bytecopy.layout(family, groups["model.norm.weight"], ckpt.tensors) == {"unit": "tensor"}
    # a cast is not a byte copy
    assert bytecopy.layout(family, dict(gate_up, dtype="F32"), ckpt.tensors) is None

    monkeypatch.setattr(bytecopy, "layout", lambda *a: None)  # everything through torch
    ref = convert_checkpoint(src["qwen3_moe"], tmp_path / "torch", verify=False)
    fast, slow = Path(results["qwen3_moe"]["output_dir"]), Path(ref["output_dir"])
    for f in sorted(fast.glob("*.safetensors")):
        assert f.read_bytes() == (slow / f.name).read_bytes(), f.name
    a, b = (json.loads((d / "manifest.json").read_text())["tensors"] for d in (fast, slow))
    assert a == b


def test_verification_catches_a_flipped_byte(work, tmp_path):
    from moeflow.checkpoint.st_io import read_header

    _, src, results = work
    out = tmp_path / "copy"
    shutil.copytree(results["qwen3_moe"]["output_dir"], out)
    manifest = json.loads((out / "manifest.json").read_text())
    name = "model.layers.1.mlp.experts.down_proj"
    info = read_header(out / manifest["tensors"][name]["file"])[0][name]
    with open(info.file, "r+b") as f:
        f.seek(info.start + 100)
        byte = f.read(1)
        f.seek(info.start + 100)
        f.write(bytes([byte[0] ^ 0x40]))
    report = verify_converted(out, src["qwen3_moe"], functional=False)
    assert not report["passed"] and report["mismatches"] == 1
    assert name in report["failures"][0] and "bytes differ" in report["failures"][0]


def test_experts_stream_one_expert_at_a_time(work, monkeypatch):
    """Memory bound: a fused expert tensor is built from at most ROW_BUDGET bytes of
    expert sources per step (here shrunk to one expert's float32 size)."""
    from moeflow.checkpoint import plan as plan_mod
    from moeflow.checkpoint.engine import Loader, run_step
    from moeflow.checkpoint.parse import read_checkpoint
    from moeflow.checkpoint.plan import plan_conversion, steps

    one_expert = 2 * 48 * 64 * 4  # gate + up of one expert, [48, 64] each, as float32
    monkeypatch.setattr(plan_mod, "ROW_BUDGET", one_expert)

    _, src, _ = work
    ckpt = read_checkpoint(src["deepseek_v3"])
    family = load_family(ckpt.config)
    plan = plan_conversion(ckpt, family)
    group = next(g for g in plan["groups"] if g["first"].endswith("layers.1.mlp.experts.gate_up_proj"))
    assert group["mode"] == "experts"
    loads = []

    class Counting(Loader):
        def load(self, key, *a, **k):
            loads.append(key)
            return super().load(key, *a, **k)

    loader = Counting(ckpt.tensors, None)
    plan_steps = steps(group, {k: v.shape for k, v in ckpt.tensors.items()})
    assert len(plan_steps) == 8
    for selection, row0 in plan_steps:
        loads.clear()
        out = run_step(family, group, loader, selection)
        assert sorted(loads) == sorted([f"model.layers.1.mlp.experts.{row0}.gate_proj.weight",
                                        f"model.layers.1.mlp.experts.{row0}.up_proj.weight"])
        assert out[group["first"]].shape == (1, 96, 64)  # [1, 2I, H]
    monkeypatch.setattr(plan_mod, "ROW_BUDGET", 3 * one_expert)  # 3 experts per step: 3 + 3 + 2
    assert [len(sel["experts"]) for sel, _ in steps(group, {k: v.shape for k, v in ckpt.tensors.items()})] \
        == [3, 3, 2]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64,
                                   torch.float8_e4m3fn, torch.float8_e5m2])
def test_byte_copy_counts_nonfinite_like_torch(dtype):
    """The byte-copy path's NaN/Inf count (on the bits) equals torch's isfinite count."""
    import numpy as np

    from moeflow.checkpoint import bytecopy
    from moeflow.checkpoint.st_io import TAGS, tensor_bytes

    values = torch.randn(3000) * 10
    values[[5, 77, 2999]] = float("nan")
    if dtype not in (torch.float8_e4m3fn,):  # e4m3fn has no infinity (overflow is NaN)
        values[[100, 1000]] = torch.tensor([float("inf"), -float("inf")])
    t = values.to(dtype)
    want = int((~torch.isfinite(t.float())).sum())
    scan = bytecopy._NONFINITE[TAGS[dtype]]
    scratch = np.empty(256, dtype=np.uint8)  # several pieces
    assert bytecopy._count_nonfinite(tensor_bytes(t), scratch, *scan) == want > 0
    assert bytecopy._count_nonfinite(tensor_bytes(torch.zeros(10, dtype=dtype)), scratch, *scan) == 0


@pytest.mark.parametrize("fam", ["qwen3_moe", "fp8"])
def test_convert_within_a_budget_writes_the_same_bytes(work, tmp_path, monkeypatch, fam):
    """A device's budget (issue 45) changes how convert verifies, never what it writes: the
    functional check goes layer by layer, in the written dtype, its source side built step
    by step (here one expert a step); every output file (manifest and its checksums
    included) is byte-equal to the run without a budget, and each process's peak is recorded."""
    from moeflow.checkpoint import plan as plan_mod

    monkeypatch.setattr(plan_mod, "ROW_BUDGET", 4 * 2 * 48 * 64 * 4)  # the check's steps: a quarter
    _, src, results = work
    result = convert_checkpoint(src[fam], tmp_path / "out", memory_budget=1e4)  # below one tiny layer
    report = result["report"]
    assert report["passed"], report["failures"]
    layers = report["functional"]["per_layer"]
    assert layers["dtype"] == "bfloat16" and layers["streamed"] and layers["equal"]
    before, after = Path(results[fam]["output_dir"]), Path(result["output_dir"])
    files = sorted(p.name for p in before.iterdir() if p.name != "verification.json")
    assert files == sorted(p.name for p in after.iterdir() if p.name != "verification.json")
    for name in files:
        assert (before / name).read_bytes() == (after / name).read_bytes(), name
    assert result["manifest_sha256"] == results[fam]["manifest_sha256"]
    mem = result["memory"]
    assert len(mem["convert"]) == result["files"] and len(mem["verify"]) == result["files"]
    assert all(isinstance(v, int) and v >= 0 for v in mem["verify"] + [mem["functional"]])


def test_budget_layer_check_catches_a_changed_expert(work, tmp_path):
    """The per-layer check on a budget (bf16, source streamed) still sees a wrong expert."""
    from moeflow.checkpoint.layercheck import per_layer_check
    from moeflow.checkpoint.st_io import read_header

    _, src, results = work
    bad = tmp_path / "bad"
    shutil.copytree(results["qwen3_moe"]["output_dir"], bad)
    name = "model.layers.1.mlp.experts.down_proj"
    info = read_header(bad / "model-layer-00001.safetensors")[0][name]
    with open(info.file, "r+b") as f:  # the last expert's first element := 1.0
        f.seek(info.start + (info.nbytes // info.shape[0]) * (info.shape[0] - 1))
        f.write(torch.tensor([1.0], dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes())
    manifest = json.loads((bad / "manifest.json").read_text())
    layers = per_layer_check(src["qwen3_moe"], bad, manifest, dtype=torch.bfloat16, streamed=True)
    assert layers["per_layer"][0] == 0.0 and layers["per_layer"][1] > 0, layers
