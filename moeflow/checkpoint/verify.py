"""Verify a converted checkpoint, tensor by tensor and functionally.

Tensor level: every output tensor is recomputed from its source tensors by
the transform the manifest declares (same plan group, same transformers
converter, streamed step by step) and compared bit-exactly with the bytes in
the output file; its checksum (the manifest's algorithm, digest.py) is
recomputed and compared with the manifest. The
error introduced by the precision change is measured against the same
transform computed in float32 (0 for a bit-preserving conversion; bounded by
one rounding for casts and FP8 dequantisation).

Functional: the converted directory loads with `from_pretrained` with no
missing, unexpected or mismatched keys, and its logits on fixed inputs equal
the source model's (for models small enough to load here; otherwise the
report says it was skipped and why).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

from moeflow.checkpoint import digest, fp8
from moeflow.checkpoint.engine import Loader, block_size, run_step
from moeflow.checkpoint.families import load_family
from moeflow.checkpoint.formats import logical_view, reference_dequantized
from moeflow.checkpoint.layercheck import layer_dtype, per_layer_check
from moeflow.checkpoint.manifest import read_manifest
from moeflow.checkpoint.parse import read_checkpoint
from moeflow.checkpoint.plan import ROW_BUDGET, SCALE_SUFFIX, steps
from moeflow.checkpoint.st_io import DTYPES, read_header, read_rows, release_heap, single_thread, tensor_bytes
from moeflow.core.errors import UserError
from moeflow.core.memmeter import PeakMemory
from moeflow.core.storage import cache_root, scratch_root
from moeflow.model.anatomy import source_config
from moeflow.model.remote_code import activate_task, model_class

# Relative error bound of one rounding to the output dtype (half an ulp).
ROUNDING = {"BF16": 2.0 ** -8, "F16": 2.0 ** -11, "F32": 2.0 ** -24}
# Source bytes (as float32) per verification step: a quarter of convert's (plan.ROW_BUDGET),
# since a step holds the output slice twice (as written and in float32), the stored bytes,
# and float32 differences of them
VERIFY_STEP = ROW_BUDGET // 4
# Whole-model logits only when both models fit comfortably in this process.
FUNCTIONAL_MAX_BYTES = 4 << 30


def verify_file(task: dict, out_dir: str) -> dict:
    """Recompute and compare every tensor of one output file.

    Returns:
        {name: {"equal", "max_abs_err", "bound", "digest"}}.
    """

    return verify_file_metered(task, out_dir)[0]


def verify_file_metered(task: dict, out_dir: str) -> tuple[dict, int | None]:
    """`verify_file`, and its peak bytes above the level before its first tensor
    (moeflow.core.memmeter; the file runs alone in its process)."""
    with single_thread():
        activate_task(task)
        fam = load_family(task["config"])
        meter = PeakMemory().start()  # after the imports: before the first tensor
        loader = Loader(task["sources"], block_size(task["config"]))
        try:
            return _compare_file(task, out_dir, fam, loader), meter.peak()
        finally:
            loader.close()  # its file descriptors, now, not at garbage collection


def _compare_file(task: dict, out_dir: str, fam, loader) -> dict:
    header, _ = read_header(Path(out_dir) / task["file"])
    shapes = {k: v.shape for k, v in task["sources"].items()}
    out: dict[str, dict] = {}
    for group in task["groups"]:
        # the same transform in float32: the reference for the precision change
        exact = dict(group, dtype="F32") if group["dtype"] in ("BF16", "F16") else None
        hashers = {n: digest.hasher(task["checksum"]) for n in group["targets"]}
        stats: dict[str, dict[str, Any]] = {n: {"equal": True, "max_abs_err": 0.0, "bound": 0.0}
                                            for n in group["targets"]}
        for selection, row0 in steps(group, shapes, VERIFY_STEP):
            got = run_step(fam, group, loader, selection)
            ref = run_step(fam, exact, loader, selection) if exact else got
            for name, t in got.items():
                info = header[name]
                stored = read_rows(info, row0, row0 + t.shape[0]) if t.dim() else read_rows(info)
                hashers[name].update(tensor_bytes(stored))
                st = stats[name]
                st["equal"] &= bytes(tensor_bytes(stored)) == bytes(tensor_bytes(t))
                if t.is_floating_point() and t.numel():
                    # non-finite values (allowed with --allow-nonfinite) are compared as bytes
                    diff = (stored.float() - ref[name].float()).nan_to_num(0.0, 0.0, 0.0).abs().max().item()
                    st["max_abs_err"] = max(st["max_abs_err"], diff)
                    scale = ref[name].float().nan_to_num(0.0, 0.0, 0.0).abs().max().item()
                    st["bound"] = max(st["bound"], scale * ROUNDING.get(group["dtype"], 0.0))
            del got, ref
            release_heap()  # the step's slices: freed pages back to the kernel
        for name in group["targets"]:
            stats[name]["digest"] = hashers[name].hexdigest()
            out[name] = stats[name]
    return out


def verify_converted(out_dir: str | Path, src_dir: str | Path, *, workers: int | None = None,
                     functional: bool = True, per_layer: bool | None = None,
                     progress: Callable[[str], None] | None = None,
                     memory_budget: float | None = None) -> dict:
    """Tensor-by-tensor and functional verification of a converted directory.

    Args:
        out_dir: converted directory (with manifest.json).
        src_dir: the source checkpoint it was converted from.
        workers: parallel file checks (Ray, when it is up).
        functional: also load with from_pretrained and compare logits.
        per_layer: force (True) or forbid (False) the per-layer functional check;
            None: per layer only when the model is too large to load here.

    Returns:
        The report: {"passed", "failures", "tensors", "mismatches", "kinds":
        {kind: {"tensors", "mismatches", "max_abs_err"}}, "functional": {...},
        "memory": {"verify": [peak bytes per file task], "functional": peak bytes}}.
    """

    out_dir, src_dir = Path(out_dir), Path(src_dir)
    manifest = read_manifest(out_dir)

    raw = read_checkpoint(src_dir)
    ckpt = logical_view(raw, load_family(raw.config, str(src_dir / "config.json")))
    tasks = _tasks(manifest, ckpt)
    results, peaks = _run(tasks, out_dir, workers)
    report = _summarize(manifest, results)
    report["memory"] = {"verify": peaks}
    if progress:
        progress(f"verified {report['tensors']} tensors: {report['mismatches']} mismatches")
    if functional:
        report["functional"] = functional_check(src_dir, out_dir, manifest, per_layer, memory_budget)
        fn = report["functional"]
        report["memory"]["functional"] = fn.pop("peak_bytes", None)
        layers = fn.get("per_layer")
        if layers and not layers["within_tolerance"]:
            report["failures"].append(f"decoder layer {layers['worst_layer']} output differs from the "
                                      f"source layer by {layers['max_abs_diff']:.3g}")
        if fn.get("missing") or fn.get("unexpected") or fn.get("mismatched"):
            report["failures"].append(f"from_pretrained: missing {fn['missing'][:3]}, unexpected "
                                      f"{fn['unexpected'][:3]}, mismatched {fn['mismatched'][:3]}")
        if fn.get("logits_equal") is False and not fn.get("within_tolerance"):
            report["failures"].append(f"logits differ from the source model by "
                                      f"{fn['logits_max_abs_diff']:.3g}")
    report["passed"] = not report["failures"]
    return report


def _tasks(manifest: dict, ckpt) -> list[dict]:
    tasks: dict[str, dict] = {}
    algorithm = digest.manifest_algorithm(manifest)
    for group in manifest["groups"]:
        task = tasks.setdefault(group["file"], {"file": group["file"], "groups": [], "sources": {},
                                                "config": ckpt.config, "checksum": algorithm})
        task["groups"].append(group)
        for key in [k for ks in group["sources"].values() for k in ks] + list(group["scales"].values()):
            if key not in ckpt.tensors:
                raise UserError(f"{ckpt.path}: source tensor {key} named in the manifest is gone")
            task["sources"][key] = ckpt.tensors[key]
    if manifest.get("remote_code"):  # workers load the source's code held to convert's record
        for task in tasks.values():
            task["remote_code"] = manifest["remote_code"]
    return list(tasks.values())


def _run(tasks: list[dict], out_dir: Path, workers: int | None) -> tuple[dict[str, dict], list[int | None]]:
    """Every file's comparison ({name: stats}) and each file task's peak bytes."""
    # Ray is only used when a runtime is already up; importing it just to ask
    # costs a second or more per conversion.
    ray = sys.modules.get("ray")
    results: dict[str, dict] = {}
    if ray is not None and ray.is_initialized() and (workers or 2) > 1 and len(tasks) > 1:
        remote = ray.remote(num_cpus=1, **here_if_node_local(ray, out_dir, *_files(tasks)))(verify_file_metered)
        parts = ray.get([remote.remote(t, str(out_dir)) for t in tasks])
    else:
        parts = [verify_file_metered(task, str(out_dir)) for task in tasks]
    for part, _ in parts:
        results.update(part)
    return results, [peak for _, peak in parts]


def _files(tasks: list[dict]) -> list[str]:
    return sorted({info.file for task in tasks for info in task["sources"].values()})


def here_if_node_local(ray, *paths: str | Path) -> dict:
    """Ray options pinning tasks to this node when one of `paths` is node-local: in this
    node's scratch (workdir in object storage: a stage's out dir) or its cache (a store
    checkpoint's sparse copy, moeflow.core.storage.ranged), which no other node can read."""
    roots = [scratch_root().resolve(), cache_root().resolve()]
    if not any(Path(p).resolve().is_relative_to(r) for p in paths for r in roots):
        return {}
    # lazy: ray: heavy, loaded only when this runs
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(
        ray.get_runtime_context().get_node_id(), soft=False)}


def _summarize(manifest: dict, results: dict[str, dict]) -> dict:
    kinds: dict[str, dict] = {}
    failures: list[str] = []
    algorithm = digest.manifest_algorithm(manifest)
    for name, entry in manifest["tensors"].items():
        res = results.get(name)
        row = kinds.setdefault(entry["kind"], {"tensors": 0, "mismatches": 0, "max_abs_err": 0.0})
        row["tensors"] += 1
        recorded = digest.entry_digest(entry, algorithm)
        ok = res is not None and res["equal"] and res["digest"] == recorded \
            and res["max_abs_err"] <= res["bound"]
        if not ok:
            row["mismatches"] += 1
            why = ("not recomputed" if res is None else "bytes differ" if not res["equal"]
                   else f"{algorithm} differs from manifest" if res["digest"] != recorded
                   else f"error {res['max_abs_err']:.3g} above bound {res['bound']:.3g}")
            failures.append(f"tensor {name} in {entry['file']}: {why}")
        if res is not None:
            row["max_abs_err"] = max(row["max_abs_err"], res["max_abs_err"])
    return {"tensors": len(manifest["tensors"]), "mismatches": sum(r["mismatches"] for r in kinds.values()),
            "kinds": dict(sorted(kinds.items())), "failures": failures}


def text_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """Logits of a text-only forward. Llama4ForConditionalGeneration.forward fails
    in transformers 5.24 (docs/facts.md), so its text tower is called directly."""
    if type(model).__name__ == "Llama4ForConditionalGeneration":
        return model.language_model(input_ids=ids).logits
    return model(input_ids=ids).logits


def functional_check(src_dir: Path, out_dir: Path, manifest: dict, per_layer: bool | None = None,
                     memory_budget: float | None = None) -> dict:
    """Load the converted model with from_pretrained and compare logits to the source,
    or, for a model too large here (or per_layer=True), compare each decoder layer
    built from the source and from the output (moeflow.checkpoint.layercheck).

    memory_budget: bytes this check may hold (None: FUNCTIONAL_MAX_BYTES for the
    whole-model logits); the whole-model check holds both models in float32 (about
    4x a bf16 checkpoint's bytes), the per-layer one a layer (layercheck.layer_dtype).

    Returns:
        {"missing", "unexpected", "mismatched", "logits_equal", "logits_max_abs_diff",
         "skipped"} (skipped: why the logits comparison did not run).
    """

    limit = FUNCTIONAL_MAX_BYTES if memory_budget is None else min(FUNCTIONAL_MAX_BYTES, memory_budget)
    if per_layer is None:
        per_layer = manifest["total_bytes"] * 4 > limit
    if per_layer:
        dtype = layer_dtype(manifest, memory_budget)
        meter = PeakMemory().start()
        # a layer over the budget in float32: its source side built step by step too
        layers = per_layer_check(src_dir, out_dir, manifest, dtype=dtype, streamed=dtype != torch.float32)
        why = f"model of {manifest['total_bytes'] / 1e9:.1f} GB"
        if memory_budget is not None:
            why += f" on a budget of {memory_budget / 1e9:.2f} GB"
        return {"missing": [], "unexpected": [], "mismatched": [], "logits_equal": None,
                "skipped": f"{why}: checked layer by layer instead of whole-model logits",
                "per_layer": layers, "peak_bytes": meter.peak()}

    cls = model_class(manifest["architecture"])  # transformers' own, or a checked remote-code class
    dtype = torch.float32
    meter = PeakMemory().start()
    kept_fp8 = manifest.get("dtype") == "fp8"
    with torch.no_grad():
        if kept_fp8:
            converted, result = load_fp8_dequantized(cls, out_dir)
        else:
            converted, info = cls.from_pretrained(str(out_dir), dtype=dtype, output_loading_info=True)
            result = {"missing": sorted(info["missing_keys"]), "unexpected": sorted(info["unexpected_keys"]),
                      "mismatched": sorted(str(m) for m in info["mismatched_keys"])}
        cfg = converted.config.get_text_config()
        ids = (torch.arange(16).reshape(1, 16) * 7 + 3) % cfg.vocab_size  # [1, 16]
        out_logits = text_logits(converted.eval(), ids)  # [1, 16, V]
        del converted

        extra = {"config": source_config(src_dir)} if source_config(src_dir) is not None else {}
        source = _reference_model(cls, src_dir, dtype, extra)
        narrowed = narrowed_tensors(manifest)
        if manifest["dequantized"] or narrowed:
            # compare like with like: the source holds the values the cast wrote
            _round_like(source, manifest)
        src_logits = text_logits(source, ids)  # [1, 16, V]
    # NaN-aware: a checkpoint converted with --allow-nonfinite may carry NaN through
    diff = (out_logits - src_logits).nan_to_num(0.0).abs().max().item()
    equal = bool(torch.allclose(out_logits, src_logits, rtol=0, atol=0, equal_nan=True))
    # Bit-preserving conversions must match exactly; after a precision change
    # (FP8 dequantised by transformers vs by us, then rounded) allow 1% of the
    # largest logit.
    scale = src_logits.nan_to_num(0.0).abs().max().item()
    result.update(logits_equal=equal, logits_max_abs_diff=diff, skipped=None,
                  source_rounded_to_output=bool(manifest["dequantized"] or narrowed),
                  within_tolerance=equal or ((manifest["dequantized"] or kept_fp8) and diff <= 1e-2 * scale),
                  peak_bytes=meter.peak())
    return result


def load_fp8_dequantized(cls, out_dir: Path):
    """Build a converted FP8 checkpoint as a float32 model, dequantising each
    kept e4m3 weight with its (fused) `_scale_inv` by our fp8.py.

    Why not from_pretrained: on a host without GPU transformers 5.24 switches
    FP8 checkpoints to dequantize-on-load, which only pairs `.weight` with
    `.weight_scale_inv`; fused expert tensors (`experts.gate_up_proj` +
    `experts.gate_up_proj_scale_inv`) are then loaded as raw e4m3 values and
    their scales reported unexpected. On GPU, FP8Experts holds them natively.

    Returns:
        (model in eval mode, {"missing", "unexpected", "mismatched", "loader"}).
    """
    # lazy: transformers: heavy, loaded only when this runs; its name means something else at module level
    import transformers

    from moeflow.checkpoint.engine import block_size

    cfg = transformers.AutoConfig.from_pretrained(str(out_dir))
    block = block_size(cfg.to_dict())
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    model = cls._from_config(cfg, dtype=torch.float32).eval()
    infos = {}
    for path in sorted(Path(out_dir).glob("*.safetensors")):
        infos.update(read_header(path)[0])
    state = {}
    for name, info in infos.items():
        if name.endswith(SCALE_SUFFIX) and name[: -len(SCALE_SUFFIX)] in infos:
            continue
        t = read_rows(info)
        scale = infos.get(name + SCALE_SUFFIX)
        if scale is not None:
            if block is None:
                raise UserError(f"{out_dir}: tensor {name} has a scale but config.json has no "
                                "quantization_config.weight_block_size")
            s = read_rows(scale)
            t = torch.stack([fp8.dequantize(w, si, block, torch.float32) for w, si in zip(t, s)]) \
                if t.dim() == 3 else fp8.dequantize(t, s, block, torch.float32)  # [E, R, C] / [R, C]
        state[name] = t.float() if t.is_floating_point() else t
    own = model.state_dict()
    mismatched = sorted(f"{n}: {list(t.shape)} vs {list(own[n].shape)}" for n, t in state.items()
                        if n in own and tuple(t.shape) != tuple(own[n].shape))
    if mismatched:
        return model, {"missing": [], "unexpected": [], "mismatched": mismatched, "loader": "moeflow-fp8"}
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})
    return model, {"missing": sorted(set(missing) - tied), "unexpected": sorted(unexpected),
                   "mismatched": [], "loader": "moeflow-fp8 (dequantised, float32)",
            "note": "transformers 5.24 on CPU dequantises on load but leaves fused expert scales unused"}


def narrowed_tensors(manifest: dict) -> list[str]:
    """Output tensors written in a narrower float dtype than their source
    (a float32 checkpoint converted to bf16): their values changed by one
    rounding, which the verification must apply to the source too."""

    src = manifest.get("source_tensors", {})
    out = []
    for name, entry in manifest["tensors"].items():
        widths = [DTYPES[src[k]["dtype"]].itemsize for k in entry.get("sources", []) if k in src]
        if widths and DTYPES[entry["dtype"]].is_floating_point and DTYPES[entry["dtype"]].itemsize < max(widths):
            out.append(name)
    return out


def _round_like(model, manifest: dict) -> None:
    """Round the float32 source weights (dequantised by transformers) to the dtype
    the conversion wrote, so both models hold the same values if, and only if,
    our dequantisation equals transformers'."""

    for name, param in model.state_dict().items():
        entry = manifest["tensors"].get(name)
        if entry and param.is_floating_point():
            param.copy_(param.to(DTYPES[entry["dtype"]]).to(param.dtype))


def _reference_model(cls, src_dir: Path, dtype, extra: dict):
    """The source model as the format's reference implementation dequantises it:
    transformers' own loader (FP8 blocks, MXFP4), or, for compressed-tensors (which
    transformers 5.24 cannot load on fused experts, nor NVFP4 on CPU),
    compressed-tensors' own model-free dequantiser, then transformers' loader."""

    qc = json.loads((Path(src_dir) / "config.json").read_text()).get("quantization_config") or {}
    if qc.get("quant_method") == "mxfp4" and cls.__module__.startswith("moeflow_remote_code_"):
        # a checkpoint's own architecture: transformers' MXFP4 loader maps GPT-OSS modules only
        from moeflow.checkpoint.mxfp4_files import dequantized_copy

        with tempfile.TemporaryDirectory(prefix=".reference-", dir=Path(src_dir).parent) as tmp:
            return cls.from_pretrained(str(dequantized_copy(src_dir, tmp)), dtype=dtype).eval()
    if qc.get("quant_method") != "compressed-tensors":
        return cls.from_pretrained(str(src_dir), dtype=dtype, **_dequantizing(src_dir), **extra).eval()

    with tempfile.TemporaryDirectory(prefix=".reference-", dir=Path(src_dir).parent) as tmp:
        reference_dequantized(Path(src_dir), Path(tmp))
        extra = {k: v for k, v in extra.items() if k != "config"}
        return cls.from_pretrained(tmp, dtype=dtype, **extra).eval()


def _dequantizing(src_dir: Path) -> dict:
    """from_pretrained kwargs that make transformers dequantise an FP8 source on load
    (its own reference implementation, which runs on CPU)."""

    qc = json.loads((Path(src_dir) / "config.json").read_text()).get("quantization_config")
    if not qc:
        return {}
    # lazy: transformers: heavy, loaded only when this runs
    from transformers.quantizers.auto import AutoQuantizationConfig

    config = AutoQuantizationConfig.from_dict(dict(qc))
    config.dequantize = True
    return {"quantization_config": config}
