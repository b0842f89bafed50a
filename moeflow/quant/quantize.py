"""Streaming quantisation into the compressed-tensors format.

    quantize_checkpoint("demo-work/model", "out/quantized", get_scheme("fp8"), ignore=[...])

One decoder layer at a time (memory: one layer): read its runtime tensors
(moeflow.quant.source), turn them back into the checkpoint layout with
transformers' own `revert_weight_conversion` (what `save_pretrained` writes:
per-expert `experts.N.*_proj.weight` where the family stores them so, which is
the layout transformers' and vLLM's compressed-tensors loaders expect), then
quantise every linear weight outside the ignore list with the scheme's
compressor and write one safetensors file per layer. config.json gets the
`quantization_config` (with the ignore list). Output goes to a temp directory
renamed into place at the end: an interrupted run leaves nothing that looks done.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

import torch

from moeflow.core.errors import UserError
from moeflow.core.fsutil import staged_dir
from moeflow.model.anatomy import vision_parts
from moeflow.quant.groups import checkpoint_layout, layer_parts, part_checkpoint_state
from moeflow.quant.schemes import Scheme, check_shape, ignored, quantization_config, quantize_weight
from moeflow.quant.source import ModelSource
from moeflow.quant.streamed import layer_ranges

_EXPERT = re.compile(r"\.experts\.\d+\.")  # a per-expert projection in the checkpoint layout


def default_ignore(source: ModelSource, quantize_vision: bool = False) -> list[str]:
    """What must stay in high precision: embeddings, lm_head, routers/gates, and the vision
    tower and projector (unless asked). Norms are not linear layers: never targeted."""

    meta = source.fam.meta
    out = [name for name, m in meta.named_modules() if isinstance(m, torch.nn.Embedding)]
    head = meta.get_output_embeddings()
    out += [name for name, m in meta.named_modules() if head is not None and m is head]
    out += [r"re:.*\.gate$", r"re:.*\.router$", r"re:.*shared_expert_gate$"]
    if not quantize_vision:
        out += [f"re:^{re.escape(part)}\\." for part in vision_parts(meta)]
    return out


def quantizable(source: ModelSource, key: str, shape: tuple[int, ...], ignore: list[str]) -> bool:
    """A checkpoint-layout weight the scheme quantises: the 2-D weight of a linear
    module (or of one expert's projection) that the ignore list does not cover."""
    if not key.endswith(".weight") or len(shape) != 2:
        return False
    module = key[: -len(".weight")]
    if ignored(module, ignore):
        return False
    if _EXPERT.search(key):
        return True
    return isinstance(_linears(source).get(module), torch.nn.Linear)


def _linears(source: ModelSource) -> dict:
    cached = getattr(source, "_linear_modules", None)
    if cached is None:
        cached = {n: m for n, m in source.fam.meta.named_modules() if isinstance(m, torch.nn.Linear)}
        source._linear_modules = cached
    return cached


def quantize_state(source: ModelSource, state: dict[str, torch.Tensor], scheme: Scheme,
                   ignore: list[str]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Quantise a checkpoint-layout state dict; returns (tensors to write, quantised modules)."""
    out, done = {}, []
    for key, tensor in state.items():
        if not quantizable(source, key, tuple(tensor.shape), ignore):
            out[key] = tensor.contiguous()
            continue
        check_shape(scheme, key, tuple(tensor.shape))
        module = key[: -len(".weight")]
        for part, value in quantize_weight(tensor, scheme).items():
            out[f"{module}.{part}"] = value.contiguous()
        done.append(module)
    return out, done


def quantize_checkpoint(src: str | Path, out: str | Path, scheme: Scheme, ignore: list[str],
                        progress=None, workers: int = 1, expert_groups: int = 1) -> dict:
    """Quantise `src` into `out` (compressed-tensors format).

    Args:
        src: checkpoint to quantise (Hugging Face or converted layout, unquantised).
        out: output directory (replaced atomically).
        scheme: the scheme.
        ignore: module names / `re:` patterns kept in their source precision.
        progress: optional callable(done, total) per written file.
        workers: > 1 (with Ray running): contiguous ranges of decoder layers quantised by
            that many Ray tasks at once, each reading only its layers (the files are the same).
        expert_groups: > 1: each layer's routed experts split into that many groups, each
            its own unit (file) read and quantised alone (moeflow.quant.groups; the first
            also holds the rest of the layer); `workers` x `expert_groups` Ray tasks.

    Returns:
        {"output_dir", "scheme", "quantized_modules", "files", "bytes", "seconds",
         "native_load"}. Raises UserError naming the tensor a scheme cannot take.
    """
    start = time.perf_counter()
    source = ModelSource(src)
    if source.scheme is not None:
        raise UserError(f"{src}: already quantised ({source.scheme.name}); quantise the "
                        f"unquantised checkpoint")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # None: everything outside the layers; a Part: one expert group of a layer
    units: list = [None]
    for i in range(source.num_layers):
        parts = layer_parts(source, i, expert_groups)
        units[-1:-1] = [i] if len(parts) == 1 else parts
    with staged_dir(out) as tmp:
        weight_map: dict[str, str] = {}
        modules: list[str] = []
        memory = []
        for part_map, part_modules, mem in _quantize_parts(source, tmp, units, scheme, ignore,
                                                           workers * expert_groups, progress):
            weight_map.update(part_map)
            modules += part_modules
            memory.append(mem)
        # every linear the model builds that holds no quantised weight is named in the
        # config's ignore list: compressed-tensors otherwise builds it quantised and
        # initialises its missing scales at random (NaN logits). That happens when the
        # checkpoint stores the module under another layout (a fused tensor transformers
        # splits at load, as Bailing-hybrid's attention): it stays in source precision
        quantised = set(modules)
        kept = [n for n in _linears(source) if n not in quantised and not ignored(n, ignore)]
        _write_metadata(source, tmp, weight_map, scheme, ignore + kept)
    return {"output_dir": str(out), "scheme": scheme.name, "quantized_modules": len(modules),
            "kept_by_layout": len(kept),
            "files": len(units), "bytes": sum(p.stat().st_size for p in out.glob("*.safetensors")),
            "seconds": round(time.perf_counter() - start, 3), "native_load": scheme.native,
            "memory": memory}


def _quantize_parts(source: ModelSource, tmp: Path, units: list, scheme: Scheme,
                    ignore: list[str], workers: int, progress):
    """(weight map, quantised modules) of each range of `units`: here, or on Ray tasks."""
    spans = layer_ranges(len(units), workers)
    if len(spans) == 1 or not _ray_running():
        return [quantize_units(source, tmp, units, scheme, ignore, progress)]
    # lazy: ray: heavy, loaded only when this runs
    import ray

    task = ray.remote(num_cpus=1)(quantize_units)
    return ray.get([task.remote(str(source.path), tmp, units[a:b], scheme, ignore) for a, b in spans])


def _ray_running() -> bool:
    # lazy: ray: heavy, loaded only when this runs
    import ray

    return ray.is_initialized()


def quantize_units(source: ModelSource | str, tmp: Path, units: list, scheme: Scheme,
                   ignore: list[str], progress=None) -> tuple[dict[str, str], list[str], dict]:
    """Quantise decoder layers `units` (None: everything outside the layers; a
    moeflow.quant.groups Part: one expert group of a layer) of `source`, one file each
    under `tmp`, one unit in memory at a time; (weight map, modules, this process's peak
    above its level before the first tensor was read)."""
    # lazy: safetensors: heavy, loaded only when this runs
    from safetensors.torch import save_file

    from moeflow.core.memmeter import PeakMemory

    source = source if isinstance(source, ModelSource) else ModelSource(source)
    meter = PeakMemory().start()
    weight_map, modules = {}, []
    for n, unit in enumerate(units):
        if isinstance(unit, tuple):
            fname = f"model-layer-{unit[0]:05d}-experts-{unit[1]:05d}-{unit[2]:05d}.safetensors"
            state = part_checkpoint_state(source, unit)
        else:
            fname = "model-outer.safetensors" if unit is None else f"model-layer-{unit:05d}.safetensors"
            state = checkpoint_layout(source, source.outer_state() if unit is None else source.layer_state(unit))
        tensors, done = quantize_state(source, state, scheme, ignore)
        del state
        save_file(tensors, str(tmp / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in tensors})
        modules += done
        del tensors
        if progress:
            progress(n + 1, len(units))
    return weight_map, modules, {"units": len(units), **meter.record()}


def _write_metadata(source: ModelSource, tmp: Path, weight_map: dict, scheme: Scheme,
                    ignore: list[str]) -> None:
    index = {"metadata": {"total_size": sum((tmp / f).stat().st_size for f in set(weight_map.values()))},
             "weight_map": dict(sorted(weight_map.items()))}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config = dict(source.config)
    config["quantization_config"] = quantization_config(scheme, ignore)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    for name in source.raw.aux_files:  # tokenizer, processor, generation config
        if name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy2(source.path / name, tmp / name)
