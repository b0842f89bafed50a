"""A LoRA adapter merged into a base kept in its release format (`convert.dtype: keep`).

    result = merge_kept(kept_dir, adapter_dir, out_dir)

The output is the release again, in its own format, with the adapter folded in:
- a weight stored in full precision (attention, dense MLP, shared experts: what
  MXFP4 / INT4 / FP8 releases leave unquantised) gets `W + dW`, in float32 where it was
  stored narrower (rounded back to bf16 it would move the logits off base + adapter);
- a routed-expert weight stored packed (MXFP4, or compressed-tensors INT4 / INT8 / NVFP4 /
  MXFP4 / FP8 per tensor, channel, group or block) that the adapter changes is dequantised,
  merged in float32 and requantised in its own format (moeflow.checkpoint.requant: the
  format's own quantiser, scales by compressed-tensors' `calculate_qparams`); the error
  against base+adapter is measured per tensor and checked against the format's bound
  (documented there);
- every other stored tensor (packed experts the adapter leaves alone, scales,
  norms, router, embeddings) is copied byte for byte; so is a stored weight whose share
  of the delta is exactly zero (requantising its decoded values need not give back the
  release's scales).
Where the release stores a fused model tensor as several tensors (Qwen3-MoE, DeepSeek,
Kimi-K2: one [out, in] weight per expert and projection), the delta of the model's tensor
is split back onto them by transformers' own reverse conversion
(`revert_weight_conversion`, what `save_pretrained` runs). An adapter that changes a
weight in a format `requant` cannot write is refused in one line, naming the tensor,
before anything is written.

The deltas are PEFT's own (`get_delta_weight` of each LoRA layer, built over the
family's meta model: rank, alpha, rsLoRA, per-module patterns as PEFT reads them);
the base is never loaded as a model. Work goes one output file (one decoder
layer) at a time and one tensor at a time inside it: memory is the largest tensor
group (a fused expert tensor decoded to float32) plus the adapter.

Resumable: files are written into `.<out>.partial/`; each finished file is
recorded in its `merge-progress.json` (with its manifest entries), so a run that
crashed starts again at the first unfinished file. The merged directory is
verified like convert's output (every tensor's checksum re-read against the
manifest) and by a logits check against base+adapter (moeflow.training.merge_check)
before it is renamed into place.

Bounds: the requantised merge must stay within its format's per-value bound everywhere
(`within_bound`, moeflow.checkpoint.requant: e.g. MXFP4 2 x the group's scale, INT4 1/15
and FP8 e4m3 1/16 of the group's amax); its RMS error relative to the merged weight and
the logits check's numbers are what the report and MLflow (`merge/*`) show.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import shutil
from pathlib import Path
from typing import Callable

import torch

from moeflow.checkpoint import digest, formats, fp8, requant
from moeflow.checkpoint.engine import block_size
from moeflow.checkpoint.families import load_family
from moeflow.checkpoint.keep import _copy, verify_kept
from moeflow.checkpoint.manifest import MANIFEST, read_manifest
from moeflow.checkpoint.parse import INDEX, read_checkpoint
from moeflow.checkpoint.plan import plan_conversion
from moeflow.checkpoint.st_io import DTYPES, TAGS, StreamWriter, read_rows, tensor_bytes
from moeflow.core.errors import UserError

PROGRESS = "merge-progress.json"


def adapter_deltas(fam, adapter_dir: Path) -> dict[str, Callable[[], torch.Tensor]]:
    """{model parameter name: () -> its float32 delta} of a PEFT adapter, by PEFT's own rule.

    The adapter's LoRA layers are built over a copy of the family's meta model (no base
    weights) and given the adapter's A/B tensors; each delta is computed when asked.
    """
    # lazy: peft, safetensors: heavy, loaded only when a merge runs
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora.layer import LoraLayer, ParamWrapper
    from safetensors.torch import load_file

    if not (adapter_dir / "adapter_config.json").is_file():
        raise UserError(f"not a PEFT adapter dir (no adapter_config.json): {adapter_dir}")
    cfg = LoraConfig.from_pretrained(str(adapter_dir))
    if getattr(cfg, "use_dora", False):
        raise UserError(f"{adapter_dir}: a DoRA adapter's merge needs the base weight's norms; "
                        "merge it into a dequantised base (convert dtype bf16)")
    weights_file = adapter_dir / "adapter_model.safetensors"
    if not weights_file.is_file():
        raise UserError(f"{adapter_dir}: no adapter_model.safetensors (safetensors adapters only)")
    state = load_file(str(weights_file))
    model = get_peft_model(copy.deepcopy(fam.meta), cfg, low_cpu_mem_usage=True)
    out: dict[str, Callable[[], torch.Tensor]] = {}
    for path, module in model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        for part in ("lora_A", "lora_B"):
            key = f"{path}.{part}.weight"
            if key not in state:
                raise UserError(f"{weights_file}: tensor {key} missing (the adapter does not "
                                f"match {fam.architecture})")
            getattr(module, part)["default"].weight = torch.nn.Parameter(
                state.pop(key).float(), requires_grad=False)
        owner = path.removeprefix("base_model.model.").replace(".base_layer", "")
        if isinstance(module, ParamWrapper):
            # PEFT moves the delta onto the parameter's device, here `meta` (the base is not
            # loaded): a float32 CPU stand-in keeps it where the factors are
            module.get_param = lambda: torch.empty((), dtype=torch.float32)  # type: ignore[method-assign]
            out[f"{owner}.{module.parameter_name}"] = functools.partial(_delta, module)
        else:
            out[f"{owner}.weight"] = functools.partial(_delta, module)
    left = [k for k in state if "lora_" in k]
    if left:
        raise UserError(f"{weights_file}: tensor {left[0]} has no LoRA layer in {fam.architecture}")
    return out


def _delta(module) -> torch.Tensor:
    return module.get_delta_weight("default").float()


def merge_targets(base_dir: Path, deltas: dict, fam=None) -> dict[str, dict]:
    """{model tensor group: {"params", "targets", "conv", "sources": {stored logical name:
    info}, "scales": {stored weight: its FP8 `weight_scale_inv`}}} of every group of tensors
    the adapter changes, or one line naming the first weight that cannot be merged in the
    release's format."""
    raw = read_checkpoint(base_dir)
    fam = fam or load_family(raw.config, str(base_dir / "config.json"))
    logical = formats.logical_view(raw, fam)
    plan = plan_conversion(logical, fam, "fp32")
    by_target = {t: g for g in plan["groups"] for t in g["targets"]}
    out: dict[str, dict] = {}
    for param in sorted(deltas):
        group = by_target.get(param)
        if group is None:
            raise UserError(f"{base_dir}: the adapter changes {param}, which the checkpoint "
                            "does not hold")
        entry = out.setdefault(group["first"], {
            "params": [], "targets": group["targets"], "conv": group["conv"] is not None,
            "sources": {k: logical.tensors[k] for ks in group["sources"].values() for k in ks},
            "scales": {k: logical.tensors[v] for k, v in group["scales"].items()}})
        entry["params"].append(param)
    for entry in out.values():
        keys = list(entry["sources"])
        if entry["conv"]:
            got = _split(fam, {t: torch.empty(s, device="meta") for t, s in entry["targets"].items()})
            shapes = {k: tuple(v.shape) for k, v in got.items()}
            if shapes != {k: tuple(entry["sources"][k].shape) for k in keys}:
                raise UserError(f"{base_dir}: {entry['params'][0]} is stored as {', '.join(keys[:3])}"
                                f"{' ...' if len(keys) > 3 else ''}, which transformers' reverse "
                                "conversion does not give back; merge into the dequantised base "
                                "(convert dtype bf16)")
        elif tuple(entry["sources"][keys[0]].shape) != tuple(entry["targets"][entry["params"][0]]):
            raise UserError(f"{base_dir}: {entry['params'][0]} is stored as {keys[0]} in another "
                            "shape; merge into the dequantised base (convert dtype bf16)")
        for key, info in entry["sources"].items():
            why = requant.unsupported(info) if isinstance(info, formats.Packed) else None
            if why:
                raise UserError(f"{base_dir}: the adapter changes {key}, stored {info.format}: "
                                f"cannot requantise {why} (merging requantises "
                                f"{requant.supported_formats()}): leave that module out of "
                                "lora.target_modules, or merge into the dequantised base "
                                "(convert dtype bf16)")
    return out


def _split(fam, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Model tensors -> the release's stored tensors, by transformers' reverse conversion."""
    # lazy: transformers: heavy, loaded only when a merge runs
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(fam.meta, tensors)


def refuse_unmergeable(release_dir: str | Path, modules: list[str], parameters: list[str],
                       key: str) -> None:
    """Before training: refuse, in one line naming `key`, LoRA targets whose weights the
    release stores in a packed format this merge cannot requantise (moeflow.checkpoint.requant).

    Args:
        modules, parameters: resolved LoRA targets (full module names, parameter suffixes).
    """
    raw = read_checkpoint(release_dir)
    fam = load_family(raw.config, str(Path(release_dir) / "config.json"))
    logical = formats.logical_view(raw, fam)
    for group in plan_conversion(logical, fam, "fp32")["groups"]:
        hit = [t for t in group["targets"] if t.removesuffix(".weight") in modules
               or any(t == p or t.endswith("." + p) for p in parameters)]
        for stored in (k for ks in group["sources"].values() for k in ks) if hit else ():
            info = logical.tensors[stored]
            why = requant.unsupported(info) if isinstance(info, formats.Packed) else None
            if why:
                raise UserError(f"{key}: LoRA target {hit[0].removesuffix('.weight')} is stored "
                                f"{info.format} in {release_dir} (as {stored}) and a merge into the kept "
                                f"release cannot requantise {why}: leave it out of "
                                f"lora.target_modules, set {key} false and serve the adapter, or "
                                "convert with dtype bf16")


def merge_kept(base_dir: str | Path, adapter_dir: str | Path, out: str | Path, *,
               check_logits: bool = True, streamed: bool | None = None, progress=None) -> dict:
    """Merge a PEFT adapter into a kept base, writing `out` in the base's own format.

    Args:
        check_logits: run merge_check's logits check (else checksums and bounds only).
        streamed: run that check layer by layer (None: when the model exceeds the host).

    Returns:
        {"output_dir", "merged" (stored weights changed), "copied_files", "requantized":
         {name: {"rel_rms", "max_abs", "max_over_bound", "within_bound", "bound"}},
         "verification",
         "logits": merge_check's record, "manifest_sha256"}
    """
    base_dir, adapter_dir, out = Path(base_dir), Path(adapter_dir), Path(out)
    manifest = read_manifest(base_dir)
    if manifest.get("dtype") not in ("keep", "fp8"):
        raise UserError(f"{base_dir}: not a kept release (manifest dtype "
                        f"{manifest.get('dtype')!r}); merge it with finetune.merge's plain path")
    fam = load_family(json.loads((base_dir / "config.json").read_text()), str(base_dir / "config.json"))
    deltas = adapter_deltas(fam, adapter_dir)
    targets = merge_targets(base_dir, deltas, fam)
    stage = out.parent / f".{out.name}.partial"
    key = _identity(base_dir, adapter_dir)
    done = _progress(stage, key)
    stage.mkdir(parents=True, exist_ok=True)
    files: dict[str, list[str]] = {}
    for name, entry in manifest["tensors"].items():
        files.setdefault(entry["file"], []).append(name)
    stored = {k: _stored_names(info, t["scales"].get(k)) for t in targets.values()
              for k, info in t["sources"].items()}
    raw = read_checkpoint(base_dir)  # headers only: where each stored tensor lives
    for file in sorted(files):
        if file in done["files"]:
            continue
        here = set(files[file])
        touched = [t for t in targets.values() if any(stored[k] & here for k in t["sources"])]
        if not touched:  # nothing the adapter changes: the release's file, byte for byte
            shutil.copy2(base_dir / file, stage / file)
            done["files"][file] = {}
        else:
            done["files"][file], stats = _merge_file(raw, stage, file, files[file], manifest,
                                                     touched, deltas, fam)
            done["requantized"].update(stats)
        _save_progress(stage, done)
        if progress:
            progress(f"merged {file}" if touched else f"copied {file}")
    return _finish(base_dir, adapter_dir, stage, out, manifest, done, check_logits, streamed, deltas)


def _identity(base_dir: Path, adapter_dir: Path) -> str:
    """What a resumed merge must match: the base's manifest and the adapter's bytes."""
    h = hashlib.sha256((base_dir / MANIFEST).read_bytes())
    for f in sorted(adapter_dir.iterdir()):
        if f.is_file():
            h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()


def _progress(stage: Path, key: str) -> dict:
    """The finished files of an earlier attempt at this same merge (else a fresh record)."""
    try:
        got = json.loads((stage / PROGRESS).read_text())
    except (OSError, ValueError):
        got = None
    if not got or got.get("identity") != key:
        shutil.rmtree(stage, ignore_errors=True)  # another base or adapter: start over
        return {"identity": key, "files": {}, "requantized": {}}
    return got


def _save_progress(stage: Path, done: dict) -> None:
    tmp = stage / (PROGRESS + ".tmp")
    tmp.write_text(json.dumps(done))
    tmp.replace(stage / PROGRESS)


def _stored_names(info, scale=None) -> set[str]:
    """The stored tensors a logical tensor is read from (its parts, or itself and its scale)."""
    if isinstance(info, formats.Packed):
        return {p.name for _, p in info.parts}
    return {info.name} | ({scale.name} if scale is not None else set())


def _source_deltas(target: dict, deltas: dict, fam) -> dict[str, torch.Tensor]:
    """{stored logical name: its float32 delta} of one tensor group the adapter changes."""
    if not target["conv"]:
        (key,) = target["sources"]
        return {key: deltas[target["params"][0]]()}
    full = {t: deltas[t]() if t in deltas else torch.zeros(shape)
            for t, shape in target["targets"].items()}
    return {k: v.float() for k, v in _split(fam, full).items()}


def _merge_file(raw, stage: Path, file: str, names: list[str], manifest: dict,
                touched: list[dict], deltas: dict, fam) -> tuple[dict, dict]:
    """Write one output file: changed weights merged, the rest copied. Returns (manifest
    entries of the tensors rewritten, requantisation stats)."""
    algorithm = manifest["checksum"]
    block = block_size(raw.config)
    here = set(names)
    new: dict[str, torch.Tensor] = {}
    kind: dict[str, str] = {}
    stats = {}
    for target in touched:
        for key, delta in _source_deltas(target, deltas, fam).items():
            info, scale = target["sources"][key], target["scales"].get(key)
            if not _stored_names(info, scale) <= here or not bool(delta.any()):
                continue  # another file's, or unchanged: its bytes are copied
            if scale is not None:  # FP8 blocks with `weight_scale_inv` (DeepSeek's layout)
                assert block is not None  # a weight_scale_inv tensor comes with its config's block size
                parts, stats[key] = requant.fp8_blocks(key, scale.name, _fp8_read(info, scale, block)
                                                       + delta, block)
                new.update(parts)
                kind.update(dict.fromkeys(parts, "requantized"))
            elif isinstance(info, formats.Packed):
                parts, stats[key] = requant.requantize(info, formats.read(info) + delta)
                new.update(parts)
                kind.update(dict.fromkeys(parts, "requantized"))
            else:
                w = read_rows(raw.tensors[key])
                merged = w.float() + delta
                # a weight stored narrower than float32 is written float32: W + dW rounded back
                # to bf16 moves the logits by ~3e-3 of their scale (demo base), a float32 copy
                # of these few tensors keeps base + adapter's (docs/release-formats.md)
                new[key] = merged if w.element_size() < 4 else merged.to(w.dtype)
                kind[key] = "merged"
    writer = StreamWriter(stage / file, [(n, new[n].dtype if n in new else DTYPES[raw.tensors[n].dtype],
                                          tuple(raw.tensors[n].shape)) for n in names])
    entries = {}
    try:
        for n in names:
            if n in new:
                writer.write(n, 0, new[n])
                entries[n] = dict(manifest["tensors"][n], **{
                    algorithm: _digest(new[n], algorithm), "dtype": TAGS[new[n].dtype],
                    "merged": kind[n]})
            else:
                _copy(raw.tensors[n], writer, file, algorithm, None)
        writer.close()
    except BaseException:
        writer.abort()
        raise
    return entries, stats


def _fp8_read(info, scale, block) -> torch.Tensor:
    """An FP8 block-scaled weight ([*lead, R, C] e4m3 + its scale grid) in float32."""
    return fp8.dequantize(read_rows(info), read_rows(scale), block, torch.float32)


def _digest(t: torch.Tensor, algorithm: str) -> str:
    h = digest.hasher(algorithm)
    h.update(tensor_bytes(t))
    return h.hexdigest()


def _finish(base_dir: Path, adapter_dir: Path, stage: Path, out: Path, manifest: dict, done: dict,
            check_logits: bool, streamed: bool | None, deltas: dict) -> dict:
    """Index, config, side files, manifest; verify checksums and logits; rename into place."""
    # lazy: the logits check loads models (torch, transformers, PEFT)
    from moeflow.training.merge_check import logits_check

    for name in [INDEX, "config.json", *manifest.get("aux_files", [])]:
        if (base_dir / name).is_file():
            shutil.copy2(base_dir / name, stage / name)
    merged = dict(manifest)
    merged["tensors"] = {**manifest["tensors"], **{k: v for e in done["files"].values()
                                                    for k, v in e.items()}}
    changed = sorted(k for e in done["files"].values() for k in e)
    merged["merged_adapter"] = {"adapter_dir": str(adapter_dir), "identity": done["identity"],
                                "tensors": changed, "requantized": done["requantized"]}
    (stage / MANIFEST).write_text(json.dumps(merged, indent=1, sort_keys=True))
    report = verify_kept(stage, merged)
    if not report["passed"]:
        raise UserError(f"{out}: merged checkpoint verification failed: {report['failures'][0]}")
    bad = [k for k, s in done["requantized"].items() if not s["within_bound"]]
    if bad:
        raise UserError(f"{out}: requantised {bad[0]} moved a value by "
                        f"{done['requantized'][bad[0]]['max_over_bound']:.2f} x the bound its "
                        f"format allows ({done['requantized'][bad[0]]['bound']})")
    logits = logits_check(base_dir, adapter_dir, stage, requantized=bool(done["requantized"]),
                          deltas=deltas, streamed=streamed) if check_logits else {"skipped": "check_logits false"}
    report["functional"] = logits
    (stage / "verification.json").write_text(json.dumps(report, indent=2))
    (stage / PROGRESS).unlink(missing_ok=True)
    shutil.rmtree(out, ignore_errors=True)  # an earlier merge into the same place
    stage.rename(out)
    return {"output_dir": str(out), "merged": changed, "requantized": done["requantized"],
            "copied_files": sorted(f for f, e in done["files"].items() if not e),
            "verification": {"passed": True, "tensors": len(merged["tensors"])}, "logits": logits,
            "manifest_sha256": hashlib.sha256((out / MANIFEST).read_bytes()).hexdigest()}


def merge_metrics(merged_dir: str | Path) -> dict[str, float]:
    """MLflow metrics of a merged kept release: its logits check and requantisation errors."""
    merged_dir = Path(merged_dir)
    logits = json.loads((merged_dir / "verification.json").read_text()).get("functional") or {}
    requant = (read_manifest(merged_dir).get("merged_adapter") or {}).get("requantized") or {}
    out = {f"merge/logits_{k}": float(v) for k, v in logits.items()
           if k in ("max_abs_err", "cosine", "kl_mean")}
    if requant:
        out["merge/requant_rel_rms_max"] = max(s["rel_rms"] for s in requant.values())
        out["merge/requant_max_abs"] = max(s["max_abs"] for s in requant.values())
        out["merge/requant_max_over_bound"] = max(s["max_over_bound"] for s in requant.values())
        out["merge/requantized_tensors"] = float(len(requant))
    return out
