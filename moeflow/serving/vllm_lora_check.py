"""vLLM's own LoRA loading run on an adapter against a base checkpoint: no model, no forward.

Runs in the vLLM environment (`make setup-vllm`), as a script (it imports nothing of moeflow):

    .venv-vllm/bin/python moeflow/serving/vllm_lora_check.py BASE_DIR ADAPTER_DIR [--max-lora-rank 64]

prints one JSON line {"problems": [...]}, each problem one line naming the tensor(s).
moeflow.serving.adapter_check calls it before an adapter is registered or deployed.

What vLLM itself checks when it loads an adapter (vllm.lora.worker_manager._load_adapter):
the adapter config (`PEFTHelper.validate_legal`: rank, features vLLM lacks) and the tensor
names' *leaf* modules against the model's LoRA-capable ones
(`LoRAModel.from_local_checkpoint`). The leaf is all it compares: a tensor under a path the
model does not have (a renamed prefix, a layer index out of range, another family's expert
layout) loads, and vLLM never applies it -- the adapter silently does nothing. So after
vLLM's loading, every module it loaded is looked up in the base checkpoint (safetensors
headers only), and its LoRA A/B shapes against that module's weight: a tensor that would
be ignored or mis-shaped is a problem here, not a quiet no-op at serving time.

Expert LoRA: for a checkpoint that stores experts one by one, vLLM expects one LoRA per
expert module (`experts.<e>.gate_proj`, ...: moeflow.training.adapter_layout writes that
layout) and packs each layer's into its fused MoE layer with `PackedLoRALayerWeights.pack_moe`
over the list its expert mapping (`RoutedExperts.build_expert_params_mapping`) names: both
are run here, so an expert or projection missing from the adapter is named. Tensor
parallelism needs nothing more: vLLM slices each LoRA along the dimension it slices the
module's weight, whose shape the LoRA's must equal (checked); under expert parallelism the
vllm backend serves expert LoRA merged (vllm_backend.decide_adapters).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

PER_EXPERT = re.compile(r"^(?P<module>.+\.experts)\.(?P<e>\d+)\.(?P<leaf>[^.]+)$")
# the checkpoint projection names vLLM's MoE models pass to their expert mapping (gate, down, up)
VLLM_EXPERT_NAMES = (("gate_proj", "down_proj", "up_proj"), ("w1", "w2", "w3"))


def base_weights(base_dir: Path) -> dict[str, list[int]]:
    """{module name: weight shape} of the checkpoint's weights, from the safetensors headers."""
    # lazy here and below: this script runs in the vLLM venv; moeflow's own tools (the layer test,
    # docs) import it where vLLM is absent
    from safetensors import safe_open

    out: dict[str, list[int]] = {}
    for path in sorted(base_dir.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for key in f.keys():
                if key.endswith(".weight"):
                    out[key[: -len(".weight")]] = list(f.get_slice(key).get_shape())
    return out


def model_class(config: dict):
    """vLLM's model class of the checkpoint's architecture (its LoRA name mapping), or None."""
    # lazy: vLLM exists only in the vLLM venv
    from vllm.model_executor.models import ModelRegistry

    for arch in config.get("architectures") or []:
        if arch in ModelRegistry.get_supported_archs():
            return ModelRegistry._try_load_model_cls(arch)  # vLLM 0.29: the registry's own loader
    return None


def check(base_dir: Path, adapter_dir: Path, max_lora_rank: int) -> list[str]:
    # lazy: the vLLM venv's torch, loaded only when the check runs
    import torch
    from vllm.config.lora import LoRAConfig
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    config = json.loads((base_dir / "config.json").read_text())
    text = config.get("text_config") or config
    weights = base_weights(base_dir)
    cls = model_class(config)
    mapper = getattr(cls, "hf_to_vllm_mapper", None)
    mapper = mapper.get_rename_mapper() if mapper is not None else None
    # LoRA-capable leaves: vLLM's are its linear layers (utils.get_supported_lora_modules);
    # on disk, the 2-D weights' modules (HF names: vLLM expects those, not its packed ones)
    expected = {name.rsplit(".", 1)[-1] for name, shape in weights.items() if len(shape) == 2}
    expected |= {"experts"} if any(".experts" in n for n in weights) else set()
    packed = expert_packing(weights)
    for names in packed.values():
        expected |= {n[n.rindex("experts."):] for n in names}
    helper = PEFTHelper.from_local_dir(str(adapter_dir), text.get("max_position_embeddings"))
    problems = []
    try:
        helper.validate_legal(LoRAConfig(max_lora_rank=max_lora_rank, max_loras=1))
    except ValueError as exc:
        problems.append(f"vLLM refuses the adapter config: {exc}")
    try:
        lora = LoRAModel.from_local_checkpoint(
            str(adapter_dir), expected, peft_helper=helper, lora_model_id=1, device="cpu",
            dtype=torch.float32, model_vocab_size=text.get("vocab_size"), weights_mapper=mapper)
    except (ValueError, RuntimeError) as exc:
        first = str(exc).splitlines()[0]
        if " but received " in first:  # vLLM's unexpected-modules error: the expected set is long
            first = "modules it does not expect: " + first.split(" but received ", 1)[1].split(". Please")[0]
        return problems + [f"vLLM refuses the adapter: {first}"]
    for name, layer in sorted(lora.loras.items()):
        problems += _layer_problems(name, layer, weights)
    return problems + _pack_problems(lora.loras, packed)


def expert_packing(weights: dict[str, list[int]]) -> dict[str, list[str]]:
    """{experts module: its per-expert modules in the order vLLM packs them} for a checkpoint
    that stores experts one by one (vLLM's own mapping, as process_packed_modules_mapping
    builds it for the model); {} for fused or no experts."""
    # lazy: vLLM exists only in the vLLM venv
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    found: dict[str, tuple[set[str], set[int]]] = {}
    for name in weights:
        if m := PER_EXPERT.match(name):
            leaves, ids = found.setdefault(m["module"], (set(), set()))
            leaves.add(m["leaf"])
            ids.add(int(m["e"]))
    out = {}
    for module, (leaves, ids) in found.items():
        names = next((n for n in VLLM_EXPERT_NAMES if set(n) <= leaves), None)
        if names is None:
            continue
        mapping = RoutedExperts.build_expert_params_mapping(*names, num_experts=max(ids) + 1)
        parent = module[: -len("experts")]
        out[module] = [parent + w.rstrip(".") for _, w, _, _ in mapping if ".." not in w]
    return out


def _pack_problems(loras: dict, packed: dict[str, list[str]]) -> list[str]:
    """vLLM's packing of each layer's per-expert LoRA into its fused MoE layer."""
    # lazy: vLLM exists only in the vLLM venv
    from vllm.lora.lora_weights import PackedLoRALayerWeights

    out = []
    for module, names in sorted(packed.items()):
        present = [loras.get(n) for n in names]
        if not any(present):
            continue
        missing = [n for n, lw in zip(names, present) if lw is None]
        if missing:
            more = f" (+{len(missing) - 3} more)" if len(missing) > 3 else ""
            out.append(f"{module}: per-expert LoRA incomplete, vLLM packs all {len(names)} expert "
                       f"modules; missing {', '.join(missing[:3])}{more}")
            continue
        try:
            PackedLoRALayerWeights.pack_moe(present, module)
        except (AssertionError, RuntimeError) as exc:  # torch.stack of mismatched experts
            out.append(f"{module}: vLLM cannot pack its per-expert LoRA: {str(exc).splitlines()[0]}")
    return out


def _layer_problems(name: str, layer, weights: dict[str, list[int]]) -> list[str]:
    if name not in weights:
        if name.endswith(".experts") and any(k.startswith(name + ".") for k in weights):
            # vLLM reads PEFT's 3-D layout only for a request flagged is_3d_lora_weight on an
            # engine with enable_mixed_moe_lora_format; Ray Serve LLM sends no such flag
            return [f"{name}: fused 3-D expert LoRA (PEFT target_parameters): through Ray Serve LLM "
                    f"vLLM takes it for a 2-D one and applies it wrongly; export it per expert "
                    f"(moeflow.training.adapter_layout) or serve it merged"]
        return [f"{name} (tensors {name}.lora_A/B): vLLM loads it, but the model has no module {name}: "
                f"never applied"]
    out_f, in_f = weights[name][0], weights[name][-1]
    got_in = layer.lora_a.shape[-1] if layer.lora_a is not None else None
    got_out = layer.lora_b.shape[0] if layer.lora_b is not None else None
    if got_in is None or got_out is None:
        return [f"{name}: only one of lora_A / lora_B is in the adapter"]
    if (got_in, got_out) != (in_f, out_f):
        return [f"{name}.lora_A/B: shapes {list(layer.lora_a.shape)} / {list(layer.lora_b.shape)} do not fit "
                f"{name}.weight {weights[name]} (in {in_f}, out {out_f})"]
    return []


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("base", type=Path)
    p.add_argument("adapter", type=Path)
    p.add_argument("--max-lora-rank", type=int, default=512)
    a = p.parse_args()
    print(json.dumps({"problems": check(a.base, a.adapter, a.max_lora_rank)}))


if __name__ == "__main__":
    main()
