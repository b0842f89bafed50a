"""Which transformers class loads a checkpoint — one rule for finetune, regress and deploy.

An adapter trained on one module tree only loads on the same tree, so every
stage must pick the same class for a checkpoint:

- the causal-LM class where transformers maps the config to one (text MoE
  models; Llama-4, whose `Llama4ForCausalLM` is its text model — transformers
  5.24's `Llama4ForConditionalGeneration.forward` fails even on text, docs/facts.md);
- otherwise the image-text class (Qwen3-VL-MoE, ERNIE-4.5-VL-MoE), whose
  language model is under `model.language_model`;
- a `model_type` transformers does not know, with `architectures` naming a
  class it has (Kimi-K2: kimi_k2, DeepseekV3ForCausalLM): that class, reading
  the config with the class's own config class (moeflow.model.anatomy). Remote code
  (`auto_map`) runs only where convert recorded it under `model.trust_remote_code`
  (moeflow.model.remote_code): it is then registered as transformers' own.

A quantised release that convert kept as stored (`convert.dtype: keep` of an MXFP4 or
compressed-tensors release; its manifest's `kept_formats`) loads through
moeflow.model.packed_base: the same class and module names, the routed experts kept packed
and decoded one expert per matmul (finetune, regress, serving and deploy alike; an
adapter trained on it applies to the dequantised base unchanged).

A checkpoint with FP8 block-scaled weights whose scales transformers' dequantise-on-load
cannot pair (`convert --dtype fp8` keeps fused experts as `experts.gate_up_proj` +
`experts.gate_up_proj_scale_inv`; transformers pairs only `.weight` with
`.weight_scale_inv`) loads dequantised with its scales through the same loader, wherever
transformers' own FP8 quantizer says it would dequantise (no GPU, or one below compute
capability 8.9); on an FP8-capable GPU transformers' FP8 modules hold the scales natively.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from moeflow.checkpoint.manifest import MANIFEST
from moeflow.core.errors import UserError
from moeflow.model.anatomy import config_refused, is_config_refusal, resolve_class, source_config
from moeflow.model.remote_code import activate


def read_config(model_dir: str | Path) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise UserError(f"{model_dir}: not a model directory (no config.json)")

    activate(model_dir)  # a checkpoint's own code: checked against its sha256 record, registered
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: invalid JSON at line {exc.lineno}: {exc.msg}") from None


def auto_class(model_dir: str | Path):
    """AutoModelForCausalLM or AutoModelForImageTextToText, by the rule above."""
    # lazy: transformers: heavy, loaded only when this runs
    from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    raw = read_config(model_dir)
    model_type = raw.get("model_type")
    if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return AutoModelForCausalLM
    if isinstance(model_type, str) and model_type not in CONFIG_MAPPING and raw.get("architectures"):
        return resolve_class(raw, f"{model_dir}/config.json")[0]
    try:
        AutoConfig.from_pretrained(str(model_dir))
    except (ValueError, KeyError, OSError) as exc:
        raise UserError(f"{model_dir}: transformers cannot read this config "
                        f"(model_type {model_type!r}): {str(exc).splitlines()[0]}") from None
    return AutoModelForImageTextToText


def is_image_text(model) -> bool:
    """True for a loaded image-text model (one with a vision tower to feed pixels to)."""
    return callable(getattr(model, "get_image_features", None))


def kept_formats(model_dir: str | Path) -> list[str]:
    """Release formats of a checkpoint convert kept quantised (`convert.dtype: keep` of an
    MXFP4 / compressed-tensors release, manifest `kept_formats`); [] for any other."""
    path = Path(model_dir) / MANIFEST
    if not path.is_file():
        return []
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return []
    return sorted(manifest.get("kept_formats") or {}) if manifest.get("dtype") == "keep" else []


def load_model(model_dir: str | Path, dtype, **kwargs):
    """`from_pretrained` with the class `auto_class` picks; safetensors only (no pickles).
    A config transformers does not know by model_type is read as its class's own.
    A quantised base kept as stored loads with its routed experts packed (`load_packed`)."""
    if kept_formats(model_dir):
        return load_packed_base(model_dir, dtype, **kwargs)
    if unpaired_fp8_scales(model_dir, kwargs.get("device_map")):
        return load_fp8_unpaired(model_dir, dtype, **kwargs)
    kwargs.setdefault("config", source_config(model_dir))
    if kwargs["config"] is None:
        del kwargs["config"]
    try:
        model = auto_class(model_dir).from_pretrained(str(model_dir), dtype=dtype, use_safetensors=True, **kwargs)
    except Exception as exc:
        if is_config_refusal(exc):  # a bad value in config.json: the user's to fix, said in one line
            raise config_refused(exc, f"{model_dir}/config.json") from None
        raise
    return unify_dtype(model, dtype)


def load_packed_base(model_dir: str | Path, dtype, **kwargs):
    """A kept quantised base (see `kept_formats`) through moeflow.model.packed_base.load_packed.

    Whole on each worker: the plan's FSDP / EP sharding (transformers' `distributed_config`)
    shards parameters, and packed experts are not parameters; it is refused in one line."""
    # lazy: torch, transformers, compressed-tensors: heavy, loaded only when this runs
    from moeflow.model.packed_base import load_packed

    kwargs.pop("config", None)  # the class comes from the checkpoint's config.json
    kwargs.pop("trust_remote_code", None)
    left = sorted(k for k, v in kwargs.items() if v is not None)
    if "distributed_config" in left:
        raise UserError(f"{model_dir}: convert.dtype keep gave a quantised base (experts "
                        f"{', '.join(kept_formats(model_dir))}), which loads whole on every worker: "
                        "the plan's FSDP/EP sharding (distributed_config) cannot shard packed "
                        "experts; convert with dtype bf16 to shard the base")
    if left:
        raise UserError(f"{model_dir}: a quantised base kept by convert.dtype keep cannot load "
                        f"with {left[0]}")
    model, _ = load_packed(model_dir, dtype)
    return model


SCALE_INV = "_scale_inv"  # an FP8 block-scaled weight's scales: `<weight name>_scale_inv`


def unpaired_fp8_scales(model_dir: str | Path, device_map=None) -> list[str]:
    """FP8 block scales of `model_dir` that transformers' loader would leave unused here:
    `X_scale_inv` tensors whose weight `X` is not a `.weight` (fused experts), in a checkpoint
    whose quantization_config transformers' own FP8 quantizer would dequantise on load on
    this host (it then pairs `.weight` / `.weight_scale_inv` only and loads the rest as raw
    e4m3 values, its scales reported unexpected). [] for any other checkpoint."""
    config = read_config(model_dir)
    qc = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    if not qc or not qc.get("weight_block_size"):
        return []
    # lazy: st_io imports torch, which this module does not at import
    from moeflow.checkpoint.st_io import read_header

    names: set[str] = set()
    for shard in sorted(Path(model_dir).glob("*.safetensors")):
        names.update(read_header(shard)[0])
    fused = sorted(n for n in names if n.endswith(SCALE_INV) and n[: -len(SCALE_INV)] in names
                   and not n[: -len(SCALE_INV)].endswith(".weight"))
    return fused if fused and _dequantized_on_load(qc, device_map) else []


def _dequantized_on_load(qc: dict, device_map) -> bool:
    """Whether transformers' quantizer for `qc` dequantises a pre-quantised checkpoint on
    this host (its own validate_environment decides: no GPU/XPU, an old GPU, or the
    config's `dequantize`)."""
    # lazy: transformers: heavy, loaded only when this runs
    from transformers.quantizers.auto import AutoHfQuantizer, AutoQuantizationConfig

    try:
        quantizer = AutoHfQuantizer.from_config(AutoQuantizationConfig.from_dict(dict(qc)), pre_quantized=True)
    except (ValueError, KeyError, ImportError):  # a method transformers does not know: its own load says so
        return False
    quiet = logging.getLogger("transformers")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # its "dequantizing to bf16" warning is about its own load, not ours
    try:
        quantizer.validate_environment(device_map=device_map)
    finally:
        quiet.setLevel(level)
    return bool(getattr(quantizer.quantization_config, "dequantize", False))


def load_fp8_unpaired(model_dir: str | Path, dtype, **kwargs):
    """A checkpoint with unpaired FP8 scales (see `unpaired_fp8_scales`) as a plain model:
    every FP8 weight dequantised with its block scales (moeflow.checkpoint.fp8) to `dtype`
    by moeflow.model.packed_base.load_packed (packed=False: experts are ordinary parameters,
    as transformers' dequantise-on-load would give, so every stage runs on it unchanged).
    Whole on each worker; the plan's FSDP / EP sharding is refused in one line."""
    # lazy: torch, transformers: heavy, loaded only when this runs
    from moeflow.model.packed_base import load_packed

    kwargs.pop("config", None)  # the class comes from the checkpoint's config.json
    kwargs.pop("trust_remote_code", None)
    kwargs.pop("device_map", None)  # dequantised on CPU; the caller moves the model
    left = sorted(k for k, v in kwargs.items() if v is not None)
    if left:
        scale = unpaired_fp8_scales(model_dir)[0]
        raise UserError(f"{model_dir}: FP8 block scales kept fused ({scale}) load dequantised by "
                        f"moeflow on this host, whole on every worker: cannot load with {left[0]}"
                        + (" (the plan's FSDP/EP sharding); convert with dtype bf16 to shard the base"
                           if left[0] == "distributed_config" else ""))
    model, _ = load_packed(model_dir, dtype, packed=False)
    return model


_QUANT_AUX = ("_scale", "_zero_point", "g_idx", "_global_scale")


def unify_dtype(model, dtype):
    """Cast the plain (unquantised) floating parameters a checkpoint stored in another float
    dtype to `dtype`, in place. A quantised checkpoint keeps the modules its precision plan
    left unquantised in the dtype they were written in (calibrate's bf16 experts), and
    from_pretrained with a quantization_config leaves them so: an fp32 model then holds bf16
    experts, which transformers' eager experts path multiplies with fp32 activations and fails
    (grouped_mm happens to cast). Quantised weights and their scales are left as stored.
    Only an fp32 model is unified (upcasting is exact): a bf16 model keeps the fp32 modules its
    class asks for (`_keep_in_fp32_modules`, routers)."""
    # lazy: torch: heavy, loaded only when this runs
    import torch

    floats = (torch.float32, torch.bfloat16, torch.float16)
    if dtype != torch.float32:
        return model
    for module in model.modules():
        if getattr(module, "quantization_scheme", None) is not None:  # compressed-tensors' own
            continue
        for name, param in module.named_parameters(recurse=False):
            if param.dtype in floats and param.dtype != dtype and not name.endswith(_QUANT_AUX):
                param.data = param.data.to(dtype)
    return model


def loads_image_text(model_dir: str | Path) -> bool:
    """True when `auto_class` picks the image-text class: the loaded model has a vision tower."""
    # lazy: transformers: heavy, loaded only when this runs
    from transformers import AutoModelForImageTextToText

    return auto_class(model_dir) is AutoModelForImageTextToText


def text_only_reason(model_dir: str | Path) -> str | None:
    """Why a checkpoint loads without a vision tower (None: it loads with one).

    A checkpoint without `vision_config` is text-only; one with it whose
    model_type transformers maps to a causal-LM class (Llama-4) loads as that
    text model by the rule above, so images cannot reach it either.
    """
    if loads_image_text(model_dir):
        return None
    # lazy: transformers: heavy, loaded only when this runs
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = read_config(model_dir)
    if "vision_config" not in config:
        return "the model is text-only (no vision_config)"
    cls = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.get("model_type") or "", "its causal-LM class")
    return (f"the model is text-only here: {config.get('model_type')} checkpoints load as "
            f"{cls}, their text model, without the vision tower (moeflow.model.models)")
