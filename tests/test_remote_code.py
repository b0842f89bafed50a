"""Remote code, opt in: refused without `model.trust_remote_code`, sha256-pinned at
convert, checked on every load; the reference-shape model (moeflow_testing/reference/) as the
checkpoint that needs it."""

from __future__ import annotations

import json
import shutil
from functools import lru_cache
from pathlib import Path

import pytest
import torch

from moeflow.core.errors import UserError
from moeflow.model import remote_code

REPO = Path(__file__).resolve().parents[1]


@lru_cache(maxsize=None)
def _built(root: str) -> Path:
    from moeflow_testing.reference.build import build_model

    # the reference's structure at test size: fewer experts keep the test fast
    return build_model(Path(root) / "ref", experts="bf16", n_routed_experts=32, num_experts_per_tok=4)


@pytest.fixture(scope="module")
def ref(tmp_path_factory) -> Path:
    return _built(str(tmp_path_factory.mktemp("remote")))


@pytest.fixture(scope="module")
def converted(ref, tmp_path_factory) -> Path:
    from moeflow.checkpoint.convert import convert_checkpoint

    remote_code.activate(ref, trust=True)  # the convert stage does this under the opt-in
    out = tmp_path_factory.mktemp("conv") / "converted"
    result = convert_checkpoint(ref, out, dtype="bf16", workers=1)
    assert result["report"]["passed"], result["report"]["failures"]
    return out


def _config(path: Path, trust: bool):
    from moeflow.core.config import load_config

    return load_config(REPO / "configs/reference-tiny.yaml",
                       [f"model.path={path}", f"model.trust_remote_code={str(trust).lower()}"])


def test_needs_code_only_for_auto_map_without_transformers_class(ref, tmp_path):
    assert remote_code.needs_code(ref)
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps({"model_type": "deepseek_v3", "auto_map": {
        "AutoConfig": "configuration_deepseek.DeepseekV3Config"}}))
    assert not remote_code.needs_code(plain)  # transformers has the class: its code is never run


def test_pipeline_refused_before_any_stage_without_the_key(ref):
    from workflows.dag import registry
    from workflows.selection import preflight

    cfg = _config(ref, trust=False)
    with pytest.raises(UserError, match=r"set model\.trust_remote_code: true") as exc:
        preflight(cfg, registry(), list(registry()))
    assert "modeling_refmoe.py" in str(exc.value) and "\n" not in str(exc.value)


def test_convert_pins_code_and_load_checks_it(ref, converted, tmp_path):
    from moeflow.model.models import load_model

    manifest = json.loads((converted / "manifest.json").read_text())
    assert manifest["remote_code"] == remote_code.digests(ref)
    assert set(manifest["remote_code"]) == {"configuration_refmoe.py", "modeling_refmoe.py"}
    model = load_model(converted, torch.float32).eval()
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()
    # an edited modeling file in a copy of the converted checkpoint: refused, naming the file
    copy = tmp_path / "edited"
    shutil.copytree(converted, copy)
    with open(copy / "modeling_refmoe.py", "a") as f:
        f.write("\n# edited after convert\n")
    with pytest.raises(UserError, match=r"modeling_refmoe\.py: remote code changed since convert"):
        load_model(copy, torch.float32)
    (copy / "modeling_refmoe.py").unlink()
    with pytest.raises(UserError, match=r"modeling_refmoe\.py: remote code file recorded at convert is missing"):
        remote_code.activate(copy)


def test_next_stage_refuses_code_edited_after_convert(ref, converted, tmp_path):
    """What the runner does before each stage: the code is checked against convert's record."""
    from workflows.execute import _remote_code

    cfg = _config(ref, trust=True)
    copy = tmp_path / "converted"
    shutil.copytree(converted, copy)
    assert _remote_code_ok(cfg, copy, _remote_code) == remote_code.digests(ref)
    (copy / "configuration_refmoe.py").write_text((copy / "configuration_refmoe.py").read_text() + "X = 1\n")
    with pytest.raises(UserError, match=r"configuration_refmoe\.py: remote code changed since convert"):
        _remote_code_ok(cfg, copy, _remote_code)


def _remote_code_ok(cfg, converted: Path, fn):
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{converted.parent / 'mlflow.db'}")
    mlflow.set_experiment("remote-code")  # not another test's active experiment id
    with mlflow.start_run():
        return fn(cfg, {"convert": {"output_dir": str(converted)}})


def test_untrusted_directory_refused_and_code_imported_from_checked_bytes(ref, tmp_path):
    copy = tmp_path / "fresh"
    shutil.copytree(ref, copy)
    with pytest.raises(UserError, match="trust_remote_code"):
        remote_code.activate(copy)  # no record, no opt-in
    files = remote_code.activate(copy, trust=True)
    assert files == remote_code.digests(ref)
    assert not (copy / "__pycache__").exists()  # nothing written into the checkpoint


def test_anatomy_classifies_the_reference_roles(ref):
    from moeflow.model.anatomy import anatomy

    remote_code.activate(ref, trust=True)
    an = anatomy(json.loads((ref / "config.json").read_text()), str(ref / "config.json"))
    kinds = {p.name: p.kind for p in an.params}
    lp = "model.language_model.layers"
    assert an.num_experts == 32 and an.top_k == 4 and an.layers_path == lp
    assert kinds[f"{lp}.0.linear_attn.q_proj.weight"] == "attention"
    assert kinds[f"{lp}.3.self_attn.kv_a_proj_with_mqa.weight"] == "attention"
    assert kinds[f"{lp}.0.mlp.experts.gate_up_proj"] == "experts"
    assert kinds[f"{lp}.0.mlp.shared_experts.up_proj.weight"] == "shared_experts"
    assert kinds[f"{lp}.0.mlp.gate.weight"] == "router"
    assert kinds[f"{lp}.0.mlp.latent_down.weight"] == "dense_mlp"
    assert kinds["model.visual.patch_embed.weight"] == "vision"
    assert kinds["lm_head.weight"] == "head"
    assert an.routers == [f"{lp}.{i}.mlp.gate" for i in range(4)]
