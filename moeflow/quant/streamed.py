"""A model run one decoder layer at a time from its checkpoint: the layer-streamed forward.

    model = StreamedModel("converted/")
    logits = model.logits([tokenizer("hello", return_tensors="pt")])

For a model larger than a device. Everything outside the decoder layers (embeddings,
vision tower, rotary/mask preparation, final norm, head: the `Front`) is built once
from the checkpoint; the decoder layers are transformers' own modules, built on the
meta device with the model (moeflow.checkpoint.families), each materialised from its
tensors just before it runs (moeflow.quant.source: one file per layer in a converted
checkpoint, read by byte range) and released after. The front records what the model
feeds each layer (masks, position embeddings); the hidden states are carried from
layer to layer. Passes are layer-major: every batch goes through layer i before layer
i + 1 is read, so each layer is read once per pass.

Memory: the front, the largest decoder layer (in the compute dtype) and the batches'
hidden states -- never the model. Nothing here is specific to a family: the layer list,
its kwargs and the weights' names are transformers' own.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Callable

import torch

from moeflow.checkpoint.parse import read_checkpoint
from moeflow.core.devices import local_device, to_device
from moeflow.core.errors import UserError
from moeflow.model.anatomy import vision_parts
from moeflow.quant.source import ModelSource

# Legend: B batch, T tokens, H hidden, V vocab.


class _Capture(torch.nn.Module):
    """Stands in for a decoder layer in the front model: records what the model feeds
    layer i (hidden states and kwargs: masks, position embeddings) and passes it on."""

    def __init__(self, sink: list):
        super().__init__()
        self.sink = sink

    def forward(self, hidden_states, *args, **kwargs):
        self.sink.append((hidden_states, args, kwargs))
        return hidden_states


class Front:
    """Everything outside the decoder layers of one checkpoint (embeddings, vision tower,
    rotary/mask preparation, final norm, head), with the layers replaced by captures."""

    def __init__(self, source: ModelSource, dtype=torch.float32, device="cpu"):
        self.sink: list = []
        self.device = torch.device(device)
        model = copy.deepcopy(source.fam.meta)
        parent_name, _, attr = source.layers_prefix.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, torch.nn.ModuleList(_Capture(self.sink) for _ in range(source.num_layers)))
        model = model.to_empty(device="cpu")
        with torch.no_grad():
            for module in model.modules():  # non-persistent buffers (rotary inv_freq) by the
                model._init_weights(module)  # family's own init; parameters are loaded next
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in source.outer_state().items()}
        missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
        missing = [k for k in missing if k not in source.fam.optional_keys()]  # tied head
        if unexpected or missing:
            raise UserError(f"{source.path}: tensors outside the decoder layers do not match "
                            f"the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
        if getattr(source.fam.config.get_text_config(), "tie_word_embeddings", False) or \
                getattr(source.fam.config, "tie_word_embeddings", False):
            model.tie_weights()
        self.model = model.to(dtype).eval().to(self.device)
        self.norm = parent.norm
        self.head = model.get_output_embeddings()
        self.vision = _vision_blocks(model)

    def run(self, inputs: dict) -> dict:
        """Front pass of one sample: layer inputs, between-layer additions, vision outputs.

        Returns:
            {"hidden": [1, T, H] input of layer 0, "calls": [(args, kwargs)] per layer,
             "deltas": [None | [1, T, H]] what the model adds between layer i and i+1
             (Qwen3-VL's deepstack visual features), "vision": {name: tensor}}
        """

        self.sink.clear()
        inputs = to_device(inputs, self.device)
        seen: dict[str, torch.Tensor] = {}
        hooks = [m.register_forward_hook(keep_output(seen, name)) for name, m in self.vision]
        try:
            base = getattr(self.model, self.model.base_model_prefix)
            with torch.no_grad():
                base(**inputs, use_cache=False)
        finally:
            for h in hooks:
                h.remove()
        hidden = [h for h, _, _ in self.sink]
        deltas = []
        for i in range(len(hidden)):
            nxt = hidden[i + 1] if i + 1 < len(hidden) else None
            d = None if nxt is None or nxt is hidden[i] else nxt - hidden[i]
            deltas.append(d if d is not None and bool(d.abs().max() > 0) else None)
        return {"hidden": hidden[0], "calls": [(a, k) for _, a, k in self.sink],
                "deltas": deltas, "vision": seen}

    def logits(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(final norm output [1, T, H], logits [1, T, V])."""
        with torch.no_grad():
            normed = self.norm(hidden)  # type: ignore[operator]  # torch types a submodule attribute as Tensor | Module
            return normed, self.head(normed)


def _vision_blocks(model) -> list[tuple[str, torch.nn.Module]]:
    """Every block of the vision parts (members of their ModuleLists), in forward order."""

    out = []
    for part in vision_parts(model):
        for name, module in model.get_submodule(part).named_modules():
            if isinstance(module, torch.nn.ModuleList):
                out += [(f"{part}.{name}.{i}", m) for i, m in enumerate(module)]
    return out


def first_tensor(output):
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    return getattr(output, "last_hidden_state", None)


def keep_output(store: dict, name: str):
    def hook(_module, _inputs, output):
        t = first_tensor(output)
        if t is not None:
            store[name] = t.detach()
    return hook


class StreamedModel:
    """One checkpoint run layer by layer (see the module docstring).

    Args:
        model_dir: checkpoint directory (converted, Hugging Face or compressed-tensors).
        dtype: compute dtype of the front and of each layer.
        device: where the layers run; None: the GPU Ray granted this task, else CPU.
        meter: a moeflow.core.memmeter.PeakMemory started just before the first tensor is read.
    """

    def __init__(self, model_dir: str | Path, dtype=torch.float32, device=None, meter=None):
        self.device = torch.device(device) if device is not None else local_device()
        self.dtype = dtype
        self.source = ModelSource(model_dir)
        if meter is not None:
            meter.start()
        self.front = Front(self.source, dtype, self.device)

    @property
    def num_layers(self) -> int:
        return self.source.num_layers

    def layer_prefix(self, i: int) -> str:
        """Layer i's module name in the whole model, with a trailing dot."""
        return self.source.layer_prefix(i)

    def hidden_states(self, batches: list[dict], on_layer: Callable | None = None,
                      on_batch: Callable[[int], None] | None = None) -> list[torch.Tensor]:
        """The last decoder layer's output for each batch ([B, T, H] each).

        Args:
            batches: model inputs (tokenizer output) per batch.
            on_layer: called as on_layer(i, layer) once layer i is built; returns hook
                handles, removed before the layer is released.
            on_batch: called with the batch index before each batch runs through a layer.
        """
        runs = [self.front.run(b) for b in batches]
        hidden = [r["hidden"] for r in runs]
        for i in range(self.num_layers):
            layer = self.source.build_layer(i, self.dtype).to(self.device)
            handles = on_layer(i, layer) if on_layer else []
            try:
                hidden = [self._layer(layer, i, k, h, r, on_batch)
                          for k, (h, r) in enumerate(zip(hidden, runs))]
            finally:
                for handle in handles:
                    handle.remove()
            del layer  # released before the next one is read
        return hidden

    def _layer(self, layer, i: int, k: int, hidden, run: dict, on_batch) -> torch.Tensor:
        if on_batch:
            on_batch(k)
        return run_layer(layer, hidden, run["calls"][i], run["deltas"][i])

    def logits(self, batches: list[dict], **hooks) -> list[torch.Tensor]:
        """Logits [B, T, V] per batch (hooks: as `hidden_states`)."""
        return [self.front.logits(h)[1] for h in self.hidden_states(batches, **hooks)]


def run_layer(layer, hidden: torch.Tensor, call: tuple, delta) -> torch.Tensor:
    """Decoder layer `layer` on `hidden` [B, T, H] with what the front recorded for it (`call`:
    its args and kwargs) and what the model adds after it (`delta`: None, or deepstack
    features): the layer-streamed forward's step, shared with the resident layer ranges of
    moeflow.evaluation.ranges_runner."""
    args, kwargs = call
    with torch.no_grad():
        out = first_tensor(layer(hidden, *args, **kwargs))
    return out if delta is None else out + delta


def resident_bytes(model_dir: str | Path, dtype) -> int:
    """Bytes the whole model holds loaded in `dtype` (from the safetensors headers)."""
    size = torch.empty((), dtype=dtype).element_size()
    return size * sum(math.prod(t.shape) for t in read_checkpoint(model_dir).tensors.values())


def chooses_streaming(setting: str, model_dir: str | Path, dtype, device_bytes: float) -> bool:
    """Whether a stage runs the model layer-streamed: `setting` always / never, or auto:
    when the whole model in its compute dtype exceeds one device (`device_bytes`)."""
    if setting != "auto":
        return setting == "always"
    return resident_bytes(model_dir, dtype) > device_bytes


def layer_ranges(layers: int, workers: int) -> list[tuple[int, int]]:
    """`layers` split into at most `workers` contiguous [start, stop) ranges, sizes within one."""
    workers = max(1, min(workers, layers))
    bounds = [layers * k // workers for k in range(workers + 1)]
    return [(a, b) for a, b in zip(bounds, bounds[1:])]
