"""Store the reference-shape checkpoint's routed experts as MXFP4, the release's on-disk format.

Each fused expert weight `...mlp.experts.gate_up_proj` [E, 2I, L] and
`...down_proj` [E, L, I] (the model's [E, out, in]) becomes
`<name>_blocks` uint8 [E, out, in/32, 16] and `<name>_scales` uint8 (E8M0)
[E, out, in/32], as GPT-OSS stores its experts, and config.json says
`quantization_config: {quant_method: mxfp4}`. The encoder is
`moeflow.checkpoint.mxfp4.encode` (OCP MX rounding, checked against
transformers' decoder there). Everything else stays as saved.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

INDEX = "model.safetensors.index.json"
EXPERT_WEIGHTS = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")


def store_experts_mxfp4(model_dir: str | Path) -> int:
    """Rewrite the routed experts of `model_dir` in MXFP4; returns how many weights changed."""
    # lazy: safetensors: heavy, loaded only when this runs; loads torch, which importing this module does not
    from safetensors.torch import load_file, save_file

    from moeflow.checkpoint import mxfp4

    model_dir = Path(model_dir)
    if (model_dir / INDEX).is_file():
        index = json.loads((model_dir / INDEX).read_text())
    else:  # one shard: an index makes the renamed tensors' file explicit
        from safetensors import safe_open

        with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
            index = {"metadata": {}, "weight_map": {k: "model.safetensors" for k in f.keys()}}
    weight_map = index["weight_map"]
    changed = 0
    for shard in sorted({f for f in weight_map.values()}):
        tensors = load_file(str(model_dir / shard))
        hit = [k for k, v in tensors.items() if k.endswith(EXPERT_WEIGHTS) and v.dim() == 3]
        for key in hit:
            blocks, scales = mxfp4.encode(tensors.pop(key))
            tensors[key + "_blocks"], tensors[key + "_scales"] = blocks, scales
            del weight_map[key]
            weight_map[key + "_blocks"] = weight_map[key + "_scales"] = shard
            changed += 1
        if hit:
            save_file(tensors, str(model_dir / shard), metadata={"format": "pt"})
    index["metadata"]["total_size"] = sum(
        (model_dir / f).stat().st_size for f in set(weight_map.values()))
    (model_dir / INDEX).write_text(json.dumps(index, indent=2))
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4",
                                     "modules_to_not_convert": ["model.visual", "lm_head", "self_attn",
                                                                "linear_attn", "shared_experts",
                                                                "mlp.gate", "embed_tokens"]}
    (model_dir / "config.json").write_text(json.dumps(config, indent=2))
    return changed


def dequantized_copy(src: str | Path, dst: str | Path) -> Path:
    """`src` with every MXFP4 pair dequantised by transformers' decoder
    (`moeflow.checkpoint.mxfp4.decode`) into the [E, out, in] weight it encodes:
    the reference for a model whose MXFP4 layout transformers' loader does not map
    (its MXFP4 integration knows GPT-OSS's modules only)."""

    # lazy: safetensors: heavy, loaded only when this runs; loads torch, which importing this module does not
    from safetensors.torch import load_file, save_file

    from moeflow.checkpoint import mxfp4

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != INDEX:
            shutil.copy2(f, dst / f.name)
    weight_map = {}
    for shard in sorted(src.glob("*.safetensors")):
        tensors = load_file(str(shard))
        for key in [k for k in tensors if k.endswith("_blocks")]:
            name = key.removesuffix("_blocks")
            tensors[name] = mxfp4.decode(tensors.pop(key), tensors.pop(name + "_scales"), name=name)
        save_file(tensors, str(dst / shard.name), metadata={"format": "pt"})
        weight_map.update({k: shard.name for k in tensors})
    (dst / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config", None)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst
