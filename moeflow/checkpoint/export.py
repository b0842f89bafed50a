"""Export a converted checkpoint back to the family's original Hugging Face layout.

    .venv/bin/moeflow export CONVERTED --to hf OUT

Writes the source's tensor names, shapes and shard files again (what serving
engines such as vLLM read), using transformers' own reverse conversion
(`WeightConverter.reverse_transform`) step by step: one expert slice or row
range in memory at a time. A BF16 source converted with the default dtype and
exported is bit-identical to the source, tensor by tensor. FP8 block-scaled
sources come back dequantised (no scales, no quantization_config).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Callable

import torch

from moeflow.checkpoint import digest
from moeflow.checkpoint.families import load_family
from moeflow.checkpoint.manifest import MANIFEST, read_manifest
from moeflow.checkpoint.parse import INDEX
from moeflow.checkpoint.plan import steps
from moeflow.checkpoint.st_io import DTYPES, StreamWriter, read_header, read_rows
from moeflow.core.errors import UserError


class _SourceShapes:
    """Model stand-in for reverse ops that check shapes: the source tensor's shape."""

    def __init__(self, shape: tuple, rows: int | None):
        self.shape = (rows, *shape[1:]) if rows is not None and shape else tuple(shape)

    def get_parameter(self, name: str) -> torch.Tensor:
        return torch.empty(self.shape, device="meta")


def _pattern_regex(pattern: str) -> re.Pattern:
    return re.compile(re.escape(pattern).replace(r"\*", r"\d+"))


def reverse_step(fam, group: dict, read: Callable[[str], torch.Tensor], picks: list[int] | None,
                 source_shape: tuple | None, rows: int | None) -> dict[str, torch.Tensor]:
    """Source tensors (or their slices) of one step, from the output slices.

    Args:
        fam: the family.
        group: the manifest's plan group.
        read: output tensor name -> its slice for this step.
        picks: expert list positions of this step (experts mode).
        source_shape: shape of the group's single source (shape-checked reverse ops).
        rows: rows in this step's slices (None: whole tensors).

    Returns:
        {source key: tensor}.
    """
    if group["conv"] is None:
        (key,) = group["sources"]
        return {key: read(group["first"])}
    rev = fam.converters[group["conv"]].reverse_transform()
    layer = None
    suffix = group.get("suffix", "")  # fused FP8 scales reverse like their weights
    for name in group["targets"]:
        base = name[: len(name) - len(suffix)]
        renamed, pattern = rev.rename_source_key(base)
        if pattern is None:
            raise UserError(f"{MANIFEST}: {name} does not match the reverse of its converter")
        layer = layer or renamed
        rev.add_tensor(renamed, base, pattern, lambda n=name: read(n))
    model = _SourceShapes(source_shape, rows) if source_shape is not None else fam.meta
    result = rev.convert(layer, model=model, config=fam.config)
    return _assign(group, {n: (v[0] if isinstance(v, list) else v) for n, v in result.items()}, picks)


def _assign(group: dict, result: dict[str, torch.Tensor], picks: list[int] | None) -> dict:
    # lazy: transformers: heavy, loaded only when this runs
    from transformers.core_model_loading import dot_natural_key

    out: dict[str, torch.Tensor] = {}
    for pattern, keys in group["sources"].items():
        regex = _pattern_regex(pattern)
        names = sorted((n for n in result if regex.search(n)), key=dot_natural_key)
        chosen = [keys[i] for i in picks] if picks is not None else keys
        if len(names) != len(chosen):
            raise RuntimeError(f"reverse of {group['first']} gave {len(names)} tensors for "
                               f"{pattern}, expected {len(chosen)}")
        out.update(zip(chosen, (result[n] for n in names)))
    return out


def export_hf(converted: str | Path, out: str | Path,
              progress: Callable[[str], None] | None = None) -> dict:
    """Write the original family layout of a converted checkpoint to `out`.

    Returns:
        {"output_dir", "tensors", "shards", "checksum": algorithm (the manifest's),
         "digests": {source key: digest of the exported tensor}}.
    """
    converted, out = Path(converted).resolve(), Path(out).resolve()
    manifest = read_manifest(converted)
    if out.exists() and any(out.iterdir()):
        raise UserError(f"{out}: output directory exists and is not empty")
    config = json.loads((converted / "config.json").read_text())
    fam = load_family(config, str(converted / "config.json"))
    stage = out.parent / f".{out.name}.partial"
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    try:
        algorithm = digest.manifest_algorithm(manifest)
        digests = _write_shards(converted, manifest, fam, stage, algorithm, progress)
        weight_map = {k: v["file"] for k, v in manifest["source_tensors"].items() if k in digests}
        total = sum(read_header(stage / f)[0][k].nbytes for k, f in weight_map.items())
        (stage / INDEX).write_text(json.dumps({"metadata": {"total_size": total},
                                               "weight_map": weight_map}, indent=2))
        shutil.copy2(converted / "config.json", stage / "config.json")
        for name in manifest["aux_files"]:
            shutil.copy2(converted / name, stage / name)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    if out.exists():
        out.rmdir()
    stage.rename(out)
    return {"output_dir": str(out), "tensors": len(digests),
            "shards": len({v for v in weight_map.values()}), "checksum": algorithm, "digests": digests}


def _write_shards(converted: Path, manifest: dict, fam, stage: Path, algorithm: str,
                  progress) -> dict[str, str]:
    groups = manifest["groups"]
    dtype_of = {k: g["dtype"] for g in groups for ks in g["sources"].values() for k in ks}
    src = manifest["source_tensors"]
    shards: dict[str, list] = {}
    for key, info in src.items():  # source header order within each shard
        if key in dtype_of:
            shards.setdefault(info["file"], []).append((key, DTYPES[dtype_of[key]], tuple(info["shape"])))
    writers = {f: StreamWriter(stage / f, specs) for f, specs in shards.items()}
    headers = {f: read_header(converted / f)[0] for f in {g["file"] for g in groups}}
    hashers = {k: digest.hasher(algorithm) for k in dtype_of}
    try:
        for group in groups:
            _export_group(fam, group, headers[group["file"]], src, writers, hashers)
        for w in writers.values():
            w.close()
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    if progress:
        progress(f"exported {len(hashers)} tensors into {len(writers)} shards")
    return {k: h.hexdigest() for k, h in hashers.items()}


def _export_group(fam, group: dict, header: dict, src: dict, writers: dict, hashers: dict) -> None:
    keys = [k for ks in group["sources"].values() for k in ks]
    src_shapes = {k: tuple(src[k]["shape"]) for k in keys}
    single = src_shapes[keys[0]] if len(keys) == 1 else None
    for selection, row0 in steps(group, src_shapes):
        picks, rows = selection.get("experts"), selection.get("rows")
        n = len(picks) // group["chunks"] if picks is not None else (rows[1] - rows[0] if rows else None)

        def read(name, n=n, row0=row0):
            info = header[name]
            return read_rows(info, row0, row0 + n) if n is not None else read_rows(info)

        for key, t in reverse_step(fam, group, read, picks, single, n).items():
            # experts mode: each source is a whole tensor; rows mode: rows row0.. of it
            offset = row0 * t[0].numel() * t.element_size() if rows and t.dim() else 0
            writers[src[key]["file"]].write(key, offset, t)
            # ndarray has the buffer protocol; numpy's stubs do not declare it
            hashers[key].update(memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()))  # type: ignore[arg-type]
