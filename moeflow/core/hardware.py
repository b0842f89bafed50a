"""Hardware descriptions for the planner: `cluster/hardware/<name>.yaml`.

A spec names the devices of one node, how many nodes there are, each
device's memory and throughput, and the three link speeds that decide where a
parallel group may live: inside a node, inside the high-bandwidth domain
(HBD: a super-node's fabric can span many nodes), and between HBDs.

    python -c "from moeflow.core.hardware import load_hardware; print(load_hardware('h100-80g-x8', nodes=2))"
"""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import Field, ValidationError, model_validator

from moeflow.core.errors import UserError
from moeflow.core.sections import Section

HARDWARE_DIR = Path(__file__).resolve().parents[2] / "cluster" / "hardware"
GB = 1e9  # device memory and bandwidths are decimal, as vendors state them
# a CPU process with glibc's and oneDNN's defaults peaked at up to 3.1x its plan (370 MB against
# 119 in the rehearsal's finetune; moeflow.training.worker.cpu_rank_memory): below this many
# times its plan a CPU device gets the tight settings (finetune ranks, vLLM's CPU workers)
TIGHT_DEVICE_FACTOR = 4.0


def tight_device(device_bytes: float | None, planned_bytes: float | None) -> bool:
    """Whether a device of `device_bytes` is under TIGHT_DEVICE_FACTOR x a process planned at
    `planned_bytes` (both known); the callers say which devices are CPUs."""
    return bool(device_bytes and planned_bytes and device_bytes < TIGHT_DEVICE_FACTOR * planned_bytes)


class HardwareSpec(Section):
    """One hardware description (all figures per device unless named otherwise)."""

    name: str
    accelerator: str = ""
    ray_accelerator_type: str | None = None  # Ray's label (ray.util.accelerators): H100, A100-80G, ...
    devices_per_node: int = Field(ge=1)
    nodes: int = Field(default=1, ge=1)
    memory_per_device_gb: float = Field(gt=0)
    hbm_bandwidth_gbs: float = Field(gt=0)  # memory bandwidth: bounds decode
    bf16_tflops: float = Field(gt=0)
    fp8_tflops: float | None = None  # None: no FP8 compute (FP8 weights are upcast)
    int8_tops: float | None = None
    intra_node_bandwidth_gbs: float = Field(gt=0)
    inter_node_bandwidth_gbs: float = Field(gt=0)
    hbd_size: int | None = Field(default=None, ge=1)  # None: one node is the HBD
    inter_hbd_bandwidth_gbs: float | None = None  # None: inter_node_bandwidth_gbs
    runtime_overhead_gb: float = Field(default=2.0, ge=0)
    # optional, for `moeflow run --dry-run` (moeflow/parallel/estimate.py): cost and the shared store
    price_per_device_hour: float | None = Field(default=None, ge=0)
    storage_read_gbs: float | None = Field(default=None, gt=0)  # per node, from the workdir's store
    storage_write_gbs: float | None = Field(default=None, gt=0)  # per node, to it
    storage_free_tb: float | None = Field(default=None, ge=0)  # free space of that store
    source: str = ""  # where the file came from (set by load_hardware)

    @model_validator(mode="after")
    def _check(self) -> "HardwareSpec":
        if self.hbd_size is None:
            self.hbd_size = self.devices_per_node
        if self.hbd_size % self.devices_per_node:
            raise ValueError(f"hbd_size {self.hbd_size} is not a multiple of "
                             f"devices_per_node {self.devices_per_node}")
        return self

    @property
    def world_size(self) -> int:
        return self.devices_per_node * self.nodes

    @property
    def memory_bytes(self) -> float:
        return self.memory_per_device_gb * GB

    def tight(self, planned_bytes: float) -> bool:
        """A CPU device too small for torch's and glibc's defaults around a process planned at
        `planned_bytes`: under TIGHT_DEVICE_FACTOR x that (the rehearsal's 150 MB devices)."""
        return self.cpu_devices and tight_device(self.memory_bytes, planned_bytes)

    @property
    def cpu_devices(self) -> bool:
        """Devices that are CPU workers (host memory is device memory; vLLM's CPU build serves)."""
        return "cpu" in (self.accelerator or "").lower()

    def peak_flops(self, dtype: str = "bf16") -> float:
        """Dense FLOP/s of one device for matmuls in `dtype` (bf16 when unsupported)."""
        if dtype == "fp8" and self.fp8_tflops:
            return self.fp8_tflops * 1e12
        if dtype == "int8" and self.int8_tops:
            return self.int8_tops * 1e12
        return self.bf16_tflops * 1e12

    def link_bandwidth(self, span: int) -> float:
        """Bytes/s per device of a collective over `span` consecutive devices.

        Args:
            span: devices the group covers (consecutive ranks, TP innermost).
        Returns:
            intra-node bandwidth inside a node, the HBD fabric inside the
            high-bandwidth domain, the inter-HBD network beyond it.
        """
        if span <= self.devices_per_node:
            return self.intra_node_bandwidth_gbs * GB
        if span <= (self.hbd_size or self.devices_per_node):
            return self.inter_node_bandwidth_gbs * GB
        return (self.inter_hbd_bandwidth_gbs or self.inter_node_bandwidth_gbs) * GB

    def with_nodes(self, nodes: int) -> "HardwareSpec":
        return self.model_copy(update={"nodes": nodes})

    def describe(self) -> str:
        return (f"{self.name}: {self.nodes} x {self.devices_per_node} x "
                f"{self.memory_per_device_gb:g} GB {self.accelerator}".rstrip())


def list_hardware() -> list[str]:
    """Names of the shipped hardware specs."""
    return sorted(p.stem for p in HARDWARE_DIR.glob("*.yaml"))


def resolve_hardware_path(spec: str) -> Path:
    """A spec name (`h100-80g-x8`) or a YAML path -> an existing file."""
    path = Path(spec)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.is_file():
            raise UserError(f"hardware spec not found: {spec}")
        return path
    named = HARDWARE_DIR / f"{spec}.yaml"
    if not named.is_file():
        raise UserError(f"unknown hardware {spec!r}; shipped: {', '.join(list_hardware())} "
                        f"(or give a path to a YAML spec)")
    return named


def load_hardware(spec: str, nodes: int | None = None) -> HardwareSpec:
    """Load a hardware spec by name or path.

    Args:
        spec: name under cluster/hardware/ or a path to a YAML file.
        nodes: override the spec's node count.
    Returns:
        The validated HardwareSpec.
    Raises:
        UserError: missing file, bad YAML, or a bad field (named).
    """
    path = resolve_hardware_path(spec)
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise UserError(f"{path}: invalid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise UserError(f"{path}: a hardware spec must be a mapping")
    raw.setdefault("name", path.stem)
    try:
        hw = HardwareSpec.model_validate(dict(raw, source=str(path)))
    except ValidationError as exc:
        err = exc.errors()[0]
        key = ".".join(str(p) for p in err["loc"]) or "<root>"
        raise UserError(f"{path}: `{key}`: {err['msg']}") from None
    if nodes is not None:
        if nodes < 1:
            raise UserError(f"--nodes must be >= 1 (got {nodes})")
        hw = hw.with_nodes(nodes)
    return hw
