"""Parse a Hugging Face checkpoint directory without loading tensor data.

Reads `config.json` (with nested `text_config` / `vision_config`), the
safetensors index or a single `model.safetensors`, every shard header, and
lists the tokenizer / processor files. Bad input is a `UserError` naming the
file and tensor.

    .venv/bin/moeflow inspect PATH
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from moeflow.checkpoint.st_io import TensorInfo, read_header
from moeflow.core.errors import UserError
from moeflow.model.anatomy import EXPERT_COUNT_KEYS
from moeflow.model.remote_code import activate

INDEX = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# Files never copied as "tokenizer/processor" side files.
_NOT_AUX = re.compile(r"(\.safetensors|\.safetensors\.index\.json|^config\.json|\.bin|\.pt|\.pth"
                      r"|\.ckpt|\.pkl|\.tmp|^manifest\.json|^verification\.json)$")
# Tensor kinds, tested in order (first match wins).
KINDS: list[tuple[str, re.Pattern]] = [
    ("projector", re.compile(r"multi_modal_projector|resampler|mm_projector")),
    ("vision", re.compile(r"(^|\.)(visual|vision_model|vision_tower|vision_encoder)\.")),
    ("embeddings", re.compile(r"embed_tokens|\.wte\.|embeddings")),
    ("head", re.compile(r"(^|\.)lm_head\.")),
    ("norm", re.compile(r"norm(\.|$)|layernorm")),
    ("shared_experts", re.compile(r"shared_expert")),
    ("experts", re.compile(r"\.experts\.")),
    ("router", re.compile(r"\.gate\.|\.router\.|moe_statics|e_score_correction")),
    ("attention", re.compile(r"self_attn|\.attention\.|\.attn\.")),
    ("dense_mlp", re.compile(r"\.mlp\.|feed_forward")),
]


def tensor_kind(name: str) -> str:
    """Kind of a tensor from its name (attention, router, experts, ...)."""
    for kind, pattern in KINDS:
        if pattern.search(name):
            return kind
    return "other"


@dataclass
class Checkpoint:
    """A parsed checkpoint directory (headers only)."""

    path: Path
    config: dict
    tensors: dict[str, TensorInfo]  # name -> where it lives
    shards: list[str]  # shard file names, in index order
    aux_files: list[str] = field(default_factory=list)  # tokenizer/processor/generation files

    @property
    def text_config(self) -> dict:
        return self.config.get("text_config") or self.config

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def _strict_json(path: Path) -> dict:
    def no_dupes(pairs):
        seen: dict = {}
        for k, v in pairs:
            if k in seen:
                raise UserError(f"{path}: key {k!r} listed twice")
            seen[k] = v
        return seen

    try:
        return json.loads(path.read_text(), object_pairs_hook=no_dupes)
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: invalid JSON at line {e.lineno}: {e.msg}") from None


def read_checkpoint(path: str | Path) -> Checkpoint:
    """Parse `path` (a checkpoint directory): config, index, shard headers, side files.

    Args:
        path: directory holding config.json and safetensors shards.

    Returns:
        A `Checkpoint`. Raises UserError for a missing directory or config,
        pickle weights, a missing shard, a tensor missing from its shard or
        listed twice, a truncated shard or a corrupt header.
    """
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"{path}: not a checkpoint directory")
    files = sorted(p.name for p in path.iterdir() if p.is_file())
    pickles = [f for f in files if f.endswith(PICKLE_SUFFIXES)]
    if not any(f.endswith(".safetensors") for f in files):
        if pickles:
            raise UserError(f"{path / pickles[0]}: pickle checkpoints are refused "
                            "(only safetensors is read; convert it with safetensors first)")
        raise UserError(f"{path}: no safetensors weights found")
    if not (path / "config.json").is_file():
        raise UserError(f"{path / 'config.json'}: missing")
    config = _strict_json(path / "config.json")

    activate(path)  # its own modeling code, when it has some: checked, then registered
    from moeflow.model.anatomy import check_config_values  # here: imports transformers only when reading one

    check_config_values(config, str(path / "config.json"))  # a value transformers refuses: one line
    tensors, shards = _read_weights(path, files)
    aux = [f for f in files if not _NOT_AUX.search(f) and not f.startswith(".")]
    return Checkpoint(path, config, tensors, shards, aux)


def _read_weights(path: Path, files: list[str]) -> tuple[dict[str, TensorInfo], list[str]]:
    if (path / INDEX).is_file():
        index = _strict_json(path / INDEX)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise UserError(f"{path / INDEX}: no weight_map")
        shards = list(dict.fromkeys(weight_map.values()))
    else:
        shards = [f for f in files if f.endswith(".safetensors")]
        weight_map = None
    tensors: dict[str, TensorInfo] = {}
    for shard in shards:
        if not (path / shard).is_file():
            raise UserError(f"{path / INDEX}: names shard {shard}, which does not exist")
        header, _ = read_header(path / shard)
        for name, info in header.items():
            if name in tensors:
                raise UserError(f"{path / shard}: tensor {name} listed twice "
                                f"(also in {Path(tensors[name].file).name})")
            if weight_map is not None and weight_map.get(name) != shard:
                raise UserError(f"{path / shard}: tensor {name} is not mapped to this shard "
                                f"in {INDEX}")
            tensors[name] = info
    if weight_map is not None:
        for name, shard in weight_map.items():
            if name not in tensors:
                raise UserError(f"{path / INDEX}: tensor {name} is mapped to {shard}, "
                                "which does not contain it")
    return tensors, shards


def num_experts(config: dict) -> int | None:
    """Routed experts per MoE layer, from any of the families' config names."""
    text = config.get("text_config") or config
    return next((text[key] for key in EXPERT_COUNT_KEYS if isinstance(text.get(key), int)), None)
