"""What `moeflow inspect` reports about a checkpoint, from its headers alone."""

from __future__ import annotations

from collections import Counter

from moeflow.checkpoint.formats import summary
from moeflow.checkpoint.parse import Checkpoint, num_experts, tensor_kind


def summarize(ckpt: Checkpoint) -> dict:
    """What `moeflow inspect` reports: families, layers, experts, kinds, dtypes, bytes.

    Returns:
        A JSON-able dict.
    """
    kinds: Counter = Counter()
    kind_bytes: Counter = Counter()
    dtypes: Counter = Counter()
    for name, info in ckpt.tensors.items():
        kind = tensor_kind(name)
        kinds[kind] += 1
        kind_bytes[kind] += info.nbytes
        dtypes[info.dtype] += 1
    families = [ckpt.config.get("model_type")] + [
        sub.get("model_type") for key, sub in ckpt.config.items()
        if key.endswith("_config") and isinstance(sub, dict) and sub.get("model_type")]
    quant = ckpt.config.get("quantization_config") or {}
    return {
        "path": str(ckpt.path),
        "families": [f for f in families if f],
        "architectures": ckpt.config.get("architectures") or [],
        "layers": ckpt.text_config.get("num_hidden_layers"),
        "experts": num_experts(ckpt.config),
        "tensors": len(ckpt.tensors),
        "kinds": {k: {"tensors": kinds[k], "bytes": kind_bytes[k]} for k in sorted(kinds)},
        "dtypes": dict(sorted(dtypes.items())),
        "total_bytes": ckpt.total_bytes,
        "shards": len(ckpt.shards),
        "quantization": quant.get("quant_method"),
        "formats": summary(ckpt),
        "aux_files": ckpt.aux_files,
    }
