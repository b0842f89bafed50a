"""`convert --dtype keep` of a release stored in a quantised format (moeflow.checkpoint.formats).

The output keeps the release's stored tensors byte for byte (packed codes, scales, zero
points, activation scales, plain tensors) under their stored names, refiled one
safetensors file per decoder layer (plus embeddings/head, vision tower, projector), and
config.json keeps its `quantization_config`: later stages get the quantised base, which
moeflow.model.packed_base loads with its routed experts packed and transformers loads as the
release itself.

Validated before anything is written: every quantised weight has all its parts and they
agree (formats.find_packed: names, header dtypes and shapes; MXFP4 blocks against
scales), the model takes every logical tensor by name and shape (the conversion plan),
and every weight decodes with its format's own decoder to its shape and finite values
(one expert's rows at a time where the format allows, else one tensor: memory is the
largest such unit). Verified after: every output tensor's checksum against the manifest.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Callable

import torch

from moeflow.checkpoint import digest, formats
from moeflow.checkpoint.manifest import FORMAT, MANIFEST, publish
from moeflow.checkpoint.parse import INDEX, tensor_kind
from moeflow.checkpoint.plan import output_file, plan_conversion
from moeflow.checkpoint.st_io import StreamWriter, read_rows, tensor_bytes
from moeflow.core.errors import UserError
from moeflow.model import remote_code

CHUNK = 64 << 20  # bytes per row-range read when copying a stored tensor


def kept_formats(ckpt) -> dict[str, int]:
    """{release format: logical tensors} of a checkpoint's quantised weights ({} for none)."""
    packed, _ = formats.find_packed(ckpt)
    out: dict[str, int] = {}
    for t in packed.values():
        out[t.format] = out.get(t.format, 0) + 1
    return out


def validate(raw, logical, fam, allow_nonfinite: bool = False,
             progress: Callable[[str], None] | None = None) -> dict[str, int]:
    """Check a quantised release before keeping it (see module docstring).

    Args:
        raw: the release as stored (moeflow.checkpoint.parse.Checkpoint).
        logical: `formats.logical_view(raw, fam)`.

    Returns:
        {release format: weights checked}.
    """
    plan_conversion(logical, fam, "bf16")  # names and shapes the model takes, or one line
    checked: dict[str, int] = {}
    fds: dict[str, int] = {}

    def fd(path: str) -> int:
        if path not in fds:
            fds[path] = os.open(path, os.O_RDONLY)
        return fds[path]

    try:
        for name, info in logical.tensors.items():
            if not isinstance(info, formats.Packed):
                continue
            rows = info.shape[0] if info.rowable and len(info.shape) >= 3 else None
            for r in range(rows) if rows else [None]:
                t = formats.read(info, (r, r + 1) if r is not None else None, fd=fd)
                want = (1, *info.shape[1:]) if r is not None else tuple(info.shape)
                if tuple(t.shape) != want:
                    raise UserError(f"{info.file}: tensor {name} ({info.format}) decodes to "
                                    f"{list(t.shape)}, the model's tensor is {list(want)}")
                if not allow_nonfinite and not bool(torch.isfinite(t).all()):
                    raise UserError(f"{info.file}: tensor {name} ({info.format}) decodes to "
                                    "non-finite values (NaN/Inf); pass --allow-nonfinite to keep it")
            checked[info.format] = checked.get(info.format, 0) + 1
    finally:
        for f in fds.values():
            os.close(f)
    if progress:
        progress("validated " + ", ".join(f"{n} {k} weights" for k, n in sorted(checked.items())))
    return checked


def keep_release(raw, logical, fam, out: Path, *, source: str, checksum: str,
                 allow_nonfinite: bool = False, transformers_version: str = "",
                 config_fix: Callable[[dict], None] | None = None,
                 progress: Callable[[str], None] | None = None) -> dict:
    """Validate `raw` and write it, kept, to `out` (atomically: `.<out>.partial` renamed).

    Returns:
        convert_checkpoint's result: {"output_dir", "manifest", "manifest_sha256", "family",
        "architecture", "source_dir", "tensors", "files", "bytes", "report"}.
    """
    checked = validate(raw, logical, fam, allow_nonfinite, progress)
    stage = out.parent / f".{out.name}.partial"
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    by_file: dict[str, list[str]] = {}
    for name in sorted(raw.tensors):
        by_file.setdefault(output_file(name), []).append(name)
    packed, _ = formats.find_packed(raw)
    part_of = {p.name: (logical_name, t.format) for logical_name, t in packed.items()
               for _, p in t.parts}
    entries: dict[str, dict] = {}
    for file, names in sorted(by_file.items()):
        writer = StreamWriter(stage / file, [(n, raw.tensors[n].torch_dtype, tuple(raw.tensors[n].shape))
                                             for n in names])
        try:
            for n in names:
                entries[n] = _copy(raw.tensors[n], writer, file, checksum, part_of.get(n))
            writer.close()
        except BaseException:
            writer.abort()
            raise
        if progress:
            progress(f"wrote {file} ({len(names)} tensors, kept)")
    total = sum(raw.tensors[n].nbytes for n in entries)
    index = {"metadata": {"total_size": total}, "weight_map": {n: e["file"] for n, e in entries.items()}}
    (stage / INDEX).write_text(json.dumps(index, indent=2))
    config = dict(raw.config)  # quantization_config included: the output is the quantised base
    if config_fix:
        config_fix(config)
    (stage / "config.json").write_text(json.dumps(config, indent=2))
    for name in raw.aux_files:
        shutil.copy2(raw.path / name, stage / name)
    manifest = {
        "format": FORMAT, "family": fam.model_type, "architecture": fam.architecture,
        "source_dir": source, "dtype": "keep", "dequantized": False, "kept_formats": checked,
        "checksum": checksum, "source_shards": raw.shards,
        "source_tensors": {k: {"file": Path(v.file).name, "shape": list(v.shape), "dtype": v.dtype}
                           for k, v in raw.tensors.items()},
        "dropped": [], "scales": {}, "groups": [], "tensors": entries, "total_bytes": total,
        "aux_files": raw.aux_files, "transformers": transformers_version,
    }
    if remote_code.needs_code(stage):
        manifest["remote_code"] = remote_code.pin(stage)
    (stage / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    report = verify_kept(stage, manifest)
    (stage / "verification.json").write_text(json.dumps(report, indent=2))
    if not report["passed"]:
        raise UserError(f"{out}: verification failed: {report['failures'][0]}")
    return publish(stage, out, fam, source, len(entries), len(by_file), total, report)


def _copy(info, writer: StreamWriter, file: str, algorithm: str, packed_by) -> dict:
    """Copy one stored tensor's bytes into `writer` in row ranges; its manifest entry."""
    h = digest.hasher(algorithm)
    rows = info.shape[0] if info.shape else 0
    row_bytes = info.nbytes // rows if rows else info.nbytes
    per = max(1, CHUNK // max(1, row_bytes))
    for a in range(0, rows, per) if rows else [0]:
        t = read_rows(info, a, min(a + per, rows)) if rows else read_rows(info)
        h.update(tensor_bytes(t))
        writer.write(info.name, a * row_bytes, t)
    entry = {"file": file, "shape": list(info.shape), "dtype": info.dtype, algorithm: h.hexdigest(),
             "kind": tensor_kind(info.name), "sources": [info.name],
             "transform": {"converter": "keep", "ops": [], "cast": info.dtype, "dequantized": False,
                           "mode": "keep"}}
    if packed_by:
        entry["packed"] = {"weight": packed_by[0], "format": packed_by[1]}
    return entry


def verify_kept(out: Path, manifest: dict) -> dict:
    """Every output tensor's bytes against the manifest checksum (re-read from disk)."""
    algorithm = manifest["checksum"]
    failures = []
    for file in sorted({e["file"] for e in manifest["tensors"].values()}):
        got = digest.file_digests(out / file, algorithm)
        for name, entry in manifest["tensors"].items():
            if entry["file"] == file and got.get(name) != entry[algorithm]:
                failures.append(f"{file}: tensor {name}: bytes differ from the release's")
    kinds: dict[str, dict] = {}
    for entry in manifest["tensors"].values():
        row = kinds.setdefault(entry["kind"], {"tensors": 0, "mismatches": 0, "max_abs_err": 0.0})
        row["tensors"] += 1
    return {"passed": not failures, "mismatches": len(failures), "failures": failures,
            "kinds": kinds, "kept": True,
            "functional": {"skipped": "kept bytes: checksums compared, no logits to compare"}}
