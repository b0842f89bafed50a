"""Fine-tuning image-text MoE checkpoints (Qwen3-VL-MoE, ERNIE-4.5-VL) and Llama-4 on text.

Every stage picks the model class by one rule (moeflow.model.models): the adapter
finetune trains on the image-text model loads in regress and deploy on the
same class. Checked here on tiny debug models: LoRA targets stay inside the
language model (ERNIE: text experts only), packed text rows stay apart, the
routing tap counts text routing, the adapter loads on `load_model(base)` with
PEFT and changes its logits, regress evaluates it in process (ERNIE's image
task through its own processor), and the plan's per-rank parameters equal the
loaded ones.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moeflow.core.config import LoraSection, OptimizerSection
from moeflow.core.errors import UserError
from moeflow.training import data as D
from moeflow.training import steps as T
from moeflow.training.lora import apply_lora, resolve_targets

pytestmark = pytest.mark.usefixtures("one_thread")

VL = ["qwen3_vl_moe", "ernie4_5_vl_moe"]
OPT = OptimizerSection(lr=1e-2, weight_decay=0.0, betas=(0.9, 0.999), warmup_steps=1,
                       schedule="constant", max_grad_norm=1.0)
TARGETS = ["attention", "experts", "router"]
LM = "model.language_model."


def _lora(targets=TARGETS):
    return LoraSection(rank=4, alpha=8, dropout=0.0, target_modules=list(targets))


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    from moeflow_testing.tiny import build_debug_model

    root = tmp_path_factory.mktemp("vl")
    return {f: build_debug_model(f, root / f, dtype="float32") for f in VL + ["llama4"]}


def _rows(tok, n=8):
    recs = [{"prompt": f"reverse: {w}\nanswer:", "completion": " " + w[::-1]}
            for w in ["cat", "dog", "bird", "fish", "lion", "bear", "wolf", "frog"][:n]]
    return D.pack(D.tokenize(recs, tok), 48, tok.pad_token_id)


def _train(base: Path, out: Path, targets=TARGETS, steps=12) -> tuple[Path, list[float], dict]:
    """A few LoRA steps with the finetune step functions; the adapter saved to `out`."""
    torch.manual_seed(0)
    model, tok = T.load_base(str(base), "float32", "eager")
    model.config.use_cache = model.config.get_text_config().use_cache = False
    peft_model, targets_, _ = apply_lora(model, _lora(targets))
    text = model.config.get_text_config()
    experts = getattr(text, "num_local_experts", None) or text.num_experts  # Llama-4 | VL
    tap = T.RouterTap(peft_model, text.num_experts_per_tok)
    opt, sched = T.make_optimizer(peft_model, OPT, steps)
    rows = _rows(tok)
    losses, r = [], {}
    for _ in range(steps):
        r = T.forward_backward(peft_model, rows, 1.0, tap, experts)
        T.optimizer_step(peft_model, opt, sched, 1.0)
        losses.append(r["loss"])
    peft_model.save_pretrained(str(out))
    return out, losses, {"counts": r["counts"], "tap": tap, "rows": rows,
                         "targets": targets_, "model": peft_model}


@pytest.fixture(scope="module")
def trained(bases, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {f: _train(bases[f], root / f) for f in VL}


# ---------------------------------------------------------------- targets


@pytest.mark.parametrize("family", VL + ["llama4"])
def test_lora_aliases_stay_in_the_language_model(family, tmp_path):
    from moeflow.model.anatomy import vision_parts
    from moeflow.training.driver import targets_on_meta
    from moeflow_testing.tiny import debug_config

    debug_config(family).save_pretrained(tmp_path)
    assert targets_on_meta(tmp_path, _lora(["attention"])).modules  # finetune's preflight
    from transformers import AutoConfig

    from moeflow.model.models import auto_class  # the class every stage loads

    with torch.device("meta"):
        model = auto_class(tmp_path).from_config(AutoConfig.from_pretrained(tmp_path))
    names = ["attention", "experts", "router"] + (["shared_experts"] if family != "qwen3_vl_moe"
                                                  else [])
    t = resolve_targets(model, names)
    if family == "llama4":  # its text model: no vision tower is even loaded
        assert type(model).__name__ == "Llama4ForCausalLM" and vision_parts(model) == ()
        assert all(n.startswith("model.layers.") for n in t.modules)
        return
    assert set(vision_parts(model)) >= ({"model.visual"} if family == "qwen3_vl_moe"
                                        else {"model.vision_tower", "model.resampler_model"})
    assert t.modules and all(n.startswith(LM + "layers.") for n in t.modules)
    assert len(t.matched["attention"]) == 2 * 4  # 2 layers x q/k/v/o, none of the vision tower's
    if family == "ernie4_5_vl_moe":  # text experts and the text router only
        assert t.parameters == ["text_moe.experts.down_proj", "text_moe.experts.gate_up_proj",
                                "text_moe.gate.weight"]
        shared = t.matched["shared_experts"]
        assert shared and all("shared_experts" in n for n in shared)
    else:
        assert t.parameters == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj",
                                "mlp.gate.weight"]
    # every parameter suffix hits language-model tensors only (PEFT matches suffixes anywhere)
    for suffix in t.parameters:
        hits = [n for n, _ in model.named_parameters() if n.endswith("." + suffix)]
        assert hits and all(n.startswith(LM) for n in hits), suffix
    # the vision tower's own attention / MLP names are refused, not silently adapted
    for req, match in (("qkv", "matches nothing"), ("fc1" if family != "qwen3_vl_moe" else
                                                    "linear_fc1", "matches nothing"),
                       ("attn.qkv.weight", "vision-tower parameters")):
        with pytest.raises(UserError, match=match):
            resolve_targets(model, [req])


def test_explicit_vision_experts_name_reaches_ernie_vision_experts():
    from transformers import AutoModelForImageTextToText

    from moeflow_testing.tiny import debug_config

    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(debug_config("ernie4_5_vl_moe"))
    t = resolve_targets(model, ["vision_moe.experts.gate_up_proj"])
    assert t.parameters == ["vision_moe.experts.gate_up_proj"]


# ---------------------------------------------------------------- training steps


@pytest.mark.parametrize("family", VL)
def test_packed_text_rows_stay_apart(bases, family):
    """ERNIE-VL builds the packed-sequence mask only from [4, B, S] position ids."""
    model, tok = T.load_base(str(bases[family]), "float32", "eager")
    recs = [{"prompt": f"reverse: {w}\nanswer:", "completion": " " + w[::-1]}
            for w in ["a b c", "d e f g"]]
    exs = D.tokenize(recs, tok)
    packed = D.pack(exs, 64, tok.pad_token_id)  # [R=1, S]: both examples in one row
    assert packed["input_ids"].shape[0] == 1
    total, count = T.eval_loss_sum(model, packed, 4)
    parts = [T.eval_loss_sum(model, D.pack([e], 64, tok.pad_token_id), 4) for e in exs]
    assert count == sum(c for _, c in parts)
    assert total == pytest.approx(sum(t for t, _ in parts), rel=1e-5)


@pytest.mark.parametrize("family", VL)
def test_training_lowers_the_loss_and_taps_text_routing(trained, family):
    _, losses, r = trained[family]
    assert losses[-1] < losses[0] - 0.3, losses
    rows, tap = r["rows"], r["tap"]
    moe_layers = [0, 1] if family == "qwen3_vl_moe" else [1]  # ERNIE: layer 0 is dense
    assert tap.layer_ids == moe_layers  # ERNIE: text_moe's router only, not vision_moe's
    k = 2
    assert r["counts"].sum(-1).tolist() == [k * float(rows["real"].sum())] * len(moe_layers)
    # only LoRA tensors of the language model train
    trainable = [n for n, p in r["model"].named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n and ".language_model." in n for n in trainable)
    assert not any("vision_moe" in n for n in trainable)


@pytest.mark.parametrize("family", VL)
def test_adapter_loads_on_load_model_and_changes_logits(bases, trained, family):
    import json

    from peft import PeftModel

    from moeflow.model.models import is_image_text, load_model

    adapter, _, r = trained[family]
    regex = json.loads((adapter / "adapter_config.json").read_text())["target_modules"]
    alternatives = regex.removeprefix("^(?:").removesuffix(")$").split("|")
    assert alternatives and all(a.startswith(r"model\.language_model\.") for a in alternatives)
    base = load_model(bases[family], torch.float32)
    assert is_image_text(base)
    model = PeftModel.from_pretrained(base, str(adapter)).eval()
    ids = r["rows"]["input_ids"][:1, :20]  # [1, S]
    with torch.no_grad():
        logits = model(input_ids=ids).logits  # [1, S, V]
        with model.disable_adapter():
            base_logits = model(input_ids=ids).logits  # [1, S, V]
        r["model"].eval()
        trained_logits = r["model"](input_ids=ids).logits  # [1, S, V]
    assert (logits - base_logits).abs().max() > 1e-3
    torch.testing.assert_close(logits, trained_logits, atol=1e-5, rtol=1e-5)


def test_merge_keeps_the_image_text_model_and_its_processor(bases, trained, tmp_path):
    from peft import PeftModel

    from moeflow.model.models import load_model
    from moeflow.training.merge import write_merged

    family = "ernie4_5_vl_moe"
    adapter = trained[family][0]
    out = write_merged(str(bases[family]), adapter, tmp_path / "merged", "float32")
    assert (out / "preprocessor_config.json").is_file()
    merged = load_model(out, torch.float32).eval()
    ref = PeftModel.from_pretrained(load_model(bases[family], torch.float32), str(adapter)).eval()
    ids = trained[family][2]["rows"]["input_ids"][:1, :16]  # [1, S]
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, ref(input_ids=ids).logits,
                                   atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------- plan vs loaded


@pytest.mark.parametrize("family", VL + ["llama4"])
def test_planned_rank_bytes_equal_the_loaded_model(bases, family):
    """The image-text class loads the vision tower (the plan counts it); Llama-4 loads
    its text model (planned without the tower); ERNIE keeps routers in fp32 under bf16
    (compared as elements x dtype size)."""
    from moeflow.training.driver import planned_bytes
    from moeflow.training.trainer import _check_rank_bytes

    plan = {"num_workers": 1, "data_parallel": 1}
    for dtype in ("float32", "bfloat16"):
        model, _ = T.load_base(str(bases[family]), dtype)
        planned = planned_bytes(plan, bases[family], dtype, 1)
        out = _check_rank_bytes(model, planned, 0, 1, strict=True, dtype=dtype)
        assert out["plan/bytes_match"] == 1.0, out


# ---------------------------------------------------------------- Llama-4


def test_llama4_adapter_loads_on_its_text_model(bases, tmp_path):
    from peft import PeftModel

    from moeflow.model.models import load_model

    adapter, losses, r = _train(bases["llama4"], tmp_path / "a",
                                targets=["attention", "shared_experts"], steps=6)
    assert losses[-1] < losses[0]
    base = load_model(bases["llama4"], torch.float32)
    assert type(base).__name__ == "Llama4ForCausalLM"
    model = PeftModel.from_pretrained(base, str(adapter)).eval()
    ids = r["rows"]["input_ids"][:1, :16]  # [1, S]
    with torch.no_grad():
        logits = model(input_ids=ids).logits  # [1, S, V]
        with model.disable_adapter():
            assert (logits - model(input_ids=ids).logits).abs().max() > 1e-4


# ---------------------------------------------------------------- regress


def _suite(tmp_path: Path) -> Path:
    from moeflow.evaluation.suite import GOLDEN_SUITE

    golden = GOLDEN_SUITE.parent / "golden"
    path = tmp_path / "vl.yaml"
    path.write_text(
        "name: vl\ntarget_tasks: [reverse_nll]\ntasks:\n"
        f"  - {{name: reverse_nll, type: perplexity, file: {golden}/reverse_heldout.jsonl, "
        "limit: 8, abs_tol: 5.0}\n"
        f"  - {{name: next_letter, type: multiple_choice, file: {golden}/next_letter.jsonl, "
        "limit: 4, abs_tol: 1.0}\n"
        f"  - {{name: image_colors, type: multimodal, file: {golden}/image_colors.jsonl, "
        "limit: 3, abs_tol: 1.0}\n")
    return path


@pytest.mark.parametrize("family", VL)
def test_regress_evaluates_the_adapter_in_process(bases, trained, family, tmp_path):
    from moeflow.core.config import validate
    from tasks.base import StageContext
    from tasks.regress import run

    cfg = validate({"name": "vlreg", "workdir": str(tmp_path / "w"),
                    "model": {"path": str(bases[family]), "dtype": "float32"},
                    "regress": {"shards": 1, "suite": str(_suite(tmp_path)), "batch_size": 4}})
    out = tmp_path / "out"
    out.mkdir()
    ctx = StageContext(stage="regress", config=cfg, out_dir=out, tracking_uri=None,
                       inputs={"convert": {"output_dir": str(bases[family])},
                               "finetune": {"adapter_dir": str(trained[family][0])}})
    res = run(ctx)
    assert res["passed"]
    for key in ("eval/reverse_nll/bits_per_byte", "eval/next_letter/acc", "eval/image_colors/acc"):
        assert any(k.startswith(key.rsplit("/", 1)[0]) for k in res["metrics"]), key
    adapted = {k: v for k, v in res["metrics"].items() if "reverse_nll" in k}
    base = {k.replace("eval_base/", "eval/"): v for k, v in res["base_metrics"].items()
            if "reverse_nll" in k}
    assert adapted != base  # the adapter was applied


def test_ernie_vl_image_task_runs_through_its_processor(bases):
    """ERNIE-VL needs `moe_mm_token_type_ids` (image tokens -> vision experts), which the
    processor returns; the image changes the scores."""
    from PIL import Image

    from moeflow.evaluation.runners import HFRunner
    from moeflow.evaluation.suite import GOLDEN_SUITE, load_suite

    runner = HFRunner(bases["ernie4_5_vl_moe"])
    assert runner.multimodal
    golden = GOLDEN_SUITE.parent / "golden"
    rec = dict(load_suite().task("image_colors").records[0])
    prompt = runner._image_prompt(Image.new("RGB", (32, 32)), rec["question"])
    assert int(prompt["moe_mm_token_type_ids"].sum()) > 0
    blue = dict(rec, image_path=str(golden / "images" / "blue_circle.png"))
    a, b = runner.image_choice_logliks(rec), runner.image_choice_logliks(blue)
    assert len(a) == len(rec["choices"]) and all(x < 0 for x in a) and a != b


def test_llama4_multimodal_task_is_skipped_saying_why(bases, tmp_path):
    from moeflow.evaluation.runners import evaluate
    from moeflow.evaluation.suite import load_suite

    res = evaluate(load_suite(_suite(tmp_path)), bases["llama4"])[0]
    note = res["tasks"]["image_colors"]["skipped"]
    assert "Llama4ForCausalLM" in note and "vision tower" in note
    assert "metrics" in res["tasks"]["reverse_nll"]


def test_image_task_is_skipped_when_the_processor_cannot_be_built(bases, tmp_path):
    """An image-text checkpoint without its processor files: text tasks still run, the
    multimodal task is skipped with the reason instead of failing the evaluation."""
    import shutil

    from moeflow.evaluation.runners import evaluate
    from moeflow.evaluation.suite import load_suite

    base = tmp_path / "no-processor"
    shutil.copytree(bases["ernie4_5_vl_moe"], base,
                    ignore=shutil.ignore_patterns("preprocessor_config.json", "processor_config.json"))
    res = evaluate(load_suite(_suite(tmp_path)), base)[0]
    note = res["tasks"]["image_colors"]["skipped"]
    assert "processor cannot be built" in note and "preprocessor_config.json" in note
    assert "metrics" in res["tasks"]["reverse_nll"] and "metrics" in res["tasks"]["next_letter"]


# ---------------------------------------------------------------- the stage on Ray


@pytest.mark.slow  # ~35 s: Ray Train start-up dominates
def test_finetune_stage_on_ernie_vl(bases, tmp_path, ray_local):
    """`moeflow finetune` on an image-text checkpoint (it refused with "Unrecognized
    configuration class" before): one Ray Train worker, expert + attention LoRA; the
    plan's bytes match the loaded model, routing is logged, and the adapter reproduces
    the worker's probe logits on `load_model(original)`."""
    import shutil

    from mlflow.tracking import MlflowClient
    from peft import PeftModel
    from safetensors.torch import load_file

    from moeflow.model.models import load_model
    from moeflow_testing.demo_data import make_dataset
    from tasks.finetune import run
    from tests.test_finetune_stage import make_config, make_ctx, start_run

    original = bases["ernie4_5_vl_moe"]
    converted = tmp_path / "converted"  # stands in for the convert stage's output
    shutil.copytree(original, converted)
    train, eval_ = make_dataset(tmp_path / "data", n_train=48, n_eval=4, seed=0)
    assets = {"original": original, "converted": converted, "train": train, "eval": eval_}
    cfg = make_config(assets, tmp_path, lora={"target_modules": ["attention", "experts"]},
                      finetune={"max_steps": 3, "checkpoint_every": 2, "max_eval_examples": 2})
    run_id = start_run(cfg.tracking.uri, tmp_path)
    plan = {"num_workers": 1, "tensor_parallel": 1, "pipeline_parallel": 1,
            "expert_parallel": 1, "data_parallel": 1, "fsdp": 1, "mode": "lora"}
    rec = run(make_ctx(cfg, assets, tmp_path / "out", run_id, plan=plan))
    m = rec["metrics"]
    assert m["plan/bytes_match"] == 1.0 and m["step"] == 3
    assert rec["targets"]["experts"] == ["text_moe.experts.down_proj",
                                        "text_moe.experts.gate_up_proj"]
    logged = MlflowClient(tracking_uri=cfg.tracking.uri).get_run(run_id).data.metrics
    assert "routing/layer1/entropy" in logged and "routing/layer0/entropy" not in logged
    probe = load_file(rec["probe_path"])
    model = PeftModel.from_pretrained(load_model(original, torch.float32),
                                      rec["adapter_dir"]).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=probe["input_ids"]).logits, probe["logits"],
                                   atol=1e-4, rtol=1e-4)
