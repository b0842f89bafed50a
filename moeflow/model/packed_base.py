"""A frozen base whose routed experts stay in the release's precision (QLoRA-style).

`load_packed(release_dir)` builds the model transformers would build from a release in
a quantised on-disk format (moeflow.checkpoint.formats: MXFP4, compressed-tensors
INT4/INT8/NVFP4/MXFP4/FP8), with every fused routed-expert tensor replaced by a
`PackedExperts` weight: the stored parts (codes and scales, as on disk) and the
conversion-plan group that turns them into that tensor. Everything else (attention,
norms, router, embeddings: a small share of an MoE) is decoded to the compute dtype.

The experts module's own forward runs unchanged (transformers' "eager" experts loop):
it indexes the weight one expert at a time (`W[e]`) and multiplies. `W[e]` is an
`ExpertView`, a tensor-like object (`__torch_function__`) that turns `F.linear(x, W[e])`
and `x @ W[e]` into `_PackedMatmul`: decode expert e (the plan's converter on the
decoded parts, moeflow.checkpoint.engine.run_step), multiply, drop it; backward decodes
it again (the base is frozen: only the input gradient is needed). No decoded expert
outlives its matmul, so memory holds the packed base plus one expert's weights, never
a bf16 copy. LoRA (PEFT, attention targets) sits on top unchanged, and its adapters
apply to the bf16-dequantised base as well: the weights are the same values.
"""

from __future__ import annotations

import copy
import ctypes
import ctypes.util
import threading
from pathlib import Path

import torch
import torch.nn.functional as F

from moeflow.checkpoint import formats
from moeflow.checkpoint.engine import Loader, block_size, run_step
from moeflow.checkpoint.families import load_family
from moeflow.checkpoint.parse import read_checkpoint
from moeflow.checkpoint.plan import plan_conversion, steps
from moeflow.checkpoint.st_io import DTYPES, read_rows
from moeflow.core.errors import UserError
from moeflow.model.anatomy import classify


class _MemoryLoader(Loader):
    """The engine's loader over parts held in memory (the packed base)."""

    def __init__(self, tensors: dict, block, held: dict[str, torch.Tensor]):
        super().__init__(tensors, block)
        self.held = held  # stored name -> tensor as stored (packed codes, scales)

    def load(self, key: str, dtype: str, scale_key, rows=None) -> torch.Tensor:
        info = self.tensors[key]
        if isinstance(info, formats.Packed):
            t = formats.read(info, rows, source=lambda p: self.held[p.name])
        else:
            t = self.held[key]
            t = t[rows[0]:rows[1]] if rows else t
        return t.to(DTYPES[dtype])


class PackedExperts:
    """One fused routed-expert tensor [E, ...], kept as its stored parts."""

    def __init__(self, fam, group: dict, sources: dict, held: dict, config: dict, dtype: torch.dtype):
        self.fam, self.group, self.dtype = fam, group, dtype
        (self.name, shape), = group["targets"].items()
        self.shape = torch.Size(shape)
        self.loader = _MemoryLoader(sources, block_size(config), held)
        self.device = torch.device("cpu")
        self.decodes = 0  # experts decoded (forward and backward), for tests and benchmarks
        self._lock = threading.Lock()

    def to(self, device) -> "PackedExperts":
        """Move the stored parts to `device` (decoding then runs there). Not a parameter,
        so `model.to(device)` leaves it: the first matmul on another device moves it."""
        device = torch.device(device)
        with self._lock:
            if device != self.device:
                for k, t in self.loader.held.items():
                    self.loader.held[k] = t.to(device)
                self.device = device
        return self

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.loader.held.values())

    def expert(self, e: int) -> torch.Tensor:
        """Expert e's weight (shape[1:]) in the compute dtype, decoded now."""
        g = self.group
        if g["mode"] == "experts":
            per = self.shape[0]
            selection: dict[str, list[int] | tuple[int, int]] = {
                "experts": [e + j * per for j in range(g["chunks"])]}
        elif g["mode"] == "rows":
            selection = {"rows": (e, e + 1)}
        else:
            raise UserError(f"{self.name}: its conversion cannot be run one expert at a time")
        with self._lock:
            self.decodes += 1
        out = run_step(self.fam, dict(g, dtype="F32"), self.loader, selection)[self.name]
        return out[0].to(self.dtype)

    def __getitem__(self, e) -> "ExpertView":
        return ExpertView(self, int(e))

    def materialize(self) -> torch.Tensor:
        return torch.stack([self.expert(e) for e in range(self.shape[0])])


class _PackedMatmul(torch.autograd.Function):
    """y = x @ W_e^T (linear) or x @ W_e (matmul), W_e decoded in forward and again in backward."""

    @staticmethod
    def forward(ctx, x, owner: PackedExperts, e: int, linear: bool):
        ctx.owner, ctx.e, ctx.linear = owner, e, linear
        if owner.device != x.device:
            owner.to(x.device)
        w = owner.expert(e).to(device=x.device, dtype=x.dtype)
        return F.linear(x, w) if linear else x @ w

    @staticmethod
    def backward(ctx, grad):
        w = ctx.owner.expert(ctx.e).to(device=grad.device, dtype=grad.dtype)
        return (grad @ w if ctx.linear else grad @ w.T), None, None, None


class ExpertView:
    """`PackedExperts[e]`: multiplies like the expert's weight without holding it."""

    def __init__(self, owner: PackedExperts, e: int):
        self.owner, self.e = owner, e
        self.shape = owner.shape[1:]
        self.dtype, self.device = owner.dtype, owner.device

    def tensor(self) -> torch.Tensor:
        return self.owner.expert(self.e)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and isinstance(args[1], ExpertView) and not isinstance(args[0], ExpertView):
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            y = _PackedMatmul.apply(args[0], args[1].owner, args[1].e, True)
            return y if bias is None else y + bias
        if func in (torch.matmul, torch.Tensor.__matmul__) and isinstance(args[1], ExpertView) \
                and not isinstance(args[0], ExpertView):
            return _PackedMatmul.apply(args[0], args[1].owner, args[1].e, False)
        # anything else: the decoded weight (correct; memory as an unpacked expert)
        args = tuple(a.tensor() if isinstance(a, ExpertView) else a for a in args)
        return func(*args, **kwargs)


def load_packed(path: str | Path, dtype: torch.dtype = torch.bfloat16, packed: bool = True):
    """The model of a quantised release, routed experts packed (or all decoded: packed=False,
    the bf16-dequantised base, for comparison).

    Returns:
        (model in eval mode on CPU, {expert tensor name: PackedExperts}).
    """

    path = Path(path)
    if packed:
        fixed_mmap_threshold()
    raw = read_checkpoint(path)
    fam = load_family(raw.config, str(path / "config.json"))
    ckpt = formats.logical_view(raw, fam)
    plan = plan_conversion(ckpt, fam, "fp32")
    experts = {p.name for p in classify(fam.meta, fam.config).params
               if p.kind in ("experts", "vision_experts") and len(p.shape) == 3}
    model = _empty_model(fam, dtype, eager=packed)
    state, held_experts = {}, {}
    for group in plan["groups"]:
        keys = [k for ks in group["sources"].values() for k in ks] + list(group["scales"].values())
        sources = {k: ckpt.tensors[k] for k in keys}
        is_packed = any(isinstance(s, formats.Packed) for s in sources.values())
        if packed and is_packed and set(group["targets"]) <= experts and group["mode"] != "whole":
            held = _held(sources)
            held_experts[next(iter(group["targets"]))] = PackedExperts(
                fam, group, sources, held, raw.config, dtype)
            continue
        loader = Loader(sources, block_size(raw.config))
        try:
            shapes = {k: v.shape for k, v in sources.items()}
            parts: dict[str, list] = {}
            for selection, _ in steps(group, shapes):
                for name, t in run_step(fam, group, loader, selection).items():
                    parts.setdefault(name, []).append(t)
        finally:
            loader.close()
        for name, pieces in parts.items():
            t = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
            state[name] = t.to(dtype) if t.is_floating_point() else t
    _install(model, state, held_experts, path)
    model._moeflow_packed = held_experts  # packed_experts(model): for stages, tests, benchmarks
    if packed:
        # the experts run transformers' eager loop, which indexes one expert at a time (ExpertView);
        # grouped_mm and the like read the fused weight whole, so no stage may switch to them
        model._can_set_experts_implementation = lambda: False
    return model, held_experts


def packed_experts(model) -> dict[str, PackedExperts]:
    """{name: PackedExperts} of a model load_packed built (through PEFT wrappers); {} else."""
    for m in (model, getattr(model, "get_base_model", lambda: None)()):
        held = getattr(m, "_moeflow_packed", None) if m is not None else None
        if held is not None:
            return held
    return {}


def fixed_mmap_threshold(nbytes: int = 64 << 10) -> bool:
    """Make glibc serve every block of `nbytes` or more by mmap, returned to the OS on free.

    Why: a packed base decodes and frees an expert's weights several thousand times a
    step, with mid-sized temporaries (unpacked codes, per-group scales, the bf16 copy),
    while the activations saved for backward are allocated between them. glibc raises its
    mmap threshold each time a mmapped block is freed, after which such blocks come from
    the heap; long-lived activations then pin the heap pages around the freed decode
    temporaries and RSS grows (a profile of benchmarks/bench_lora_packed.py's INT4 base,
    docs/release-formats.md; the benchmark's peak RSS is with this threshold).
    A fixed threshold (M_MMAP_THRESHOLD set explicitly) turns the rise off; 64 KB keeps
    the decode temporaries out of the heap. Returns False off glibc."""

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        return bool(libc and libc.mallopt(-3, nbytes))  # -3: M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


def _held(sources: dict) -> dict[str, torch.Tensor]:
    """The stored parts of a group's sources, read into memory as stored."""
    out = {}
    for info in sources.values():
        for _, part in (info.parts if isinstance(info, formats.Packed) else (("", info),)):
            out[part.name] = read_rows(part)
    return out


def _empty_model(fam, dtype, eager: bool = True):
    # lazy: transformers: heavy, loaded only when this runs
    import transformers

    config = copy.deepcopy(fam.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    if eager:
        config._experts_implementation = "eager"  # the loop that indexes one expert at a time
    cls = getattr(transformers, type(fam.meta).__name__)
    with torch.device("meta"):
        model = cls._from_config(config, dtype=dtype)
    return model


def _install(model, state: dict, held: dict, path: Path) -> None:
    """Load `state` (assign) and put each PackedExperts where its parameter was."""
    meta_names = set(model.state_dict())
    missing = sorted(meta_names - set(state) - set(held)
                     - set(getattr(model, "all_tied_weights_keys", None) or {}))
    if missing:
        raise UserError(f"{path}: no weights for {missing[0]}" + (f" (and {len(missing) - 1} more)"
                                                                   if len(missing) > 1 else ""))
    for name, pw in held.items():
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        del owner._parameters[attr]
        setattr(owner, attr, pw)
    model.to_empty(device="cpu")
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    _init_buffers(model)
    model.requires_grad_(False)
    model.eval()


def _init_buffers(model) -> None:
    """Non-persistent buffers (rotary inverse frequencies) were left empty on meta: take
    them from a fresh instance of their module, built on CPU from its own config."""
    for module in model.modules():
        persistent = set(module.state_dict(keep_vars=True))
        lost = [n for n, _ in module.named_buffers(recurse=False) if n not in persistent]
        if not lost:
            continue
        config = getattr(module, "config", None)
        if config is None:
            raise UserError(f"{type(module).__name__}: cannot rebuild its buffers {lost}")
        fresh = type(module)(config=config)
        for name in lost:
            setattr(module, name, getattr(fresh, name))
        for attr in ("attention_scaling", "original_inv_freq"):
            if hasattr(fresh, attr):
                setattr(module, attr, getattr(fresh, attr))
