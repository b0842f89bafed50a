"""The dry run's vocabulary: a stage's time as named terms with their bases, the stage
estimates and checks, what the dry run gathered, and the rates (bandwidths, FLOP/s, the
host-measured constants) it prices with. The bases:

  measured  a host cost (process starts, Ray Train set-up, per-step Python overhead) fitted
            from recorded pipeline runs on ANCHOR_HOST by benchmarks/fit_dryrun.py
            ("measured: cpu-local (fitted: NAME)"); a host cost no recorded run measures on
            its own is "assumed: NAME on cpu-local". Both are the constants in
            moeflow/parallel/estimate_constants.py, each with its provenance, used as they are on any
            spec; when the spec is ANCHOR_HOST's own, they are scaled by a probe of the host
            the dry run runs on (probe_host / ANCHOR_PROBE_S: VMs of one kind differ in speed);
  published a figure the hardware spec states (vendor FLOP/s, HBM and link bandwidth, storage
            speed) fed through the cost model (moeflow/parallel/cost.py: MFU 0.4);
  assumed   a default moeflow cannot know (storage speed when the spec names none, bytes per
            token without a tokenizer); every one is a key of the `estimate:` config section.

    python -c "from moeflow.parallel.pricing import Rates"   # library; moeflow/parallel/estimate.py
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from moeflow.core.hardware import GB, HardwareSpec
from moeflow.parallel.cost import MFU
from moeflow.parallel.estimate_constants import ANCHOR_PROBE_S, CONSTANTS

# ---- host-measured constants: seconds on ANCHOR_HOST at probe time ANCHOR_PROBE_S, each with
# its provenance (fitted from recorded runs, or assumed) in moeflow/parallel/estimate_constants.py,
# which benchmarks/fit_dryrun.py writes from the runs in benchmarks/data/dryrun_runs.json
ANCHOR_HOST = "cpu-local"  # the 2-core x86 VM the demo runs on (cluster/hardware/cpu-local.yaml)
# the ones the code reads by name; every term names its constant (Rates.fixed)
PROCESS_START_S = CONSTANTS["PROCESS_START_S"]["value"]  # a fresh Ray worker's imports
CORE_START_S = CONSTANTS["CORE_START_S"]["value"]  # deploy.engine_process: a replica's engine core
COMPILE_WARMUP_S = CONSTANTS["COMPILE_WARMUP_S"]["value"]  # deploy.compile, cold Inductor cache
PIPELINE_START_S = CONSTANTS["PIPELINE_START_S"]["value"]  # the parent run beyond its stages
ANCHOR_PEAK_TFLOPS = 0.19  # cpu-local.yaml bf16_tflops: what the measured work is scaled from
# ANCHOR_PROBE_S (estimate_constants.py) is probe_host()'s time on ANCHOR_HOST: a dry run for the
# anchor spec times the probe on the host it runs on and scales every host-measured term (and
# the CPU's FLOP/s) by the ratio, so the same constants price a faster or a slower VM of that
# kind (docs/dryrun.md, "This host")

# ---- assumed when neither the config's `estimate:` nor the hardware spec says
STORAGE_READ_GBS = 2.0
STORAGE_WRITE_GBS = 1.0


@dataclass
class Term:
    """One addend of a stage's time and what it rests on."""

    what: str
    seconds: float
    basis: str  # "measured on ...", "published: ...", "assumed: ..."
    const: str = ""  # the host-measured constant it is built from (benchmarks/fit_dryrun.py)
    coef: float = 0.0  # seconds = CONSTANTS[const] x coef (units x host factor)


@dataclass
class StageEstimate:
    name: str
    placement: str  # where it runs: Ray resources, nodes
    devices: int  # accelerators (or CPU cores on a CPU spec) it holds while it runs
    nodes: int
    memory_per_device: float  # bytes
    bytes_read: float
    bytes_written: float
    terms: list[Term] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    upstream: tuple[str, ...] = ()
    after: tuple[str, ...] = ()  # stages it waits for when they run (StageSpec.after), not its inputs

    @property
    def seconds(self) -> float:
        return sum(t.seconds for t in self.terms)

    @property
    def device_hours(self) -> float:
        return self.devices * self.seconds / 3600

    def basis(self) -> str:
        """The basis of the term that dominates this stage's time."""
        return max(self.terms, key=lambda t: t.seconds).basis if self.terms else "-"

    def as_dict(self, price: float | None) -> dict[str, Any]:
        return {"stage": self.name, "placement": self.placement, "devices": self.devices,
                "nodes": self.nodes, "memory_per_device_bytes": self.memory_per_device,
                "bytes_read": self.bytes_read, "bytes_written": self.bytes_written,
                "seconds": self.seconds, "device_hours": self.device_hours,
                "cost": None if price is None else self.device_hours * price,
                "basis": self.basis(), "upstream": list(self.upstream),
                "terms": [t.__dict__ for t in self.terms], "notes": self.notes}


@dataclass
class Check:
    """Something a real run would find late: ok, warn (worth a look) or fail (it would fail)."""

    name: str
    status: str
    message: str


@dataclass
class Inputs:
    """What the dry run gathered (workflows/dryrun.py): no weights, no Ray."""

    cfg: Any  # PipelineConfig
    hw: HardwareSpec
    spec: Any  # params.ModelSpec
    counts: Any  # params.ParamCount
    stage_specs: dict[str, Any]  # enabled stages (tasks.base.StageSpec), optional edges folded
    lora: Any  # planner Candidate of the finetune plan (None: no LoRA plan)
    lora_work: Any  # its memory.Workload: finetune's micro-batch, grad_accum and recompute
    # moeflow.parallel.workload.serving_inputs: backend, replicas, devices_per_replica,
    # memory_bytes, tpot_s, ttft_s, tok_s; "search": one serving-search candidate
    serve: dict[str, Any]
    src_bytes: float
    src_basis: str
    converted_bytes: float
    quantised_bytes: float
    adapter_bytes: float
    plan_seconds: float  # the planner's time, measured in this dry run
    suite: dict[str, float]  # records, prompt_tokens, gen_tokens, streamed_passes (a layer-streamed eval's passes)
    data: list[dict[str, Any]]  # per adapter: name, path, tokens, rows, max_steps, basis
    profile: dict[str, Any] | None  # traffic profile: rate, burst, SLOs, mean lengths
    storage_free: tuple[float | None, str]  # bytes free for outputs, and where that came from
    plan_checks: list[Check] = field(default_factory=list)  # the planner's verdicts
    host_probe_s: float | None = None  # probe_host() here, when the spec is ANCHOR_HOST's


@dataclass
class PipelineEstimate:
    stages: list[StageEstimate]
    checks: list[Check]
    critical_path: list[str]
    wall_s: float
    world: int
    price: float | None
    assumptions: dict[str, str]
    host: float = 1.0  # the host factor its host-measured terms were scaled by

    @property
    def device_hours(self) -> float:
        return sum(s.device_hours for s in self.stages)

    @property
    def booked_device_hours(self) -> float:
        return self.world * self.wall_s / 3600

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if c.status == "fail"]

    @property
    def refused(self) -> list[Check]:
        """Stages that cannot run as planned (memory over a device, more devices than the spec
        has): the dry run exits 2."""
        return [c for c in self.failed if c.name.startswith(("memory.", "devices."))]

    def as_dict(self) -> dict[str, Any]:
        p = self.price
        return {"stages": [s.as_dict(p) for s in self.stages],
                "checks": [c.__dict__ for c in self.checks],
                "critical_path": self.critical_path, "wall_s": self.wall_s,
                "device_hours": self.device_hours, "booked_device_hours": self.booked_device_hours,
                "cost": None if p is None else self.device_hours * p,
                "booked_cost": None if p is None else self.booked_device_hours * p,
                "price_per_device_hour": p, "world": self.world, "assumptions": self.assumptions,
                "host_factor": self.host}


# ------------------------------------------------------------ rates and their bases


class Rates:
    """The bandwidths, FLOP/s and fixed costs an estimate uses, each with its basis."""

    def __init__(self, inp: Inputs):
        est, hw = inp.cfg.estimate, inp.hw
        self.hw = hw
        self.mfu: float
        self.mfu_basis: str
        self.mfu, self.mfu_basis = ((est.mfu, f"assumed: {hw.name} FLOP/s, MFU {est.mfu:g}")
                                    if est.mfu else (MFU, f"published: {hw.name} FLOP/s, MFU {MFU}"))
        self.read, self.read_basis = _pick(est.storage_read_gbs, hw.storage_read_gbs,
                                           STORAGE_READ_GBS, "storage_read_gbs", hw.name)
        self.write, self.write_basis = _pick(est.storage_write_gbs, hw.storage_write_gbs,
                                             STORAGE_WRITE_GBS, "storage_write_gbs", hw.name)
        # the job runs on a host of the anchor's kind: its own speed, probed in this dry run
        self.host = (inp.host_probe_s / ANCHOR_PROBE_S
                     if inp.host_probe_s and ANCHOR_PROBE_S and hw.name == ANCHOR_HOST else 1.0)
        self.measured = f"measured: {ANCHOR_HOST}" + (
            f", x{self.host:.2f} by this host's probe" if self.host != 1.0 else "")
        self.start_override = est.process_start_s
        self.start = PROCESS_START_S * self.host if est.process_start_s is None else est.process_start_s
        self.start_basis = self.measured if est.process_start_s is None else "assumed: estimate.process_start_s"
        self.cpu = "cpu" in (hw.accelerator or "").lower()

    def flops(self, dtype: str = "bf16") -> float:
        return self.hw.peak_flops(dtype) * self.mfu / self.host

    def reading(self, what: str, nbytes: float, nodes: int = 1) -> Term:
        return Term(what, nbytes / (self.read * GB * max(1, nodes)), self.read_basis)

    def writing(self, what: str, nbytes: float, nodes: int = 1) -> Term:
        return Term(what, nbytes / (self.write * GB * max(1, nodes)), self.write_basis)

    def computing(self, what: str, flops: float, devices: int = 1) -> Term:
        return Term(what, flops / (self.flops() * max(1, devices)), self.mfu_basis)

    def fixed(self, what: str, const: str, units: float = 1.0) -> Term:
        """`units` x the host-measured constant `const` (scaled to this host when it is one),
        with that constant's provenance."""
        c = CONSTANTS[const]
        basis = (self.measured + f" ({c['basis']}: {const})" if c["basis"] == "fitted"
                 else f"assumed: {const} on {ANCHOR_HOST}" + self.measured[len(f"measured: {ANCHOR_HOST}"):])
        return Term(what, c["value"] * units * self.host, basis, const, units * self.host)

    def started(self, what: str, count: float = 1.0) -> Term:
        """`count` fresh worker processes (estimate.process_start_s, else PROCESS_START_S)."""
        if self.start_override is not None:
            return Term(what, count * self.start_override, self.start_basis)
        return self.fixed(what, "PROCESS_START_S", count)


def probe_work() -> None:
    """The probe's fixed mix of what the anchored costs are made of: Python bytecode (the
    stages' and libraries' own code), small torch ops (per-op dispatch) and fp32 matmuls."""
    import torch  # lazy: the dry run has loaded it already (the model on the meta device)

    seen: dict[int, int] = {}
    for i in range(400_000):
        seen[i % 997] = seen.get(i % 997, 0) + i
    x = torch.ones(64)
    for _ in range(4000):
        x = x * 0.999 + 0.001
    a = torch.full((256, 256), 0.01)
    for _ in range(150):
        a = torch.tanh(a @ a)


def probe_host(repeats: int = 15) -> float:
    """CPU seconds this host's core takes for `probe_work`: the fastest of `repeats` (~0.14 s
    each here). Timed by the calling thread's CPU clock with torch on one thread, so it reads
    the core's speed, not how many other processes share it: a wall-clock probe beside another
    pipeline's Ray starting or stopping read 5-17x a host whose quiet probe read 1.1x
    (docs/dryrun.md, "The probe"). The fastest, not the median: even the CPU clock of one
    sample is stretched by what shares the core's caches, and on a quiet host the median of 5
    read 0.145-0.191 s within a minute (a held-out run priced 1.51x instead of 1.18x), where the
    fastest of 15 moves by a few percent."""
    import torch  # lazy: as in probe_work

    def once() -> float:
        t = time.thread_time()
        probe_work()
        return time.thread_time() - t

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # every op on this thread: its CPU clock holds all of the work
    try:
        once()  # warm: first calls allocate and pick kernels
        return min(once() for _ in range(repeats))
    finally:
        torch.set_num_threads(threads)


def _pick(configured, spec_value, default, key: str, hw_name: str) -> tuple[float, str]:
    what = key.replace("_gbs", "").replace("_", " ")
    if configured:
        return configured, f"assumed: {what} {configured:g} GB/s"
    if spec_value:
        return spec_value, f"published: {hw_name} {what}"
    return default, f"assumed: {what} {default:g} GB/s"


def resources(inp: Inputs, name: str) -> tuple[float, float]:
    """(num_cpus, num_gpus) Ray gives the stage's task: its spec, then stages.resources."""
    spec, over = inp.stage_specs[name], inp.cfg.stages.resources.get(name)
    cpus = spec.num_cpus if over is None or over.num_cpus is None else over.num_cpus
    gpus = spec.num_gpus if over is None or over.num_gpus is None else over.num_gpus
    if callable(gpus):
        gpus = 0 if inp.hw.accelerator and "cpu" in inp.hw.accelerator.lower() else 1
    return float(cpus), float(gpus)


def one_device(inp: Inputs, r: Rates, name: str) -> tuple[str, int]:
    """A stage run as one Ray task: its placement text and the devices it holds."""
    cpus, gpus = resources(inp, name)
    if gpus:
        return f"1 Ray task {{CPU: {cpus:g}, GPU: {gpus:g}}}, any node", 1
    return f"1 Ray task {{CPU: {cpus:g}}}, any node", 1 if r.cpu else 0


def worker_start(inp: Inputs, r: Rates, name: str) -> Term:
    """A CPU task reuses convert's warm Ray worker; a GPU task starts a fresh one."""
    fresh = resources(inp, name)[1] > 0
    return r.started("worker start (a GPU task gets a fresh worker)", 1.0 if fresh else 0.0)
