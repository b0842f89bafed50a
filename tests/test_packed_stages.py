"""A quantised release kept as stored (`convert --dtype keep`) through the stages: convert
keeps its tensors and quantization_config (validated), finetune / regress / serving load it
with the routed experts packed (moeflow.model.models.load_model -> moeflow.model.packed_base), LoRA
over it trains like LoRA over the bf16-dequantised base, and its adapter applies there."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moeflow.core.errors import UserError

REPO = Path(__file__).resolve().parents[1]
OPT = dict(lr=5e-3, weight_decay=0.0, betas=(0.9, 0.999), warmup_steps=1, schedule="constant",
           max_grad_norm=1.0)


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """Per format: the release, convert keep's output and convert bf16's (the dequantised base)."""
    from moeflow.checkpoint.convert import convert_checkpoint
    from moeflow_testing.releases import ct_release, mxfp4_release
    from moeflow_testing.tiny import build_debug_model

    root = tmp_path_factory.mktemp("kept")
    oss = build_debug_model("gpt_oss", root / "oss")
    qwen = build_debug_model("qwen3_moe", root / "qwen")
    out = {}
    for name, release in (("mxfp4", mxfp4_release(oss, root / "oss-mxfp4")),
                          ("int4", ct_release(qwen, root / "qwen-int4", "int4-group"))):
        convert_checkpoint(release, root / f"{name}-kept", dtype="keep", workers=1)
        convert_checkpoint(release, root / f"{name}-bf16", dtype="bf16", workers=1)
        out[name] = {"release": release, "kept": root / f"{name}-kept", "bf16": root / f"{name}-bf16"}
    return out


@pytest.mark.parametrize("name", ["mxfp4", "int4"])
def test_keep_writes_the_release_as_stored_and_loads_packed(bases, name):
    from safetensors import safe_open

    from moeflow.checkpoint.parse import read_checkpoint
    from moeflow.checkpoint.st_io import read_rows
    from moeflow.model.models import kept_formats, load_model
    from moeflow.model.packed_base import PackedExperts, load_packed, packed_experts

    b = bases[name]
    kept, release = read_checkpoint(b["kept"]), read_checkpoint(b["release"])
    assert set(kept.tensors) == set(release.tensors)  # stored names, codes and scales included
    for key in [k for k in release.tensors if k.endswith(("_blocks", "_scales", "weight_packed",
                                                          "weight_scale"))][:6]:
        assert torch.equal(read_rows(kept.tensors[key]), read_rows(release.tensors[key])), key
    config = json.loads((b["kept"] / "config.json").read_text())
    assert config["quantization_config"] == json.loads(
        (b["release"] / "config.json").read_text())["quantization_config"]
    manifest = json.loads((b["kept"] / "manifest.json").read_text())
    assert manifest["dtype"] == "keep" and not manifest["dequantized"]
    assert kept_formats(b["kept"]) == [{"mxfp4": "mxfp4", "int4": "pack-quantized"}[name]]
    assert kept_formats(b["bf16"]) == []
    for path in {e["file"] for e in manifest["tensors"].values()}:  # one file per decoder layer
        with safe_open(str(b["kept"] / path), "pt") as f:
            assert all(manifest["tensors"][k]["file"] == path for k in f.keys())  # noqa: SIM118

    model = load_model(b["kept"], torch.float32)  # what finetune, regress and serving call
    held = packed_experts(model)
    assert held and all(isinstance(v, PackedExperts) for v in held.values())
    assert not model._can_set_experts_implementation()  # stays on the loop packed experts run
    plain, _ = load_packed(b["release"], torch.float32, packed=False)
    ids = torch.arange(32).reshape(2, 16) * 7 % 300
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # bit-equal needs one order of the sums: two threads split some differently
    try:
        with torch.no_grad():
            assert torch.equal(model(input_ids=ids).logits, plain(input_ids=ids).logits)
    finally:
        torch.set_num_threads(threads)


def _train(path: str, steps: int = 4):
    """LoRA steps as a finetune worker takes them (load_base, apply_lora, the step functions)."""
    from moeflow.core.config import LoraSection, OptimizerSection
    from moeflow.training import data as D
    from moeflow.training import steps as T
    from moeflow.training.lora import apply_lora

    torch.manual_seed(0)
    model, tok = T.load_base(path, "float32")
    peft, _, _ = apply_lora(model, LoraSection(rank=4, alpha=8, dropout=0.0,
                                               target_modules=["attention"]))
    recs = [{"prompt": f"reverse: {w}\nanswer:", "completion": " " + w[::-1]}
            for w in ["a b c", "d e f", "g h", "i j k l"]]
    rows = D.pack(D.tokenize(recs, tok), 32, tok.pad_token_id)
    opt, sched = T.make_optimizer(peft, OptimizerSection(**OPT), max_steps=steps)
    losses = []
    for _ in range(steps):
        losses.append(T.forward_backward(peft, rows, 1.0, None, 0)["loss"])
        T.optimizer_step(peft, opt, sched, 1.0)
    return peft, losses, rows


@pytest.mark.parametrize("name", ["mxfp4", "int4"])
def test_finetune_over_packed_base_matches_dequantised_base(bases, name, tmp_path):
    from peft import PeftModel

    from moeflow.model.models import load_model
    from moeflow.model.packed_base import packed_experts

    b = bases[name]
    packed, losses_p, rows = _train(str(b["kept"]))
    held = packed_experts(packed)
    assert held and sum(p.decodes for p in held.values()) > 0  # the experts ran packed
    plain, losses_d, _ = _train(str(b["bf16"]))  # from_pretrained of the bf16 conversion
    assert not packed_experts(plain)
    assert losses_p[-1] < losses_p[0]
    # the issue asks 2% at step N; measured: MXFP4 equal (its values are exact in bf16), INT4
    # 1.2e-5 relative (the dequantised base is rounded to bf16 and runs grouped_mm)
    for a, d in zip(losses_p, losses_d, strict=True):
        assert abs(a - d) <= 1e-3 * abs(d), (losses_p, losses_d)
    # the adapter is a standard PEFT adapter: it applies to the dequantised base
    packed.save_pretrained(str(tmp_path / "adapter"))
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["peft_type"] == "LORA"
    on_plain = PeftModel.from_pretrained(load_model(b["bf16"], torch.float32),
                                         str(tmp_path / "adapter")).eval()
    on_packed = PeftModel.from_pretrained(load_model(b["kept"], torch.float32),
                                          str(tmp_path / "adapter")).eval()
    packed.eval()
    ids = rows["input_ids"][:2]
    with torch.no_grad():
        trained = packed(input_ids=ids).logits
        a, d = on_packed(input_ids=ids).logits, on_plain(input_ids=ids).logits
    assert torch.equal(a, trained)  # the saved adapter is the trained one
    scale = d.abs().max()
    assert (a - d).abs().max() <= 5e-3 * scale, (a - d).abs().max()  # INT4: 1.5e-3 of 0.96
    # regress's runner loads the kept base packed and scores with the adapter as on the plain one
    from moeflow.evaluation.runners import HFRunner

    scores = []
    for base in (b["kept"], b["bf16"]):
        runner = HFRunner(base, dtype="float32")
        assert bool(packed_experts(runner.model)) == (base == b["kept"])
        runner.attach_adapter(tmp_path / "adapter")
        scores.append(runner.loglikelihood([("reverse: a b c\nanswer:", " c b a")])[0][0])
    assert scores[0] == pytest.approx(scores[1], rel=1e-3, abs=1e-3)


def test_packed_matmul_follows_the_input_dtype(bases):
    """A packed expert multiplies in its input's dtype (and on its device: model.to(device)
    does not move packed experts, which are not parameters, so the first matmul on another
    device moves them; no GPU here, so only the dtype half is checked)."""
    from moeflow.model.packed_base import load_packed

    model, held = load_packed(bases["int4"]["kept"], torch.float32)
    pw = next(iter(held.values()))
    x = torch.randn(3, pw.shape[-1], dtype=torch.float64)
    y = torch.nn.functional.linear(x, pw[0])
    assert y.dtype == torch.float64 and pw.device == torch.device("cpu")
    assert torch.allclose(y, x @ pw.expert(0).double().T)


def test_keep_refuses_inconsistent_scales_in_one_line(bases, tmp_path):
    """A release whose MXFP4 scales do not decode (e8m0 0xFF: NaN) or do not fit their blocks
    is refused naming the file and tensor, before anything is written."""
    import shutil

    from safetensors.torch import load_file, save_file

    from moeflow.checkpoint.convert import convert_checkpoint

    src = tmp_path / "bad"
    shutil.copytree(bases["mxfp4"]["release"], src)
    shard = next(src.glob("*.safetensors"))
    tensors = load_file(str(shard))
    key = next(k for k in tensors if k.endswith("down_proj_scales"))
    tensors[key][0, 0, 0] = 255
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(UserError) as e:
        convert_checkpoint(src, tmp_path / "out", dtype="keep", workers=1)
    assert key.removesuffix("_scales") in str(e.value) and "\n" not in str(e.value)
    assert "non-finite" in str(e.value) and not (tmp_path / "out").exists()
    tensors[key] = tensors[key][..., :-1].contiguous()  # one scale short per row
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(UserError) as e:
        convert_checkpoint(src, tmp_path / "out", dtype="keep", workers=1)
    assert key.removesuffix("_scales") in str(e.value) and "\n" not in str(e.value)


def test_fp8_policy_refuses_a_packed_release_in_one_line(bases, tmp_path):
    from moeflow.checkpoint.convert import convert_checkpoint

    with pytest.raises(UserError, match=r"stored mxfp4; --dtype fp8 keeps FP8 blocks only"):
        convert_checkpoint(bases["mxfp4"]["release"], tmp_path / "o", dtype="fp8", workers=1)


def test_stages_that_need_the_dequantised_base_refuse_in_one_line(bases, tmp_path):
    """Calibrate needs full precision; FSDP/EP shard
    parameters, which packed experts are not: each refuses naming its key."""
    from transformers.distributed import DistributedConfig

    from moeflow.core.config import load_config
    from moeflow.model.models import load_model
    from moeflow.training.merge import write_merged
    from tasks.base import refuse_kept_base

    kept = bases["mxfp4"]["kept"]
    with pytest.raises(UserError, match="no adapter_config.json"):  # merged in its format now
        write_merged(str(kept), tmp_path / "adapter", tmp_path / "merged", "float32")
    with pytest.raises(UserError, match=r"calibrate: convert.dtype keep keeps the base in its "
                                        r"release format \(mxfp4\); calibrate quantises") as e:
        refuse_kept_base("calibrate", "calibrate quantises", model_dir=str(kept))
    assert "\n" not in str(e.value)
    refuse_kept_base("calibrate", "why", model_dir=str(bases["mxfp4"]["bf16"]))  # dequantised: runs
    # before any stage runs: the release at model.path, convert.dtype keep
    from workflows.dag import registry

    for dtype, refused in (("keep", True), ("bf16", False)):
        cfg = load_config(REPO / "configs/demo.yaml", [f"model.path={bases['int4']['release']}",
                                                       f"convert.dtype={dtype}"])
        for stage in ("calibrate", "operators"):
            spec = registry()[stage]
            if refused:
                with pytest.raises(UserError, match=rf"^{stage}: convert.dtype keep .*pack-quantized"):
                    spec.preflight(cfg)
            else:
                spec.preflight(cfg)
    with pytest.raises(UserError, match="distributed_config"):
        load_model(kept, torch.bfloat16, distributed_config=DistributedConfig(fsdp_size=2))
    # expert LoRA (PEFT target_parameters) needs expert parameters
    from moeflow.core.config import LoraSection
    from moeflow.training.lora import apply_lora

    with pytest.raises(UserError, match=r"'experts' cannot be targeted on a base kept quantised"):
        apply_lora(load_model(kept, torch.float32),
                   LoraSection(rank=4, alpha=8, dropout=0.0, target_modules=["experts"]))
