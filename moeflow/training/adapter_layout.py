"""An expert LoRA trained on fused expert tensors, written in the per-expert layout vLLM loads.

moeflow fine-tunes the routed experts as transformers holds them: one 3-D tensor per
projection (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]),
adapted by PEFT's `target_parameters` (`ParamWrapper`): per tensor one lora_A [E*r, in]
(rows expert-major) and one lora_B [out, r*E] (columns rank-major), i.e. a rank-r LoRA
per expert, `dW_e = s * B_e @ A_e`. vLLM's LoRA loader for a model whose checkpoint stores
experts one by one (Qwen-MoE, DeepSeek, Mixtral, ... : vLLM's `FusedMoEWithLoRA`) expects
the checkpoint's own per-expert modules instead (`experts.<e>.gate_proj.lora_A.weight`
[r, H], ...). Served as they are, PEFT's two tensors per layer are taken for one 2-D LoRA
and applied wrongly (or only with a per-request flag Ray Serve LLM does not send).

`export_per_expert` writes the same adapter in that layout. Which per-expert modules a
fused tensor is made of, and along which axis, is transformers' own checkpoint conversion
mapping (the `WeightConverter` `from_pretrained` applies: MergeModulelist(dim=0), then
Concatenate(dim=d) for gate/up); which tensor of the adapter adapts which fused parameter
is PEFT's own wrapping of the model built on the meta device. No family table here.
The split is exact: every exported tensor is a slice of a trained one, so the per-expert
adapter's dW equals the 3-D adapter's (tests/test_vllm_layout.py).

    from moeflow.training.adapter_layout import export_per_expert
    export_per_expert(base_dir, "out/finetune/adapter", "out/deploy/vllm-lora/adapter")
"""

from __future__ import annotations

import hashlib
import json
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from moeflow.core.errors import UserError
from moeflow.model.params import load_config_json

WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"
LAYOUT = "moeflow_layout.json"  # what the export is and where it came from (vLLM reads neither)
PEFT_PREFIX = "base_model.model."


@dataclass
class FusedLoRA:
    """One PEFT ParamWrapper of the adapter: which fused parameter, which tensors."""

    key: str  # the wrapper's tensor prefix in the adapter file (… .lora_A.weight)
    param: str  # the fused parameter it adapts, model-relative (model.layers.0.mlp.experts.gate_up_proj)
    experts: int
    out_axis: int  # the parameter's axis of the Linear view's out features (1: [E, out, in])


def fused_loras(base_dir: str | Path, adapter_dir: str | Path) -> list[FusedLoRA]:
    """The expert ParamWrappers PEFT builds for the adapter's config on the base (meta device)."""
    # lazy: peft / transformers (seconds): only an export needs them
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora.layer import ParamWrapper

    from moeflow.model.anatomy import meta_model

    model, _ = meta_model(load_config_json(base_dir), where=str(Path(base_dir) / "config.json"))
    conf = LoraConfig.from_pretrained(str(adapter_dir))
    conf.inference_mode = True
    with warnings.catch_warnings():  # PEFT / transformers notes about a model nobody trains or saves
        warnings.simplefilter("ignore")
        peft_model = get_peft_model(model, conf, low_cpu_mem_usage=True)  # adapter weights on meta too
    out = []
    for name, mod in peft_model.named_modules():
        if not isinstance(mod, ParamWrapper) or mod.num_experts <= 1:
            continue
        owner = name.removeprefix(PEFT_PREFIX).replace(".base_layer", "")
        out.append(FusedLoRA(key=name, param=f"{owner}.{mod.parameter_name}", experts=mod.num_experts,
                             out_axis=1 if mod._did_swap_in_out_features else 2))
    return out


def _converters(base_dir: str | Path) -> list:
    """transformers' WeightConverters of the base's family (per-expert names -> fused)."""
    # lazy: the family (a meta model, transformers' conversion mapping): only an export needs it
    from moeflow.checkpoint.families import load_family

    return load_family(load_config_json(base_dir), where=str(Path(base_dir) / "config.json")).converters


def per_expert_names(param: str, converters: list) -> tuple[list[str], int | None]:
    """(per-expert module name templates with "{e}", the fused axis they are concatenated
    along or None) for fused parameter `param`, from transformers' conversion mapping.

    Raises:
        UserError: the family stores this parameter fused on disk, or converts it in a way
            that is not a per-expert stack (no per-expert layout exists to export to).
    """
    for conv in converters:
        for target in conv.target_patterns:
            if not param.endswith(target):
                continue
            ops = [type(op).__name__ for op in conv.operations]
            dims = [getattr(op, "dim", None) for op in conv.operations]
            stacked = ops[:1] == ["MergeModulelist"] and dims[0] == 0 and len(ops) <= 2
            if not stacked or (len(ops) == 2 and ops[1] != "Concatenate"):
                raise UserError(f"{param}: transformers converts it from the checkpoint with {ops}, "
                                f"not a per-expert stack: no per-expert LoRA layout to export")
            prefix = param[: len(param) - len(target)]
            names = []
            for src in conv.source_patterns:
                if src.count("*") != 1 or not src.endswith(".weight"):
                    raise UserError(f"{param}: checkpoint pattern {src!r} names no single expert index")
                names.append(prefix + src.removesuffix(".weight").replace("*", "{e}"))
            return names, (dims[1] if len(ops) == 2 else None)
    raise UserError(f"{param}: the checkpoint stores it fused (transformers converts no per-expert "
                    f"tensors into it): vLLM loads this family's expert LoRA in the 3-D layout")


def split_fused(a: torch.Tensor, b: torch.Tensor, lora: FusedLoRA, names: list[str],
                concat: int | None) -> dict[str, torch.Tensor]:
    """Per-expert {module.lora_A/B.weight: tensor} from one ParamWrapper's lora_A/lora_B.

    PEFT's layout (ParamWrapper.get_delta_weight): A [E*r, in] -> [E, r, in];
    B [out, r*E] -> [out, r, E]; dW_e = B[:, :, e] @ A[e] (Linear view, [out, in]).
    """
    e_count = lora.experts
    a3 = a.reshape(e_count, -1, a.shape[-1])  # [E, r, in]
    b3 = b.reshape(b.shape[0], -1, e_count).permute(2, 0, 1)  # [E, out, r]
    parts = len(names)
    if parts > 1:
        in_axis = 3 - lora.out_axis
        if concat not in (lora.out_axis, in_axis):
            raise UserError(f"{lora.param}: its {parts} per-expert modules are concatenated along axis "
                            f"{concat}, neither its in nor out axis")
        along_out = concat == lora.out_axis
        width = b3.shape[1] if along_out else a3.shape[2]
        if width % parts:
            raise UserError(f"{lora.param}: {width} features do not split into {parts} modules")
    out: dict[str, torch.Tensor] = {}
    for e in range(e_count):
        for j, name in enumerate(names):
            ae, be = a3[e], b3[e]
            if parts > 1 and along_out:
                be = be.chunk(parts, dim=0)[j]  # gate rows, then up rows: B's rows split, A shared
            elif parts > 1:
                ae = ae.chunk(parts, dim=1)[j]  # inputs concatenated: A's columns split, B shared
            key = PEFT_PREFIX + name.format(e=e)
            out[f"{key}.lora_A.weight"] = ae.contiguous().clone()
            out[f"{key}.lora_B.weight"] = be.contiguous().clone()
    return out


def export_per_expert(base_dir: str | Path, adapter_dir: str | Path, out_dir: str | Path) -> Path:
    """Write the adapter at `adapter_dir` with its fused expert LoRA split per expert.

    Non-expert tensors are copied unchanged; adapter_config.json loses target_parameters
    and names the per-expert modules in target_modules. Rewritten only when `out_dir`
    holds an export of another adapter (moeflow_layout.json says which).

    Returns:
        `out_dir`.
    Raises:
        UserError: no adapter there, a tensor the config implies is missing, or the
            family has no per-expert layout (one line naming the tensor).
    """
    # lazy: safetensors' torch API, with the export
    from safetensors.torch import load_file, save_file

    src, out_dir = Path(adapter_dir), Path(out_dir)
    weights = src / WEIGHTS
    if not weights.is_file() or not (src / CONFIG).is_file():
        raise UserError(f"{src}: not a PEFT adapter ({CONFIG} and {WEIGHTS} expected)")
    stamp = {"layout": "per_expert", "source": str(src.resolve()),
             "source_sha": _digest(weights)}
    if (out_dir / LAYOUT).is_file() and json.loads((out_dir / LAYOUT).read_text()) == stamp:
        return out_dir
    tensors = load_file(str(weights))
    conf = json.loads((src / CONFIG).read_text())
    loras = fused_loras(base_dir, src)
    converters = _converters(base_dir) if loras else []
    modules: set[str] = set()
    for lora in loras:
        a, b = (tensors.pop(f"{lora.key}.lora_{h}.weight", None) for h in "AB")
        if a is None or b is None:
            raise UserError(f"{weights}: {lora.key}.lora_A/B.weight missing (the config targets {lora.param})")
        names, concat = per_expert_names(lora.param, converters)
        tensors.update(split_fused(a, b, lora, names, concat))
        modules |= {n.rsplit(".", 1)[-1] for n in names}
    targets = conf.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    conf.update(target_parameters=None, target_modules=sorted(set(targets) | modules))
    tmp = out_dir.with_name(f".{out_dir.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
    (tmp / CONFIG).write_text(json.dumps(conf, indent=2))
    (tmp / LAYOUT).write_text(json.dumps(stamp))
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.replace(out_dir)
    return out_dir


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:16]
