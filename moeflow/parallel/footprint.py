"""Bytes one worker of a stage holds when the stage never holds the model: one decoder layer
resident (layer-streamed), or one layer's routed experts split into groups, each group a
worker (calibrate). The planner's memory per rank of a parallel plan is moeflow/parallel/memory.py;
these are the stages that run outside such a plan.

Legend: E routed experts of a layer, G expert groups, T tokens recorded, H hidden.

    python -c "from moeflow.parallel.footprint import calibrate_layout"   # library
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from moeflow.core.hardware import GB, HardwareSpec
from moeflow.model.params import EXPERT_KINDS, ModelSpec, ParamCount

F32 = 4  # calibrate builds each layer in float32, the compare's dtype
# a calibrate worker's compute runtime beside its part: torch's kernels paged in and their
# buffers at the process's first forward, and Ray's call buffers (measured on the
# rehearsal's CPU workers: about 10 MB retained after the first forward, 20-25 MB in all
# above the part and its reads; benchmarks/rehearse_streamed.py)
WORKER_RUNTIME = 32e6


def unit_params(spec: ModelSpec) -> tuple[int, int]:
    """(parameters of the largest decoder layer, parameters outside the layers): what a
    layer-streamed stage holds at once (moeflow.quant.streamed)."""
    per: dict[int, int] = {}
    outer = 0
    for t in spec.tensors:
        if t.layer is None:
            outer += t.numel
        else:
            per[t.layer] = per.get(t.layer, 0) + t.numel
    return max(per.values(), default=0), outer


def fits_one_device(counts: ParamCount, hw: HardwareSpec, dtype_bytes: float) -> bool:
    """The whole model in a compute dtype of `dtype_bytes` fits one device (the stages'
    `auto` choice between loading it and streaming it)."""
    return counts.total * dtype_bytes <= hw.memory_bytes


def streamed_bytes(spec: ModelSpec, dtype_bytes: float, carried: float) -> float:
    """A layer-streamed forward: the front (embeddings, vision tower, head) and the largest
    decoder layer in the compute dtype, plus the `carried` bytes (hidden states, caches)."""
    layer, outer = unit_params(spec)
    return (layer + outer) * dtype_bytes + carried


@dataclass
class LayerSplit:
    """One decoder layer as calibrate's workers split it (elements)."""

    dense: int  # attention, dense / shared MLP, router, norms: the designated group holds them
    experts: int  # routed experts, all E of them
    num_experts: int
    largest_dense: int  # largest tensor outside the experts (read in its stored dtype, then cast)
    largest_expert: int  # largest routed-expert tensor, all E experts


def layer_splits(spec: ModelSpec) -> list[LayerSplit]:
    """Each decoder layer's dense and routed-expert elements (the unit calibrate splits)."""
    out = [LayerSplit(0, 0, spec.num_experts, 0, 0) for _ in range(spec.layers)]
    for t in spec.tensors:
        if t.layer is None or t.layer >= spec.layers:
            continue
        s = out[t.layer]
        if t.kind in EXPERT_KINDS:
            s.experts += t.numel
            s.largest_expert = max(s.largest_expert, t.numel)
        else:
            s.dense += t.numel
            s.largest_dense = max(s.largest_dense, t.numel)
    return out


def group_bytes(s: LayerSplit, groups: int, stored: float) -> float:
    """The fullest worker of a layer split into `groups` expert groups: the layer's dense part
    and ceil(E / G) experts in float32, plus what it reads beside them, bounded by the
    largest tensor of its share in its stored dtype (`stored` bytes per element): the
    workers assemble their experts one at a time (moeflow.quant.groups.expert_runtime_state)."""
    share = math.ceil(s.num_experts / groups) / s.num_experts if s.num_experts else 0.0
    largest = max(s.largest_dense, s.largest_expert * share)
    return (s.dense + s.experts * share) * F32 + largest * stored


@dataclass
class CalibrateLayout:
    """How calibrate splits its work, and the bytes of its fullest process.

    workers = layer_workers x expert_groups; a worker holds one layer's dense part (in one
    designated group) and its expert group, in float32, the layer's recorded inputs and its
    compute runtime (WORKER_RUNTIME); the stage task holds everything outside the layers
    and the golden set's hidden states."""

    layer_workers: int
    expert_groups: int
    worker_bytes: float  # the fullest worker (the stage task itself when it runs alone)
    front_bytes: float  # the stage task beside its workers
    why: list[str] = field(default_factory=list)

    @property
    def workers(self) -> int:
        return self.layer_workers * self.expert_groups if self.split else 0

    @property
    def split(self) -> bool:
        return self.layer_workers * self.expert_groups > 1

    @property
    def memory_bytes(self) -> float:
        """Memory per device of the fullest process."""
        return max(self.worker_bytes, self.front_bytes) if self.split else self.worker_bytes


def calibrate_layout(spec: ModelSpec, counts: ParamCount, hw: HardwareSpec, layer_workers: int | str,
                     expert_groups: int | str, stored: float, tokens: float) -> CalibrateLayout:
    """calibrate.layer_workers and calibrate.expert_groups resolved as the stage runs them.

    Args:
        stored: bytes per element of the checkpoint calibrate reads (the converted model).
        tokens: golden-set tokens recorded (samples x tokens per sample).
        layer_workers, expert_groups: the settings ("auto" or an int).
    Returns:
        auto layer_workers: 1 while the model in float32 fits one device, else one worker
        per device of a node; auto expert_groups: the fewest groups whose fullest worker fits
        one device less its runtime overhead (1 when a whole layer does).
    """
    recorded = tokens * spec.hidden * F32 * 4  # inputs and outputs of both sides
    front = unit_params(spec)[1] * F32 + recorded
    splits = layer_splits(spec)
    if layer_workers == "auto":
        lw = 1 if fits_one_device(counts, hw, F32) else min(spec.layers, hw.devices_per_node)
    else:
        lw = min(int(layer_workers), spec.layers)
    most = max(1, spec.num_experts)

    def worker(g: int) -> float:
        return max((group_bytes(s, g, stored) for s in splits), default=0.0) + recorded + WORKER_RUNTIME

    budget = hw.memory_bytes - hw.runtime_overhead_gb * GB
    why = []
    if expert_groups == "auto":
        groups = next((g for g in range(1, most + 1) if worker(g) <= budget), most)
        if groups > 1:
            why.append(f"one layer's worker needs {worker(1) / 1e9:.3g} GB in float32: its "
                       f"{spec.num_experts} experts split into {groups} groups")
    else:
        groups = min(int(expert_groups), most)
    if lw * groups == 1:
        return CalibrateLayout(1, 1, worker(1) + front - recorded, front, why)
    return CalibrateLayout(lw, groups, worker(groups), front, why)
