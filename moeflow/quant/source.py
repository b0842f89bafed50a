"""Read a checkpoint one module at a time, dequantised: moeflow's own loader.

`ModelSource` presents any checkpoint (a Hugging Face layout, a converted one,
or a compressed-tensors quantised one, including fp8-block and int8, which
transformers 5.24 cannot load on fused experts) as the runtime tensors of one
decoder layer, or of everything outside the decoder layers. Tensors are read
from the safetensors headers' byte ranges and turned into runtime names by
transformers' own conversion mapping (moeflow.checkpoint.plan); quantised
weights are dequantised by their compressed-tensors compressor. Memory: one
layer's tensors, never the model.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Callable

import torch

from moeflow.checkpoint.families import load_family
from moeflow.checkpoint.layercheck import decoder_layers
from moeflow.checkpoint.parse import Checkpoint, read_checkpoint
from moeflow.checkpoint.plan import plan_conversion
from moeflow.checkpoint.st_io import read_tensor
from moeflow.core.errors import UserError
from moeflow.model.anatomy import EXPERT_COUNT_KEYS
from moeflow.model.models import read_config
from moeflow.quant.schemes import dequantize_weight, scheme_of_config

# compressed-tensors' per-module tensors beside `weight` (or in place of it: weight_packed)
QUANT_PARTS = ("weight_scale", "weight_shape", "weight_zero_point", "weight_packed")

class ModelSource:
    """One checkpoint, readable a module at a time.

    Args:
        path: checkpoint directory.
    """

    _linear_modules: dict[str, torch.nn.Linear]  # set on first use by quant.quantize._linears

    def __init__(self, path: str | Path):
        self.path = Path(path)
        raw = read_checkpoint(self.path)
        self.scheme = scheme_of_config(raw.config)
        self.config = raw.config
        self.fam = load_family(raw.config, str(self.path / "config.json"))
        self.parts: dict[str, dict[str, str]] = {}  # weight key -> {part: stored key}
        tensors = {}
        for key, info in raw.tensors.items():
            base, _, leaf = key.rpartition(".")
            if self.scheme and leaf in QUANT_PARTS:
                self.parts.setdefault(f"{base}.weight", {})[leaf] = key
                continue
            tensors[key] = info
        for key, parts in self.parts.items():  # packed ints: the plan sees the unpacked weight
            if "weight_packed" in parts and "weight_shape" in parts:
                shape = tuple(int(d) for d in read_tensor(raw.tensors[parts["weight_shape"]]))
                tensors[key] = dataclasses.replace(raw.tensors[parts["weight_packed"]], name=key,
                                                   shape=shape)
        self.raw = raw
        self.ckpt = Checkpoint(raw.path, raw.config, tensors, raw.shards, raw.aux_files)
        self.groups = plan_conversion(self.ckpt, self.fam, policy="keep")["groups"]
        self.layers_prefix, self.meta_layers, _ = decoder_layers(self.fam.meta)

    @property
    def num_layers(self) -> int:
        return len(self.meta_layers)

    def layer_prefix(self, i: int) -> str:
        return f"{self.layers_prefix}.{i}."

    def read(self, key: str) -> torch.Tensor:
        """A checkpoint-layout tensor, dequantised when stored quantised (then float32)."""
        parts = self.parts.get(key)
        if parts and "weight_scale" in parts:
            state = {part: read_tensor(self.raw.tensors[k]) for part, k in parts.items()}
            if "weight_packed" not in parts:
                state["weight"] = read_tensor(self.raw.tensors[key])
            assert self.scheme is not None  # only a quantised checkpoint has scale parts
            t = dequantize_weight(state, self.scheme)
        else:
            t = read_tensor(self.ckpt.tensors[key])
        return t

    def state(self, select: Callable[[str], bool]) -> dict[str, torch.Tensor]:
        """Runtime tensors whose runtime name `select` accepts (converted by transformers'
        mapping, as `from_pretrained` would)."""
        out: dict[str, torch.Tensor] = {}
        for group in self.groups:
            if not any(select(t) for t in group["targets"]):
                continue
            keys = [k for ks in group["sources"].values() for k in ks]
            tensors = {k: self.read(k) for k in keys}
            if group["conv"] is None:
                out[group["first"]] = tensors[keys[0]]
                continue
            conv = copy.deepcopy(self.fam.converters[group["conv"]])
            for pattern, ks in group["sources"].items():
                for k in ks:
                    conv.add_tensor(group["first"], k, pattern, lambda k=k: tensors[k])  # noqa: B023  (read in this loop)
            converted = conv.convert(group["first"], model=self.fam.meta, config=self.fam.config)
            for name, value in converted.items():
                out[name] = value[0] if isinstance(value, list) else value
        return out

    def layer_state(self, i: int) -> dict[str, torch.Tensor]:
        prefix = self.layer_prefix(i)
        return self.state(lambda n: n.startswith(prefix))

    def outer_state(self) -> dict[str, torch.Tensor]:
        """Everything outside the decoder layers (embeddings, vision, final norm, head)."""
        prefix = self.layers_prefix + "."
        return self.state(lambda n: not n.startswith(prefix))

    def build_layer(self, i: int, dtype=torch.float32) -> torch.nn.Module:
        """Decoder layer `i` as transformers' own module, weights loaded ([.., H] -> [.., H])."""
        prefix = self.layer_prefix(i)
        # the tensors are assigned onto the meta module: no layer-sized allocation beside them
        layer = copy.deepcopy(self.meta_layers[i])
        state, own = self.layer_state(i), {}
        for key in list(state):  # each stored tensor released once cast: not the layer twice
            v = state.pop(key)
            own[key[len(prefix):]] = v.to(dtype) if v.is_floating_point() else v
        del state
        missing, unexpected = layer.load_state_dict(own, strict=False, assign=True)
        if missing or unexpected:
            raise UserError(f"{self.path}: layer {i}: missing {missing[:3]}, "
                            f"unexpected {unexpected[:3]}")
        for module in layer.modules():  # non-persistent buffers are in no checkpoint
            for name, buf in module.named_buffers(recurse=False):
                if buf.is_meta:
                    module._buffers[name] = torch.empty_like(buf, device="cpu")
        layer = layer.to(dtype).eval()
        self._quantize_inputs(layer, prefix)
        return layer

    def _quantize_inputs(self, layer: torch.nn.Module, prefix: str) -> None:
        """Dynamic input-activation quantisation on the quantised linear modules, as
        compressed-tensors runs them in transformers (per token for fp8/int8, per group
        of 128 for fp8-block). Fused experts are dequantised at load by transformers and
        run unquantised there, so they are here too."""
        args = self.scheme.ct_scheme().input_activations if self.scheme else None
        if args is None:
            return
        for name, module in layer.named_modules():
            if isinstance(module, torch.nn.Linear) and f"{prefix}{name}.weight" in self.parts:
                module.register_forward_pre_hook(_activation_quantizer(args))


def _activation_quantizer(args):
    """Forward pre-hook: fake-quantise a linear module's input with compressed-tensors'
    dynamic scales (the same calls its forward makes)."""
    # lazy: compressed_tensors: heavy, loaded only when this runs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    def hook(module, inputs):
        x = inputs[0]
        scale, zero = compute_dynamic_scales_and_zp(value=x, args=args, module=module)
        return (fake_quantize(x, scale, zero, args), *inputs[1:])
    return hook


def architecture(path: str | Path) -> tuple[str, dict]:
    """(architecture, shape-defining text config) of a checkpoint, for `compare`'s check."""

    config = read_config(path)
    text = config.get("text_config") or config
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "vocab_size", *EXPERT_COUNT_KEYS, "moe_intermediate_size", "intermediate_size")
    arch = (config.get("architectures") or ["?"])[0]
    return arch, {k: text.get(k) for k in keys if k in text}
