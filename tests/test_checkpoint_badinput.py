"""Bad checkpoints are refused with one line naming the file/tensor, and nothing
that looks like a finished output is left behind. Also: resume after an
interrupted conversion."""

import json
import shutil
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

import moeflow.checkpoint.convert as conv
from moeflow.checkpoint.convert import convert_checkpoint
from moeflow.checkpoint.parse import read_checkpoint
from moeflow.core.errors import UserError
from moeflow_testing.tiny import build_debug_model

CORPUS = ["reverse: a b c\nanswer: c b a"] * 8


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return build_debug_model("qwen3_moe", tmp_path_factory.mktemp("bad") / "qwen3", corpus=CORPUS)


@pytest.fixture
def src(base, tmp_path):
    path = tmp_path / "src"
    shutil.copytree(base, path)
    return path


def _index(path):
    return json.loads((path / "model.safetensors.index.json").read_text())


def _shard_of(path, name):
    return path / _index(path)["weight_map"][name]


def _refused(src, tmp_path, *needles, **kwargs):
    out = tmp_path / "out"
    with pytest.raises(UserError) as exc:
        convert_checkpoint(src, out, verify=False, **kwargs)
    msg = str(exc.value)
    assert "\n" not in msg
    for needle in needles:
        assert needle in msg, msg
    assert not out.exists() or not (out / "manifest.json").exists()
    return msg


EXPERT = "model.layers.1.mlp.experts.3.up_proj.weight"


def test_truncated_shard(src, tmp_path):
    shard = _shard_of(src, EXPERT)
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    _refused(src, tmp_path, shard.name, "truncated")


def test_corrupt_header_json(src, tmp_path):
    shard = _shard_of(src, EXPERT)
    data = bytearray(shard.read_bytes())
    data[8:12] = b"{{{{"
    shard.write_bytes(bytes(data))
    _refused(src, tmp_path, shard.name, "corrupt safetensors header JSON")


def test_index_names_missing_shard(src, tmp_path):
    shard = _shard_of(src, EXPERT)
    shard.unlink()
    _refused(src, tmp_path, "model.safetensors.index.json", shard.name, "does not exist")


def test_index_names_missing_tensor(src, tmp_path):
    index = _index(src)
    index["weight_map"]["model.layers.1.mlp.experts.99.up_proj.weight"] = index["weight_map"][EXPERT]
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    _refused(src, tmp_path, "model.layers.1.mlp.experts.99.up_proj.weight", "does not contain it")


def test_tensor_listed_twice(src, tmp_path):
    # two shards both holding the same tensor (no index: every shard is read)
    tensors = load_file(str(_shard_of(src, EXPERT)))
    save_file({EXPERT: tensors[EXPERT]}, str(src / "extra.safetensors"))
    (src / "model.safetensors.index.json").unlink()
    _refused(src, tmp_path, EXPERT, "listed twice")


def test_index_key_listed_twice(src, tmp_path):
    text = (src / "model.safetensors.index.json").read_text()
    line = f'"{EXPERT}": "{_index(src)["weight_map"][EXPERT]}"'
    (src / "model.safetensors.index.json").write_text(text.replace(line, line + ",\n    " + line))
    _refused(src, tmp_path, EXPERT, "listed twice")


def test_shape_contradicts_config(src, tmp_path):
    config = json.loads((src / "config.json").read_text())
    config["moe_intermediate_size"] = 24
    (src / "config.json").write_text(json.dumps(config))
    _refused(src, tmp_path, "contradicts config.json", "experts")


def _poison(src, name, values):
    shard = _shard_of(src, name)
    tensors = load_file(str(shard))
    flat = tensors[name].reshape(-1)
    flat[: len(values)] = torch.tensor(values, dtype=flat.dtype)
    save_file(tensors, str(shard), metadata={"format": "pt"})


def test_nonfinite_refused_unless_allowed(src, tmp_path):
    _poison(src, EXPERT, [float("nan"), float("inf"), float("nan")])
    msg = _refused(src, tmp_path, EXPERT, "3", "--allow-nonfinite")
    assert "NaN/Inf" in msg
    result = convert_checkpoint(src, tmp_path / "allowed", allow_nonfinite=True, verify=False)
    assert (tmp_path / "allowed" / "manifest.json").is_file() and result["tensors"] > 0


def test_pickle_checkpoint_refused(tmp_path):
    src = tmp_path / "pickled"
    src.mkdir()
    torch.save({"w": torch.zeros(2)}, src / "pytorch_model.bin")
    (src / "config.json").write_text(json.dumps({"model_type": "mixtral"}))
    _refused(src, tmp_path, "pytorch_model.bin", "pickle")


def test_not_moe_refused(tmp_path):
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2, vocab_size=64)
    cfg.architectures = ["LlamaForCausalLM"]
    transformers.LlamaForCausalLM(cfg).save_pretrained(str(tmp_path / "llama"))
    _refused(tmp_path / "llama", tmp_path, "config.json", "not a mixture-of-experts")


def test_unknown_family_and_class_refused(src, tmp_path):
    """A model_type transformers lacks loads by its `architectures` class (Kimi-K2,
    tests/test_generality.py); with an unknown class too it is refused. A checkpoint that
    ships its own code (auto_map) runs it only when the user opts in (moeflow/model/remote_code.py):
    without the key it is refused naming it."""
    config = json.loads((src / "config.json").read_text())
    config.update(model_type="brand_new_moe", architectures=["BrandNewMoeForCausalLM"])
    (src / "config.json").write_text(json.dumps(config))
    _refused(src, tmp_path, "brand_new_moe", "not a transformers model class")
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_brand_new.BrandNewMoeForCausalLM"}
    (src / "config.json").write_text(json.dumps(config))
    _refused(src, tmp_path, "needs its own modeling code", "trust_remote_code")


def test_header_length_beyond_file(tmp_path):
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", 10_000) + b"{}")
    src = tmp_path / "one"
    src.mkdir()
    shutil.copy(path, src / "model.safetensors")
    (src / "config.json").write_text("{}")
    with pytest.raises(UserError, match="model.safetensors: truncated or corrupt"):
        read_checkpoint(src)


def test_existing_output_refused(src, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    _refused(src, tmp_path, "not empty")
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"


def _interrupt_at_second_file(src, out, monkeypatch) -> list[str]:
    """Convert with a Ctrl-C while the second file converts; returns the files started."""
    real = conv.convert_file
    calls = []

    def flaky(task, stage, *args, **kwargs):
        calls.append(task["file"])
        if len(calls) == 2:
            raise KeyboardInterrupt  # the process dies mid-run
        return real(task, stage, *args, **kwargs)

    monkeypatch.setattr(conv, "convert_file", flaky)
    with pytest.raises(KeyboardInterrupt):
        convert_checkpoint(src, out, verify=False, workers=1)
    monkeypatch.setattr(conv, "convert_file", real)
    return calls


def test_interrupted_conversion_resumes(src, tmp_path, monkeypatch):
    out = tmp_path / "out"
    calls = _interrupt_at_second_file(src, out, monkeypatch)
    assert not out.exists()  # nothing that looks complete
    stage = tmp_path / ".out.partial"
    assert (stage / (calls[0] + ".done.json")).is_file()
    assert not (stage / calls[1]).exists()  # the interrupted file left no final name
    messages = []
    result = convert_checkpoint(src, out, workers=1, progress=messages.append)
    assert any(m.startswith(f"kept {calls[0]}") for m in messages)
    assert result["report"]["passed"] and not stage.exists()
    assert not list(out.glob("*.done.json"))


def test_torn_resume_marker_means_convert_again(src, tmp_path, monkeypatch):
    """A `.done.json` cut short (the process died while writing it) is not "done"."""
    out = tmp_path / "out"
    calls = _interrupt_at_second_file(src, out, monkeypatch)
    marker = tmp_path / ".out.partial" / (calls[0] + ".done.json")
    marker.write_text(marker.read_text()[:20])  # torn
    messages = []
    result = convert_checkpoint(src, out, workers=1, progress=messages.append)
    assert not any(m.startswith(f"kept {calls[0]}") for m in messages)
    assert any(m.startswith(f"wrote {calls[0]}") for m in messages) and result["report"]["passed"]
