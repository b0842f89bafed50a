"""Tensor checksums in the manifest: which algorithm, and reading old manifests.

Default `xxh3_128` (xxhash). Why not sha256: the manifest checksum guards
converted files against corruption, truncation and accidental edits (and lets
an interrupted run re-check files it keeps), not against an attacker who can
rewrite the manifest too, so a cryptographic hash buys nothing there. sha256
runs at ~1.3-1.7 GB/s on one core here and was the conversion's bottleneck;
xxh3 runs at memory speed (>10 GB/s) with a 128-bit digest, so an accidental
collision is as unlikely as with sha256. `--checksum sha256` remains for users
who want a cryptographic digest (e.g. to publish next to a signature).

Manifest layout: top-level `"checksum": <algorithm>`, and every tensor entry
carries its digest under the algorithm's name (`"xxh3_128": hex` or
`"sha256": hex`). Manifests written before the choice existed have
`"sha256"` entries and no top-level field; they read as sha256.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import xxhash

from moeflow.core.errors import UserError

ALGORITHMS = ("xxh3_128", "sha256")
DEFAULT = "xxh3_128"


def check(algorithm: str) -> str:
    """The algorithm name, or a UserError listing the supported ones."""
    if algorithm not in ALGORITHMS:
        raise UserError(f"--checksum {algorithm}: not supported (choose {', '.join(ALGORITHMS)})")
    return algorithm


def hasher(algorithm: str):
    """A new streaming hasher (`update(buffer)`, `hexdigest()`); both release the GIL
    on large buffers."""
    if algorithm == "xxh3_128":
        return xxhash.xxh3_128()
    return hashlib.new(check(algorithm))


def manifest_algorithm(manifest: dict) -> str:
    """The checksum algorithm of a manifest (sha256 for manifests that predate the field)."""
    return manifest.get("checksum", "sha256")


def entry_digest(entry: dict, algorithm: str) -> str | None:
    """A tensor entry's digest under `algorithm` (None if it has none)."""
    return entry.get(algorithm)


def file_digests(path: Path, algorithm: str) -> dict[str, str]:
    """Checksum of every tensor's bytes in a safetensors file (streamed in row ranges)."""
    # lazy: st_io loads torch; the driver imports this module to hash code and must not
    from moeflow.checkpoint.st_io import read_header, read_rows, tensor_bytes

    header, _ = read_header(path)
    out = {}
    for name, info in header.items():
        h = hasher(algorithm)
        rows = info.shape[0] if info.shape else 1
        per = max(1, (64 << 20) // max(1, info.nbytes // max(1, rows)))
        for a in range(0, rows, per) if info.shape else [0]:
            h.update(tensor_bytes(read_rows(info, a, min(a + per, rows)) if info.shape else read_rows(info)))
        out[name] = h.hexdigest()
    return out
