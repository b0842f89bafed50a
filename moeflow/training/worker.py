"""What a Ray Train worker of LoRA fine-tuning is handed and what it holds.

  WorkerConfig   the driver's hand-over (moeflow.training.driver): built from the pipeline's
                 typed config sections, pickled to every worker by Ray Train
                 (`train_loop_config`); the same for every rank
  AdapterJob     one adapter of the run: its name, finetune section, packed data, MLflow run
  LoadedBase     what a worker loads once and every adapter shares: the frozen base, its
                 tokenizer, this rank's process groups, the plan check of its loaded bytes
  AdapterState   one adapter being trained on that base: the PEFT model, its optimizer and
                 scheduler, router hooks and data iterator (moeflow.training.trainer)
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from moeflow.core.config import LoraSection, OptimizerSection, PipelineConfig
from moeflow.core.hardware import tight_device
from moeflow.core.memmeter import PeakMemory
from moeflow.core.sections.finetune import FinetuneSection
from moeflow.model.packed_base import fixed_mmap_threshold
from moeflow.training.data import Dataset
from moeflow.training.lora import Targets
from moeflow.training.parallel import Degrees, Layout
from moeflow.training.steps import RouterTap

if TYPE_CHECKING:  # types only: the worker imports peft and transformers where it loads models
    from peft import PeftModel
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


@dataclass(frozen=True)
class AdapterJob:
    """One adapter a worker trains on the shared base (its data and finetune section are its
    own; the base, LoRA shape, optimizer and seed are the run's)."""

    name: str  # its directory in a checkpoint: jobs/<name>/
    finetune: FinetuneSection
    dataset: Dataset
    mlflow_run_id: str | None = None  # the run rank 0 logs into (None: no logging)
    label: str = ""  # its name in lines the user reads ("" for the main adapter)

    @property
    def progress_label(self) -> str:
        """What the driver's progress bar says of its steps."""
        return f"{self.label or 'training'} steps"


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a worker needs, the same on every rank (`WorkerConfig.build` from the
    pipeline config; Ray Train pickles it to each worker)."""

    base_dir: str  # the checkpoint the workers load (the converted one)
    dtype: str  # model.dtype
    seed: int
    lora: LoraSection
    optimizer: OptimizerSection
    jobs: tuple[AdapterJob, ...] = ()  # in training order
    degrees: Degrees = field(default_factory=Degrees)
    experts_impl: str = "grouped_mm"  # transformers' experts implementation for training
    recompute: bool = False  # the plan turns gradient checkpointing on
    planned_rank_bytes: tuple[int, ...] | None = None  # base bytes the plan gives each rank
    planned_peak_bytes: float | None = None  # the plan's per-device peak
    device_bytes: float | None = None  # memory per device of the hardware the plan was sized for
    use_gpu: bool = False  # one GPU per worker (NCCL), else gloo on CPU
    tracking_uri: str | None = None  # the MLflow store of the jobs' runs
    status_dir: str | None = None  # rank pid files and progress.json
    progress_file: str | None = None  # the driver's progress bar (tasks.base.PROGRESS)

    @staticmethod
    def plan_memory(plan: dict[str, Any]) -> dict[str, float | None]:
        """planned_peak_bytes and device_bytes from a plan record (plan.json): its per-device
        peak and the memory per device of the hardware it was sized for (None where absent)."""
        peak = plan.get("memory_per_device_gb") or (plan.get("memory") or {}).get("total_gb")
        hw = plan.get("hardware")
        device = hw.get("memory_per_device_gb") if isinstance(hw, dict) else None
        return {"planned_peak_bytes": float(peak) * 1e9 if peak else None,
                "device_bytes": float(device) * 1e9 if device else None}

    @classmethod
    def build(cls, cfg: PipelineConfig, base_dir: str | Path, jobs: list[AdapterJob] | None = None,
              **kwargs) -> WorkerConfig:
        """From the pipeline config's sections (model dtype, seed, lora, optimizer); `kwargs`
        set the rest (what the plan and the stage decided)."""
        return cls(base_dir=str(base_dir), dtype=cfg.model.dtype, seed=cfg.seed, lora=cfg.lora,
                   optimizer=cfg.optimizer, jobs=tuple(jobs or ()), **kwargs)


@dataclass
class LoadedBase:
    """The frozen base a worker loads once; `model` is swapped back in after each adapter
    (PEFT `unload`)."""

    model: PreTrainedModel
    tok: PreTrainedTokenizerBase
    plan_check: dict[str, float]  # moeflow.training.trainer._check_rank_bytes
    rank: int
    world: int
    layout: Layout
    meter: PeakMemory | None = None  # started just before the base's first tensor is read
    load_peak: int | None = None  # its peak when the base was loaded


@dataclass
class AdapterState:
    """One adapter in training on a `LoadedBase`: dead once taken off it (trainer._release)."""

    job: AdapterJob
    base: LoadedBase
    model: PeftModel
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler
    opt_cfg: OptimizerSection
    targets: Targets
    sizes: dict[str, float]  # moeflow.training.lora.apply_lora: trainable / total / bytes
    tap: RouterTap | None  # router hooks (None: no routed experts)
    num_experts: int  # routed experts per MoE layer (0: dense)
    batches: Iterator[tuple[int, dict[str, torch.Tensor]]]  # (epoch, micro-batch), endless
    pad: int | None  # the pad token id of generation (the eos token where none)
    sharded: bool  # the base is DTensor-sharded: its forwards are collective

    @property
    def ft(self) -> FinetuneSection:
        return self.job.finetune

    @property
    def ds(self) -> Dataset:
        return self.job.dataset

    @property
    def tok(self) -> PreTrainedTokenizerBase:
        return self.base.tok

    @property
    def rank(self) -> int:
        return self.base.rank

    @property
    def world(self) -> int:
        return self.base.world

    @property
    def layout(self) -> Layout:
        return self.base.layout

    @property
    def plan_check(self) -> dict[str, float]:
        return self.base.plan_check


def import_first(cfg: WorkerConfig, rank: int = 0) -> None:
    """Import what loading and training the base import (its model classes, built once on
    meta; PEFT; MLflow for rank 0's tracker, and its tracking store) before a rank's meter
    starts, so its peak counts the tensors it holds, not code (some 200 MB of modules;
    MLflow's SQL store alone adds 64 MB on first use, measured: rank 0 peaked 48 MB above
    the other ranks in the rehearsal before it was opened here)."""
    # lazy: transformers, peft, mlflow: heavy; what load_base and the tracker import next
    import mlflow  # noqa: F401
    import peft  # noqa: F401
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.distributed import DistributedConfig  # noqa: F401

    import moeflow.model.split_lora  # noqa: F401

    if rank == 0 and cfg.tracking_uri and any(j.mlflow_run_id for j in cfg.jobs):
        # lazy: mlflow: heavy, and only rank 0 logs
        from mlflow.tracking import MlflowClient

        MlflowClient(tracking_uri=cfg.tracking_uri)  # opens (and MLflow keeps) the store the Tracker uses
    try:
        config = AutoConfig.from_pretrained(str(cfg.base_dir))
        with torch.device("meta"):
            AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError, OSError):  # a class load_base picks otherwise: imported there
        pass
    if not cfg.use_gpu:
        _page_in_kernels(getattr(torch, cfg.dtype, torch.float32))


def _page_in_kernels(dtype: "torch.dtype") -> None:
    """Run, on a few KB of tensors, the CPU kernels a training step calls (matmul and its
    backward, softmax / top-k routing, gather / scatter-add, SDPA and its backward, embedding
    backward, cross-entropy, AdamW) in the model's dtype, so their code is paged in before the
    rank's meter starts: in the rehearsal, the first step paged in about 8 MB of torch's code,
    runtime the meter would otherwise book as the model's."""

    w = torch.randn(32, 16, dtype=dtype, requires_grad=True)
    emb = torch.nn.Embedding(64, 16).to(dtype)
    ids = torch.randint(0, 64, (2, 8))
    x = emb(ids)
    h = F.silu(F.linear(x, w)) @ w
    gate = torch.softmax(F.linear(h, w[:4]).float(), dim=-1)
    top, idx = torch.topk(gate, 2, dim=-1)
    flat = h.reshape(-1, 16)
    mixed = torch.zeros_like(flat).index_add(0, idx[..., 0].reshape(-1), flat * top[..., :1].reshape(-1, 1).to(dtype))
    q = mixed.reshape(2, 1, 8, 16)
    att = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    logits = F.linear(F.rms_norm(att.reshape(2, 8, 16), (16,)), emb.weight)
    loss = F.cross_entropy(logits.float().reshape(-1, 64), ids.reshape(-1))
    loss.backward()
    opt = torch.optim.AdamW([w, *emb.parameters()], lr=1e-3)
    opt.step()
    opt.zero_grad(set_to_none=True)


def tight_cpu_rank(cfg: WorkerConfig) -> bool:
    """Whether a CPU rank's device is too small for torch's default allocator and kernel
    caches: the plan's peak and the plan's device memory known, and the device under
    TIGHT_DEVICE_FACTOR x that peak (the rehearsal's 150 MB device; not the demo's 12.8 GB)."""
    return not cfg.use_gpu and tight_device(cfg.device_bytes, cfg.planned_peak_bytes)


def cpu_rank_memory() -> None:
    """A CPU rank's memory settings where its device is tight, made before its first tensor.

    Measured per phase in 4 gloo ranks of the rehearsal's finetune (EP4 FSDP4 CP2, 20 layers
    of bf16 Qwen3-MoE, 3 steps; docs/streamed.md): each rank's peak grew 25-45 MB a step,
    to 300-370 MB against a 76 MB weight share, while the tensors Python can see stayed
    constant. Two causes, each removed here:
      - oneDNN (torch's mkldnn backend) runs CPU bf16 matmuls and keeps a primitive, with
        its buffers, per matmul shape; expert parallelism gives the experts' matmuls new
        row counts every step (tokens routed to each expert), so that cache only grew.
        torch's own CPU kernels keep nothing (`torch.backends.mkldnn.enabled = False`);
      - glibc raises its mmap threshold each time a mmapped block is freed, after which a
        step's activations and FSDP all-gathers come from the heap, which keeps the freed
        pages resident: a fixed 64 KB threshold returns them (moeflow.model.packed_base).
    With both the peaks were 144-150 MB (one unit of all of them: the weight pages the rank
    touches, torch's code paged in, the step's transients). The price: a bf16 matmul on CPU
    without oneDNN took 26x the CPU time of a cached oneDNN one ([64, 384] x [384, 768] with
    its backward); oneDNN with its caches off (ONEDNN_PRIMITIVE_CACHE_CAPACITY=0,
    LRU_CACHE_CAPACITY=1) took 2.5x, but its ranks peaked at 146-154 MB. float32 (the CPU
    demo's dtype) runs the same kernels either way; the fixed threshold made a float32 step
    of the demo model cost 1.4-1.9x the CPU (the heap's freed pages reused, mmap's zeroed
    again). So a rank takes them only where its device is tight (`tight_cpu_rank`)."""
    torch.backends.mkldnn.enabled = False  # type: ignore[assignment]  # a ContextProp: this sets the flag
    fixed_mmap_threshold()


def own_weights(model: torch.nn.Module) -> int:
    """A tight CPU rank's weights copied out of the checkpoint's file mappings into memory of its
    own, one decoder layer (one module with parameters of its own) at a time; returns the bytes
    copied.

    transformers leaves a CPU model's weights as views of the safetensors files it maps, FSDP2's
    shards included (a shard needing no padding stays the loaded view). A forward then maps the
    file's pages as it reads them, and on this kernel a page-cache read maps the whole large folio
    around the page, so a rank reading its shard of a tensor maps its neighbours' shards too: the
    rehearsal's 8 ranks of a 40-layer model held more of the layer files than their shards. Each
    layer's state is replaced through `load_state_dict(assign=True)` (FSDP2 re-derives its shards
    from the new tensors in its load hook), after which nothing holds the layer's file views. Where
    each layer has a file of its own (convert's layout) its mapping then goes, so the copy peaks
    at the weights copied so far plus one layer's file pages; a file holding several layers stays
    mapped until the last of them is copied. The front and the head stay mapped (a small share)."""
    nn = torch.nn
    copied = 0

    def own(module: nn.Module) -> None:
        nonlocal copied
        state = module.state_dict(keep_vars=True)
        if not state:
            return
        fresh = {}
        for name, t in state.items():
            if not isinstance(t, torch.Tensor):  # a module's extra state: not a weight
                fresh[name] = t
                continue
            local = t.to_local() if hasattr(t, "to_local") else t
            if local.is_meta:
                fresh[name] = t
                continue
            copy = local.detach().clone()
            copied += copy.numel() * copy.element_size()
            if hasattr(t, "to_local"):
                # lazy: torch.distributed.tensor: only a sharded base (FSDP / EP) has DTensors
                from torch.distributed.tensor import DTensor

                sharded: Any = t  # a DTensor: its mesh and placements
                copy = DTensor.from_local(copy, sharded.device_mesh, sharded.placements, run_check=False,
                                          shape=t.shape, stride=t.stride())
            fresh[name] = nn.Parameter(copy, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else copy
        module.load_state_dict(fresh, assign=True)

    done: set[int] = set()
    for group in [m for m in model.modules() if isinstance(m, nn.ModuleList)]:  # the decoder layers
        for layer in group:
            ids = {id(p) for p in layer.parameters()}
            if ids and not ids <= done:  # (a list inside a layer already owned: skipped)
                own(layer)
                done |= {id(p) for p in layer.parameters()}
    # the front and the head (embeddings, final norm, lm_head) stay mapped: a small share
    return copied
