"""The layer-streamed forward (moeflow.quant.streamed) over any release format moeflow keeps.

moeflow.quant.streamed reads checkpoints through moeflow.quant.source.ModelSource, which
dequantises the compressed-tensors schemes moeflow's own quantiser writes (FP8, INT8,
W8A16). A kept release may hold others (MXFP4 in GPT-OSS's layout, INT4 / NVFP4
pack-quantized): `PackedSource` is a ModelSource whose tensors come from the release
formats' own decoders instead (moeflow.checkpoint.formats, the conversion plan's groups
and engine steps, as moeflow.model.packed_base decodes them), one decoder layer at a time;
`streamed_model` runs it with streamed's own Front and layer loop. Memory: one decoded
layer (float32) plus the front.
"""

from __future__ import annotations

from pathlib import Path

import torch

from moeflow.checkpoint import formats
from moeflow.checkpoint.engine import Loader, block_size, run_step
from moeflow.checkpoint.families import load_family
from moeflow.checkpoint.layercheck import decoder_layers
from moeflow.checkpoint.parse import read_checkpoint
from moeflow.checkpoint.plan import plan_conversion, steps
from moeflow.quant.source import ModelSource
from moeflow.quant.streamed import Front, StreamedModel


class PackedSource(ModelSource):
    """A checkpoint in any format moeflow.checkpoint.formats reads, a module at a time."""

    def __init__(self, path: str | Path):  # not super().__init__: it reads quant.schemes' formats only
        self.path = Path(path)
        self.raw = read_checkpoint(self.path)
        self.config = self.raw.config
        self.scheme = None  # weights decoded here; no input-activation quantisation hooks
        self.parts = {}
        self.fam = load_family(self.config, str(self.path / "config.json"))
        self.ckpt = formats.logical_view(self.raw, self.fam)
        self.groups = plan_conversion(self.ckpt, self.fam, "fp32")["groups"]
        self.layers_prefix, self.meta_layers, _ = decoder_layers(self.fam.meta)

    def state(self, select) -> dict[str, torch.Tensor]:
        """Runtime tensors whose runtime name `select` accepts, decoded (float32)."""
        out: dict[str, torch.Tensor] = {}
        for group in self.groups:
            if not any(select(t) for t in group["targets"]):
                continue
            keys = [k for ks in group["sources"].values() for k in ks] + list(group["scales"].values())
            sources = {k: self.ckpt.tensors[k] for k in keys}
            loader = Loader(sources, block_size(self.config))
            parts: dict[str, list] = {}
            try:
                for selection, _ in steps(group, {k: v.shape for k, v in sources.items()}):
                    for name, t in run_step(self.fam, group, loader, selection).items():
                        parts.setdefault(name, []).append(t)
            finally:
                loader.close()
            for name, pieces in parts.items():
                out[name] = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
        return out


def streamed_model(model_dir: str | Path, dtype=torch.float32) -> StreamedModel:
    """moeflow.quant.streamed's StreamedModel over `PackedSource(model_dir)`, on CPU."""
    model = StreamedModel.__new__(StreamedModel)  # its __init__ builds a ModelSource
    model.device, model.dtype = torch.device("cpu"), dtype
    model.source = PackedSource(model_dir)
    model.front = Front(model.source, dtype, model.device)
    return model
