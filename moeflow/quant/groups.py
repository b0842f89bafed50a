"""One decoder layer split by groups of its routed experts: for a layer larger than a device.

    parts = layer_parts(source, i, groups=2)   # [(i, 0, 4, True), (i, 4, 8, False)]
    tensors = part_checkpoint_state(source, parts[1])   # experts 4..7 only, checkpoint layout

A part is (layer, first expert, stop expert, with_rest): the routed experts [a, b) of
layer i, and for the designated part (the first) everything else of the layer too
(attention, norms, router, shared / dense experts). Each part reads only its own
tensors (per tensor, by byte range: moeflow.checkpoint.st_io; a fused experts tensor by
its rows [a, b)). The compare runs a part as transformers' own layer module whose experts
module holds experts [a, b) only, with the convention transformers' expert parallelism
uses (transformers.distributed.expert_parallel.AllReduceEP): `num_experts` is the local
count, a route to another part's expert gets the local id `num_experts` (the sentinel
the experts forward skips) and weight 0, and the parts' outputs are summed in group order.

Equal to one process: transformers' experts forward adds each routed expert's weighted
output into zeros in expert order (index_add_). With top-2 routing a token's two
contributions meet in one addition whether they come from one group or two (0 + x is
exact), so the summed parts give one process's outputs bit for bit; with top-k > 2 a
token's contributions from different groups associate differently: equal within float
rounding.

Memory: a part is assembled expert by expert into tensors allocated once
(`expert_runtime_state`: one expert's tensors as read beside the part), and the processes
that hold parts map large tensors on their own (`release_freed_tensors`). The planner sizes
a part by moeflow.parallel.footprint.group_bytes; tasks/calibrate.py resolves `auto`
groups with that same function.
"""

from __future__ import annotations

import copy
import ctypes
import re

import torch

from moeflow.checkpoint.st_io import read_rows
from moeflow.core.errors import UserError
from moeflow.quant.source import ModelSource
from moeflow.quant.streamed import layer_ranges

_INDEX = re.compile(r"\.experts\.(\d+)\.")  # one expert's tensor in the checkpoint layout

Part = tuple[int, int, int, bool]


def routed_experts(layer: torch.nn.Module) -> tuple[str, int] | None:
    """(name within the layer, count) of the layer's routed experts module: transformers'
    fused experts (a module named `experts` whose every parameter is stacked over its
    `num_experts`); None for a dense layer or experts kept as a module list."""
    for name, module in layer.named_modules():
        count = getattr(module, "num_experts", None)
        params = list(module.parameters(recurse=False))
        if name.rpartition(".")[2] == "experts" and isinstance(count, int) and params \
                and all(p.dim() >= 1 and p.shape[0] == count for p in params):
            return name, count
    return None


def layer_parts(source: ModelSource, i: int, groups: int) -> list[Part]:
    """Layer i's parts for `groups` expert groups (one whole-layer part when the layer has
    no fused routed experts or groups is 1)."""
    found = routed_experts(source.meta_layers[i])
    if found is None or groups <= 1:
        return [(i, 0, found[1] if found else 0, True)]
    return [(i, a, b, k == 0) for k, (a, b) in enumerate(layer_ranges(found[1], groups))]


def _experts_prefix(source: ModelSource, i: int) -> str | None:
    found = routed_experts(source.meta_layers[i])
    return f"{source.layer_prefix(i)}{found[0]}." if found else None


# glibc's M_MMAP_THRESHOLD (mallopt's parameter number)
_M_MMAP_THRESHOLD = -3
# what a fixed threshold maps on its own: above one expert's tensor of a small model (1.5 MB
# in the rehearsal's), below the layer-sized ones
_OWN_MAPPING = 1 << 20


def release_freed_tensors() -> None:
    """Every allocation of 1 MB or more in its own mapping from now on in this process,
    returned to the kernel when freed (glibc `mallopt(M_MMAP_THRESHOLD)`).

    Hand-written (ctypes, as moeflow.core.memmeter's heap trim) because nothing in torch
    sets it: glibc raises its threshold (up to 32 MB) each time a mapped block is freed, so
    the tensors a part reads and frees expert by expert come to be served from the heap,
    whose freed holes stay resident -- a worker that loads a part per layer and side then
    grew 54 -> 90 MB over 8 loads of a 55 MB part; with the threshold fixed it stays at 64.
    Not glibc: nothing to set."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, _OWN_MAPPING)
    except (OSError, AttributeError):
        pass


def _expert_groups(source: ModelSource, prefix: str) -> list[dict]:
    return [g for g in source.groups if any(t.startswith(prefix) for t in g["targets"])]


def expert_runtime_state(source: ModelSource, i: int, a: int, b: int,
                         dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Runtime tensors of layer i's routed experts [a, b), stacked over those experts only,
    in `dtype` (None: as read; a quantised checkpoint reads as float32).

    Assembled expert by expert into tensors allocated once: each expert's checkpoint tensors
    run through transformers' converter alone (its stacking is along the expert dimension,
    so expert e's result is row e - a of the group's), a stored fused tensor read by its row
    per expert. At most one expert's tensors as read sit beside the result: converting the
    group at once held every tensor as read, the stacked gate and up and their
    concatenation together (about 3x the result, measured)."""
    prefix = _experts_prefix(source, i)
    if prefix is None:
        return {}
    out: dict[str, torch.Tensor] = {}

    def put(name: str, row: int, value: torch.Tensor) -> None:
        if name not in out:
            out[name] = torch.empty((b - a, *value.shape), dtype=dtype or value.dtype)
        out[name][row].copy_(value)

    for group in _expert_groups(source, prefix):
        if group["conv"] is None:
            key = next(k for ks in group["sources"].values() for k in ks)
            if key in source.parts:  # a quantised fused tensor: dequantised whole, then cut
                whole = source.read(key)
                out[group["first"]] = whole[a:b].to(dtype or whole.dtype, copy=True)
                del whole
                continue
            for e in range(a, b):
                put(group["first"], e - a, read_rows(source.ckpt.tensors[key], e, e + 1)[0])
            continue
        by_expert: dict[int, dict[str, list[str]]] = {e: {} for e in range(a, b)}
        for pattern, ks in group["sources"].items():
            for k in ks:
                if (m := _INDEX.search(k)) and a <= int(m.group(1)) < b:
                    by_expert[int(m.group(1))].setdefault(pattern, []).append(k)
        if any(sorted(picked) != sorted(group["sources"]) or any(len(ks) != 1 for ks in picked.values())
               for picked in by_expert.values()):
            raise UserError(f"{source.path}: layer {i}: the stored experts of {group['first']} are not "
                            f"numbered 0..n-1; cannot split them into groups")
        for e, picked in by_expert.items():
            tensors = {k: source.read(k) for ks in picked.values() for k in ks}
            conv = copy.deepcopy(source.fam.converters[group["conv"]])
            for pattern, ks in picked.items():
                for k in ks:
                    conv.add_tensor(group["first"], k, pattern, lambda k=k, read=tensors: read[k])
            for name, value in conv.convert(group["first"], model=source.fam.meta, config=source.fam.config).items():
                value = value[0] if isinstance(value, list) else value
                if value.shape[0] != 1:
                    raise UserError(f"{source.path}: layer {i}: {name} does not stack its experts along "
                                    f"the first dimension; cannot split them into groups")
                put(name, e - a, value[0])
            del tensors, conv  # this expert's as read, released before the next is read
    return out


def rest_runtime_state(source: ModelSource, i: int) -> dict[str, torch.Tensor]:
    """Runtime tensors of layer i outside its routed experts."""
    prefix, experts = source.layer_prefix(i), _experts_prefix(source, i)
    return source.state(lambda n: n.startswith(prefix) and not (experts and n.startswith(experts)))


def part_checkpoint_state(source: ModelSource, part: Part) -> dict[str, torch.Tensor]:
    """A part's tensors in the checkpoint layout `save_pretrained` writes (experts numbered
    as in the whole layer)."""
    i, a, b, rest = part
    out = checkpoint_layout(source, rest_runtime_state(source, i)) if rest else {}
    experts = checkpoint_layout(source, expert_runtime_state(source, i, a, b))
    for key, value in experts.items():
        m = _INDEX.search(key)
        if m is None:
            raise UserError(f"{source.path}: {key}: an expert tensor the checkpoint layout does not "
                            f"number; cannot split layer {i} into expert groups")
        out[f"{key[:m.start()]}.experts.{int(m.group(1)) + a}.{key[m.end():]}"] = value
    return out


def checkpoint_layout(source: ModelSource, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Runtime tensors -> the checkpoint layout `save_pretrained` writes (transformers' reverse mapping)."""
    # lazy: transformers: heavy, loaded only when this runs
    from transformers.core_model_loading import revert_weight_conversion

    return dict(revert_weight_conversion(source.fam.meta, state))


def build_part(source: ModelSource, part: Part, dtype=torch.float32) -> torch.nn.Module:
    """Layer i as transformers' module holding only part's tensors: experts [a, b) (as
    `num_experts` b - a, routes remapped by `local_routes`), the rest only when the part has it."""
    i, a, b, rest = part
    prefix = source.layer_prefix(i)
    layer = copy.deepcopy(source.meta_layers[i])
    found = routed_experts(layer)
    state = rest_runtime_state(source, i) if rest else {}
    state.update(expert_runtime_state(source, i, a, b, dtype))
    if found is not None:
        experts = layer.get_submodule(found[0])
        for name, p in list(experts.named_parameters(recurse=False)):  # sliced shapes on meta
            experts._parameters[name] = torch.nn.Parameter(torch.empty(b - a, *p.shape[1:], device="meta"),
                                                           requires_grad=False)
        experts.num_experts = b - a  # type: ignore[assignment]  # a plain int the experts' forward reads
        experts._is_expert_parallel = True  # type: ignore[assignment]  # the fused implementations mask the sentinel routes
        experts.register_forward_pre_hook(local_routes(a, b), with_kwargs=True)
    own = {}
    for key in list(state):
        v = state.pop(key)
        own[key[len(prefix):]] = v.to(dtype) if v.is_floating_point() else v
    layer.load_state_dict(own, strict=False, assign=True)
    for module in layer.modules():  # non-persistent buffers are in no checkpoint
        for name, buf in module.named_buffers(recurse=False):
            if buf.is_meta:
                module._buffers[name] = torch.empty_like(buf, device="cpu")
    layer = layer.to(dtype).eval()
    source._quantize_inputs(layer, prefix)
    return layer


def local_routes(a: int, b: int):
    """Forward pre-hook on an experts module holding experts [a, b): global expert ids to
    local ones, a route elsewhere to the sentinel `b - a` with weight 0 (AllReduceEP's mapping)."""

    def hook(_module, args, kwargs):
        hidden, index, weights = args[0], args[1], args[2]
        off = (index < a) | (index >= b)
        local = torch.where(off, b - a, index - a)
        return (hidden, local, weights.masked_fill(off, 0.0), *args[3:]), kwargs
    return hook


class PartExperts(torch.nn.Module):
    """Stands in for a layer's experts module in the designated part: its own experts
    [a, b) here, the other groups' on Ray actors (`GroupWorker`), outputs summed in group order."""

    def __init__(self, local: torch.nn.Module, workers: list):
        super().__init__()
        self.local, self.workers = local, workers

    def forward(self, hidden, index, weights, *args):
        # lazy: ray: heavy, loaded only when this runs
        import ray

        pending = [w.run.remote(hidden, index, weights, *args) for w in self.workers]
        out = self.local(hidden, index, weights, *args)
        for part in ray.get(pending):
            out = out + part.to(out.device)
        return out


class GroupWorker:
    """A Ray actor holding one expert group of one layer of one checkpoint at a time."""

    def __init__(self, device=None):
        # lazy: moeflow.core.devices imports torch.cuda helpers only where a worker runs
        from moeflow.core.devices import local_device
        from moeflow.core.memmeter import PeakMemory

        release_freed_tensors()
        self.device = torch.device(device) if device is not None else local_device()
        self.meter = PeakMemory(self.device.type)  # started once the first checkpoint's headers are read
        self.started = False
        self.experts = None
        self.sources: dict[str, ModelSource] = {}  # headers parsed once per checkpoint

    def load(self, path: str, part: Part) -> None:
        self.experts = None  # the previous group released before the next is read
        if path not in self.sources:
            self.sources[path] = ModelSource(path)
        if not self.started:  # just before the first tensor is read
            self.meter.start()
            self.started = True
        source = self.sources[path]
        layer = build_part(source, part)
        found = routed_experts(layer)
        assert found is not None  # a group part exists only where the layer has routed experts
        self.experts = layer.get_submodule(found[0]).to(self.device)

    def run(self, hidden, index, weights, *args):
        with torch.no_grad():
            return self.experts(hidden.to(self.device), index.to(self.device), weights.to(self.device),
                                *args).cpu()

    def memory(self) -> dict:
        return self.meter.record()


class PartBuilder:
    """Builds decoder layers for a compare: whole (`ModelSource.build_layer`) with one expert
    group, else the designated part here and the other groups loaded into Ray actors
    (created on first use, one per group beyond the first, killed by `close`)."""

    def __init__(self, groups: int, device):
        self.groups, self.device = groups, device
        self.workers: list = []

    def __call__(self, source: ModelSource, i: int) -> torch.nn.Module:
        parts = layer_parts(source, i, self.groups)
        if len(parts) == 1:
            return source.build_layer(i).to(self.device)
        # lazy: ray: heavy, loaded only when this runs
        import ray

        from moeflow.core.devices import gpus_per_worker

        while len(self.workers) < len(parts) - 1:
            # a GPU each where there are; no CPU reserved: an actor computes only while the
            # layer's process waits on it (PartExperts), so G - 1 actors beside a range task
            # never wait for CPUs the range task holds
            actor = ray.remote(num_cpus=0, num_gpus=gpus_per_worker())(GroupWorker)
            self.workers.append(actor.remote())
        ray.get([w.load.remote(str(source.path), p) for w, p in zip(self.workers, parts[1:])])
        layer = build_part(source, parts[0]).to(self.device)
        name, _ = routed_experts(layer) or ("", 0)
        holder_name, _, leaf = name.rpartition(".")
        holder = layer.get_submodule(holder_name) if holder_name else layer
        setattr(holder, leaf, PartExperts(getattr(holder, leaf), self.workers[:len(parts) - 1]))
        return layer

    def memory(self) -> dict:
        """{"groups": each actor's peak} (empty when there are none)."""
        if not self.workers:
            return {}
        # lazy: ray: heavy, loaded only when this runs
        import ray

        return {"groups": ray.get([w.memory.remote() for w in self.workers])}

    def close(self) -> None:
        if self.workers:
            # lazy: ray: heavy, loaded only when this runs
            import ray

            for w in self.workers:
                ray.kill(w)
            self.workers = []
