"""A LoRA adapter merged into a release kept in its own format (moeflow.training.merge_kept):
attention merged into the full-precision parts with packed experts copied byte for byte and
logits equal to base + adapter; expert LoRA requantised to MXFP4 within the format's bound;
resumable after a crash; the merged release serves on the local engine; targets a merge
cannot requantise are refused before training."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from moeflow.core.errors import UserError

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_thread")


def _adapter(src: Path, out: Path, zero_b: bool = False, **targets) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    get_peft_model(model, LoraConfig(r=4, lora_alpha=8, init_lora_weights=zero_b,
                                     **targets)).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Kept MXFP4 (GPT-OSS layout) and INT4 (experts only, compressed-tensors) releases."""
    from moeflow.checkpoint.convert import convert_checkpoint
    from moeflow_testing.releases import ct_release, mxfp4_release
    from moeflow_testing.tiny import build_debug_model

    root = tmp_path_factory.mktemp("merge-kept")
    oss = build_debug_model("gpt_oss", root / "oss", dtype="float32")
    qwen = build_debug_model("qwen3_moe", root / "qwen", dtype="float32")
    int4 = ct_release(qwen, root / "int4", "int4-group", experts_only=True)
    convert_checkpoint(mxfp4_release(oss, root / "mxfp4"), root / "mxfp4-kept", dtype="keep", workers=1)
    convert_checkpoint(int4, root / "int4-kept", dtype="keep", workers=1)
    attention = {"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
    experts = {"target_modules": ["q_proj"],
               "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}
    return {"root": root, "qwen": qwen, "int4-release": int4,
            "mxfp4": (root / "mxfp4-kept", _adapter(oss, root / "a-mxfp4", **attention)),
            "int4": (root / "int4-kept", _adapter(qwen, root / "a-int4", **attention)),
            "experts": _adapter(oss, root / "a-experts", **experts),
            "experts-zero": _adapter(oss, root / "a-zero", zero_b=True, **experts)}


def _stored(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            out.update({k: st.get_tensor(k) for k in st.keys()})
    return out


def _packed_parts(kept: Path) -> set[str]:
    from moeflow.checkpoint.formats import find_packed
    from moeflow.checkpoint.parse import read_checkpoint

    packed, _ = find_packed(read_checkpoint(kept))
    return {p.name for t in packed.values() for _, p in t.parts}


def _logits(model, vocab: int) -> torch.Tensor:
    ids = torch.arange(40).reshape(2, 20) * 31 % vocab  # other ids than the merge's own check
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


@pytest.mark.parametrize("name", ["mxfp4", "int4"])
def test_attention_merge_keeps_packed_bytes_and_logits_of_base_plus_adapter(world, name):
    from peft import PeftModel

    from moeflow.model.packed_base import load_packed
    from moeflow.training.merge_kept import merge_kept

    kept, adapter = world[name]
    out = merge_kept(kept, adapter, world["root"] / f"merged-{name}")
    before, after = _stored(kept), _stored(Path(out["output_dir"]))
    parts = _packed_parts(kept)
    assert parts and before.keys() == after.keys()
    assert all(torch.equal(before[k].view(torch.uint8), after[k].view(torch.uint8)) for k in parts)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed == set(out["merged"]) and all(".self_attn." in k for k in changed)
    assert out["requantized"] == {} and out["logits"]["passed"]
    plain, _ = load_packed(kept, torch.float32, packed=False)
    ref = _logits(PeftModel.from_pretrained(plain, str(adapter)).eval(), plain.config.vocab_size)
    merged, held = load_packed(out["output_dir"], torch.float32)
    got = _logits(merged, plain.config.vocab_size)
    assert held  # served as the engine loads it: experts packed
    assert (got - ref).abs().max() <= 1e-5 * max(1.0, float(ref.abs().max()))


def test_expert_merge_requantises_mxfp4_within_the_format_bound(world):
    from moeflow.training.merge_kept import merge_kept, merge_metrics

    kept, _ = world["mxfp4"]
    out = merge_kept(kept, world["experts"], world["root"] / "merged-experts")
    req = out["requantized"]
    assert sorted(req) == [f"model.layers.{i}.mlp.experts.{p}" for i in (0, 1)
                           for p in ("down_proj", "gate_up_proj")]
    assert all(s["within_bound"] and 0 < s["max_over_bound"] <= 1 and 0 < s["rel_rms"] < 0.25
               for s in req.values())
    logits = out["logits"]
    assert logits["tolerance"] is None and logits["cosine"] > 0.9 and logits["max_abs_err"] > 0
    metrics = merge_metrics(out["output_dir"])
    assert metrics["merge/requantized_tensors"] == 4 and "merge/logits_max_abs_err" in metrics
    # where the adapter is zero (PEFT's default init: B = 0) the experts are the release's bytes
    zero = merge_kept(kept, world["experts-zero"], world["root"] / "merged-zero")
    before, after = _stored(kept), _stored(Path(zero["output_dir"]))
    assert zero["requantized"] == {}
    assert all(torch.equal(before[k], after[k]) for k in before)
    # and MXFP4's encoder gives back the bytes of the values it decodes (requantised anyway)
    from moeflow.checkpoint.formats import find_packed, read
    from moeflow.checkpoint.parse import read_checkpoint
    from moeflow.checkpoint.requant import requantize

    packed, _ = find_packed(read_checkpoint(kept))
    name, info = sorted(packed.items())[0]
    parts, stats = requantize(info, read(info))
    assert stats["max_abs"] == 0 and all(torch.equal(before[k], v) for k, v in parts.items())


def test_finetune_logs_the_merge_check_to_mlflow(world, mlflow_uri):
    from types import SimpleNamespace

    from mlflow.tracking import MlflowClient

    from tasks.finetune import _log_kept_merge

    merged = world["root"] / "merged-experts"  # written by the test above (module order)
    if not merged.is_dir():
        from moeflow.training.merge_kept import merge_kept

        merge_kept(world["mxfp4"][0], world["experts"], merged)
    # a run in this store's own experiment: mlflow's fluent API would reuse an experiment id
    # another test made active in another store
    client = MlflowClient(mlflow_uri)
    run = client.create_run(client.create_experiment("merge-kept"))
    _log_kept_merge(SimpleNamespace(mlflow_run_id=run.info.run_id, tracking_uri=mlflow_uri), merged)
    client.set_terminated(run.info.run_id)
    metrics = client.get_run(run.info.run_id).data.metrics
    assert metrics["merge/requantized_tensors"] == 4 and 0 < metrics["merge/requant_rel_rms_max"] < 0.25
    assert {"merge/logits_max_abs_err", "merge/logits_cosine", "merge/requant_max_over_bound"} <= set(metrics)
    assert [a.path for a in client.list_artifacts(run.info.run_id, "merge")] == ["merge/verification.json"]


def test_merge_resumes_after_a_crash(world, monkeypatch):
    from moeflow.training import merge_kept as M

    kept, adapter = world["mxfp4"]
    dest = world["root"] / "merged-resume"
    real, calls = M._merge_file, []

    def crash_second(*args, **kwargs):
        calls.append(args[2])
        if len(calls) == 2:
            raise KeyboardInterrupt  # the process dies between two files
        return real(*args, **kwargs)

    monkeypatch.setattr(M, "_merge_file", crash_second)
    with pytest.raises(KeyboardInterrupt):
        M.merge_kept(kept, adapter, dest)
    stage = dest.parent / f".{dest.name}.partial"
    assert not dest.exists() and (stage / M.PROGRESS).is_file()
    first = stage / calls[0]
    stamp = first.stat().st_mtime_ns
    monkeypatch.setattr(M, "_merge_file", real)
    out = M.merge_kept(kept, adapter, dest)
    assert (dest / calls[0]).stat().st_mtime_ns == stamp  # finished file kept, not redone
    clean = M.merge_kept(kept, adapter, world["root"] / "merged-clean")
    assert out["manifest_sha256"] != "" and _stored(dest).keys() == _stored(Path(clean["output_dir"])).keys()
    assert all(torch.equal(a, b) for a, b in zip(_stored(dest).values(),
                                                 _stored(Path(clean["output_dir"])).values()))


def test_merged_release_serves_on_the_local_engine(world):
    from peft import PeftModel
    from transformers import AutoTokenizer

    from moeflow.model.models import load_model
    from moeflow.model.packed_base import load_packed
    from moeflow.serving.engine import Engine, EngineConfig, SamplingParams
    from moeflow.training.merge import write_merged

    kept, adapter = world["mxfp4"]
    merged = write_merged(str(kept), adapter, world["root"] / "merged-serve", "float32")
    tok = AutoTokenizer.from_pretrained(str(merged))
    prompts = ["hello world", "the quick brown fox"]
    plain, _ = load_packed(kept, torch.float32, packed=False)
    ref_model = PeftModel.from_pretrained(plain, str(adapter)).eval()
    refs = []
    for p in prompts:
        ids = tok(p, return_tensors="pt").input_ids
        refs.append(ref_model.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:].tolist())
    engine = Engine(load_model(merged, torch.float32), tok, EngineConfig(max_num_batched_tokens=16))
    out: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        engine.submit(str(i), tok(p).input_ids, SamplingParams(max_tokens=8),
                      lambda d, i=i: out[i].extend(d.token_ids))
    engine.run_until_idle()
    assert [out[i] for i in range(len(prompts))] == refs


def test_targets_a_merge_cannot_requantise_are_refused_before_training(world, tmp_path, monkeypatch):
    from moeflow.checkpoint import requant
    from moeflow.core.config import load_config
    from moeflow_testing.releases import ct_release
    from workflows.dag import registry

    everything = ct_release(world["qwen"], tmp_path / "int4-all", "int4-group")  # attention too
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "a", "completion": "b"}\n')
    spec = registry()["finetune"]

    def cfg(*extra):
        return load_config(REPO / "configs/demo.yaml", [f"model.path={everything}", "convert.dtype=keep",
                                                        f"data.train_file={data}", f"data.eval_file={data}",
                                                        "finetune.adapters={}", *extra])

    spec.preflight(cfg("finetune.merge=true"))  # INT4 attention: requantised, no longer refused
    # a format the requantiser cannot write (e.g. a group size the width does not divide)
    monkeypatch.setattr(requant, "unsupported", lambda info: "pack-quantized with group size 48")
    with pytest.raises(UserError, match=r"^finetune.merge: LoRA target model\.layers\.0\."
                                        r"self_attn\.\w+ is stored pack-quantized .* cannot requantise "
                                        r"pack-quantized with group size 48") as e:
        spec.preflight(cfg("finetune.merge=true"))
    assert "\n" not in str(e.value)
    with pytest.raises(UserError, match=r"^deploy.merge: LoRA target"):
        spec.preflight(cfg("deploy.merge=true", "deploy.backend=vllm"))
    with pytest.raises(UserError, match="no adapter_config.json"):
        from moeflow.training.merge_kept import merge_kept

        merge_kept(world["mxfp4"][0], tmp_path, tmp_path / "m")


def test_a_format_the_requantiser_cannot_write_is_named(world):
    import dataclasses
    import json

    from moeflow.checkpoint.formats import find_packed
    from moeflow.checkpoint.parse import read_checkpoint
    from moeflow.checkpoint.requant import requantize, unsupported

    packed, _ = find_packed(read_checkpoint(world["int4-release"]))
    info = packed["model.layers.0.mlp.experts.0.down_proj.weight"]
    assert unsupported(info) is None
    scheme = json.loads(info.scheme)
    scheme["weights"]["group_size"] = 48
    odd = dataclasses.replace(info, scheme=json.dumps(scheme))
    assert unsupported(odd) == f"input width {info.shape[1]} not a multiple of group size 48"
    with pytest.raises(UserError, match=r"tensor model\.layers\.0\.mlp\.experts\.0\.down_proj"
                                        r"\.weight: cannot requantise input width"):
        requantize(odd, torch.zeros(info.shape))


@pytest.mark.parametrize("adapter", ["attention", "experts"])
def test_the_layer_streamed_logits_check_agrees_with_the_whole_model_one(world, adapter, monkeypatch):
    """For merges larger than the host: the check runs one layer at a time (MXFP4 here,
    which moeflow.quant.streamed's own source does not read) and gives the whole check's numbers."""
    from moeflow.training import merge_check
    from moeflow.training.merge_kept import merge_kept

    kept, attention = world["mxfp4"]
    chosen = {"attention": attention, "experts": world["experts"]}[adapter]
    whole = merge_kept(kept, chosen, world["root"] / f"whole-{adapter}", streamed=False)["logits"]
    monkeypatch.setattr(merge_check, "host_bytes", lambda: merge_check.decoded_bytes(kept))  # too small
    streamed = merge_kept(kept, chosen, world["root"] / f"streamed-{adapter}")["logits"]
    assert streamed["streamed"] and not whole["streamed"] and streamed["passed"]
    assert abs(streamed["max_abs_err"] - whole["max_abs_err"]) <= 1e-5 * whole["scale"]
    assert abs(streamed["cosine"] - whole["cosine"]) <= 1e-6
    if adapter == "attention":
        assert streamed["max_abs_err"] <= streamed["tolerance"]


def test_a_bf16_release_gets_its_merged_weights_in_float32(tmp_path):
    """Rounded back to bf16, W + dW moves the logits off base + adapter by more than 1e-5:
    the merged full-precision tensors are written float32, the packed ones as stored."""
    from moeflow.checkpoint.convert import convert_checkpoint
    from moeflow.training.merge_kept import merge_kept
    from moeflow_testing.releases import mxfp4_release
    from moeflow_testing.tiny import build_debug_model

    oss = build_debug_model("gpt_oss", tmp_path / "oss", dtype="bfloat16")
    convert_checkpoint(mxfp4_release(oss, tmp_path / "rel"), tmp_path / "kept", dtype="keep", workers=1)
    adapter = _adapter(oss, tmp_path / "a", target_modules=["q_proj", "o_proj"])
    out = merge_kept(tmp_path / "kept", adapter, tmp_path / "merged")
    assert out["logits"]["passed"] and out["logits"]["max_abs_err"] <= 1e-5 * out["logits"]["scale"]
    before, after = _stored(tmp_path / "kept"), _stored(tmp_path / "merged")
    assert {after[n].dtype for n in out["merged"]} == {torch.float32}
    assert before["model.layers.0.self_attn.k_proj.weight"].dtype == torch.bfloat16
    packed = _packed_parts(tmp_path / "kept")
    assert packed and all(torch.equal(before[k], after[k]) for k in packed)  # the MXFP4 experts
