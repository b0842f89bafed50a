"""Per-stage time, memory, bytes and cost of a pipeline before it runs (`moeflow run --dry-run`).

Beside the planner: the planner picks the parallel plan and prices one training step or one
decode step; this module prices every stage of the DAG on the same hardware spec and says,
for each figure, what it rests on. A stage's time is a sum of named terms, each with a basis:

  measured  a host cost (process starts, Ray Train set-up, per-step Python overhead) fitted
            from recorded pipeline runs on ANCHOR_HOST by benchmarks/fit_dryrun.py
            ("measured: cpu-local (fitted: NAME)"); a host cost no recorded run measures on
            its own is "assumed: NAME on cpu-local". Both are the constants in
            estimate_constants.json, each with its provenance, used as they are on any spec;
            when the spec is ANCHOR_HOST's own, they are scaled by a probe of the host the
            dry run runs on (probe_host / ANCHOR_PROBE_S: VMs of one kind differ in speed);
  published a figure the hardware spec states (vendor FLOP/s, HBM and link bandwidth, storage
            speed) fed through the planner's cost model (planner.py docstring: MFU 0.4);
  assumed   a default moeflow cannot know (storage speed when the spec names none, bytes per
            token without a tokenizer); every one is a key of the `estimate:` config section.

Terms per stage (s = seconds; R/W = storage read/write bandwidth of one node; D = devices):
  convert    start + source bytes / R + converted bytes / W + (source + converted) / R (verify)
  plan       start + the planner's own time, measured in this dry run
  operators  start + weights / R + calibration tokens x 2 active FLOPs / (peak x MFU)
  finetune   Ray Train set-up (+ per doubling of workers past 2) + start + rank bytes per node
             / R + steps x (planner step_s + STEP_OVERHEAD) per adapter + eval decode steps x
             (EVAL_STEP host time + FLOPs + HBM floor) + checkpoints / W
  calibrate  start + weights / R + quantised bytes / W + samples x 2 models x FLOPs
  regress    per model evaluated: weights / R + suite tokens x FLOPs + EVAL_MODEL overhead
  serving    max(serving.budget_s, the default and one candidate deployed) + SERVING_TAIL
  deploy     replica start + weights per replica / R + smoke test (one request per model)
The pipeline's wall time is its critical path through the DAG (finetune and calibrate run
side by side) plus PIPELINE_START_S; device-hours are each stage's devices x its time; "booked"
is the whole cluster for the whole wall time. Cost = device-hours x price_per_device_hour.

    python -c "from moeflow.estimate import *"   # `moeflow run CONFIG --dry-run` is the CLI
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from moeflow.estimate_constants import ANCHOR_PROBE_S, CONSTANTS
from moeflow.hardware import GB, HardwareSpec
from moeflow.memory import human
from moeflow.planner import MFU, _lora_params_on_rank, lora_cost
from moeflow.vllm_plan import SEARCH_LOCAL_ONLY

# ---- host-measured constants: seconds on ANCHOR_HOST at probe time ANCHOR_PROBE_S, each with
# its provenance (fitted from recorded runs, or assumed) in moeflow/estimate_constants.py,
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
WHOLE_MODEL_STAGES = ("operators", "regress")  # load the model on one device


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
    counts: Any  # params.ParamCounts
    stage_specs: dict[str, Any]  # enabled stages (tasks.base.StageSpec), optional edges folded
    lora: Any  # planner Candidate of the finetune plan (None: no LoRA plan)
    lora_work: Any  # its memory.Workload: finetune's micro-batch, grad_accum and recompute
    serve: dict[str, Any]  # replicas, devices_per_replica, memory, tpot_s, ttft_s, tok_s
    src_bytes: float
    src_basis: str
    converted_bytes: float
    quantised_bytes: float
    adapter_bytes: float
    plan_seconds: float  # the planner's time, measured in this dry run
    suite: dict[str, float]  # records, prompt_tokens, gen_tokens
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
        """Stages that cannot run as planned (memory over a device): the dry run exits 2."""
        return [c for c in self.failed if c.name.startswith("memory.")]

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


def probe_host(repeats: int = 5) -> float:
    """CPU seconds this host's core takes for a fixed mix of what the anchored costs are made
    of: Python bytecode (the stages' and libraries' own code), small torch ops (per-op
    dispatch) and fp32 matmuls; the median of `repeats` (~0.14 s each here). Timed by the
    calling thread's CPU clock with torch on one thread, so it reads the core's speed, not how
    many other processes share it: a wall-clock probe beside another pipeline's Ray starting or
    stopping read 5-17x a host whose quiet probe read 1.1x (docs/dryrun.md, "The probe")."""
    import torch  # lazy: the dry run has loaded it already (the model on the meta device)

    def once() -> float:
        t = time.thread_time()
        seen: dict[int, int] = {}
        for i in range(400_000):
            seen[i % 997] = seen.get(i % 997, 0) + i
        x = torch.ones(64)
        for _ in range(4000):
            x = x * 0.999 + 0.001
        a = torch.full((256, 256), 0.01)
        for _ in range(150):
            a = torch.tanh(a @ a)
        return time.thread_time() - t

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # every op on this thread: its CPU clock holds all of the work
    try:
        once()  # warm: first calls allocate and pick kernels
        times = sorted(once() for _ in range(repeats))
    finally:
        torch.set_num_threads(threads)
    return times[len(times) // 2]


def _pick(configured, spec_value, default, key: str, hw_name: str) -> tuple[float, str]:
    what = key.replace("_gbs", "").replace("_", " ")
    if configured:
        return configured, f"assumed: {what} {configured:g} GB/s"
    if spec_value:
        return spec_value, f"published: {hw_name} {what}"
    return default, f"assumed: {what} {default:g} GB/s"


def _resources(inp: Inputs, name: str) -> tuple[float, float]:
    """(num_cpus, num_gpus) Ray gives the stage's task: its spec, then stages.resources."""
    spec, over = inp.stage_specs[name], inp.cfg.stages.resources.get(name)
    cpus = spec.num_cpus if over is None or over.num_cpus is None else over.num_cpus
    gpus = spec.num_gpus if over is None or over.num_gpus is None else over.num_gpus
    if callable(gpus):
        gpus = 0 if inp.hw.accelerator and "cpu" in inp.hw.accelerator.lower() else 1
    return float(cpus), float(gpus)


def _one_device(inp: Inputs, r: Rates, name: str) -> tuple[str, int]:
    cpus, gpus = _resources(inp, name)
    if gpus:
        return f"1 Ray task {{CPU: {cpus:g}, GPU: {gpus:g}}}, any node", 1
    return f"1 Ray task {{CPU: {cpus:g}}}, any node", 1 if r.cpu else 0


def _worker_start(inp: Inputs, r: Rates, name: str) -> Term:
    """A CPU task reuses convert's warm Ray worker; a GPU task starts a fresh one."""
    fresh = _resources(inp, name)[1] > 0
    return r.started("worker start (a GPU task gets a fresh worker)", 1.0 if fresh else 0.0)


def _active_flops(inp: Inputs, tokens: float) -> float:
    return 2 * inp.counts.active * tokens


# ------------------------------------------------------------ the stages


def convert(inp: Inputs, r: Rates) -> StageEstimate:
    """One Ray task per output file (one per decoder layer, plus the rest), spread over nodes."""
    files = inp.spec.layers + 1
    workers = inp.cfg.convert.workers or files
    nodes = max(1, min(inp.hw.nodes, files, workers))
    conv = inp.converted_bytes
    return StageEstimate(
        "convert", f"1 Ray task + {min(files, workers)} file tasks {{CPU: 1}} over {nodes} node(s)",
        devices=1 if r.cpu else 0, nodes=nodes, memory_per_device=0.0,
        bytes_read=2 * inp.src_bytes + conv, bytes_written=conv,
        terms=[r.fixed("stage task and its MLflow run", "STAGE_OVERHEAD_S"),
               r.started("stage worker, then file workers start", 2),
               r.reading(f"read the checkpoint ({inp.src_basis})", inp.src_bytes, nodes),
               r.writing("write the converted shards", conv, nodes),
               r.reading("verify: re-read source and output (xxh3 hashes at memory speed)",
                         inp.src_bytes + conv, nodes)])


def plan(inp: Inputs, r: Rates) -> StageEstimate:
    placement, devices = _one_device(inp, r, "plan")
    return StageEstimate(
        "plan", placement, devices=devices, nodes=1, memory_per_device=0.0,
        bytes_read=0.0, bytes_written=0.0,
        terms=[r.fixed("stage task and its MLflow run", "STAGE_OVERHEAD_S"),
               Term("the planner's searches (timed in this dry run)", inp.plan_seconds,
                    "measured: this dry run planned it"),
               r.fixed("the memory chart", "CHART_S")])


def _unit_params(spec) -> tuple[int, int]:
    """(parameters of the largest decoder layer, parameters outside the layers): what a
    layer-streamed stage holds at once (moeflow.streamed)."""
    per: dict[int, int] = {}
    outer = 0
    for t in spec.tensors:
        if t.layer is None:
            outer += t.numel
        else:
            per[t.layer] = per.get(t.layer, 0) + t.numel
    return max(per.values(), default=0), outer


def _fits_one_device(inp: Inputs, dtype_bytes: int) -> bool:
    """The whole model in a compute dtype of `dtype_bytes` fits one device (the stages'
    `auto` choice between loading it and streaming it)."""
    return inp.counts.total * dtype_bytes <= inp.hw.memory_bytes


def operators(inp: Inputs, r: Rates) -> StageEstimate:
    """The load profile (the whole model on one device, or layer-streamed where it does not
    fit: one decoder layer resident), EPLB, kernels timed on one block."""
    op = inp.cfg.operators
    placement, devices = _one_device(inp, r, "operators")
    tokens = int(op.max_calibration or inp.suite["records"]) * op.max_tokens  # golden prompts
    block = op.bench_tokens * op.bench_reps * 3 * 2  # impls x (forward, forward+backward)
    per_layer = 2 * (inp.counts.active - inp.counts.active_by_kind.get("embed", 0)) / max(1, inp.spec.layers)
    size = 4 if inp.cfg.model.dtype == "float32" else 2  # the profile's compute dtype
    streamed = op.streamed == "always" or (op.streamed == "auto" and not _fits_one_device(inp, size))
    acts = 2 * tokens * inp.spec.hidden * 4
    if streamed:  # the front (embeddings, head) + the largest layer + every batch's hidden states
        layer, outer = _unit_params(inp.spec)
        mem = (layer + outer) * size + acts
        placement += ", layer-streamed"
    else:
        mem = inp.converted_bytes + acts
    st = StageEstimate(
        "operators", placement, devices=devices, nodes=1, memory_per_device=mem,
        bytes_read=inp.converted_bytes, bytes_written=inp.converted_bytes,
        terms=[r.fixed("stage task and its MLflow run", "STAGE_OVERHEAD_S"),
               _worker_start(inp, r, "operators"),
               r.reading("read the converted model" + (" a layer at a time" if streamed else ""),
                         inp.converted_bytes),
               r.computing(f"route {tokens:,} calibration tokens", _active_flops(inp, tokens)),
               r.computing("time the experts kernels on one block", per_layer * block),
               r.fixed("dispatch timing: 2 gloo processes spawned", "SPAWN_START_S", 1 if op.dispatch else 0),
               r.fixed("EPLB, heatmap, MLflow artifacts", "EPLB_S"),
               r.writing("placed copy of the checkpoint (when it lowers the hottest rank)",
                         inp.converted_bytes)])
    return st


def finetune(inp: Inputs, r: Rates) -> StageEstimate:
    """Ray Train: one worker per device of the LoRA plan; every adapter in the same run."""
    ft, hw, cand = inp.cfg.finetune, inp.hw, inp.lora
    world = cand.plan.world if cand else 1
    nodes = max(1, math.ceil(world / hw.devices_per_node))
    gpu = 0 if r.cpu else 1
    placement = (f"Ray Train {world} workers x {{CPU: {ft.cpus_per_worker:g}"
                 + (", GPU: 1" if gpu else "") + f"}}, PACK over {nodes} node(s)")
    rank_bytes = cand.memory.parts["weights_dense"] + cand.memory.parts["weights_experts"] if cand else 0
    step_s = lora_cost(inp.spec, hw, cand.plan, inp.lora_work, inp.counts,
                       _lora_params_on_rank(inp.spec, cand.plan, inp.lora_work),
                       cand.memory)["step_s"] * r.host if cand else 0.0
    doublings = math.log2(world / 2) if world > 2 else 0.0  # measured with 2 workers
    terms = [r.fixed("Ray Train set-up and teardown (2 workers)", "TRAIN_SETUP_S"),
             r.fixed(f"Ray Train set-up: {world} workers, {doublings:.2g} doublings past 2",
                     "TRAIN_SETUP_PER_DOUBLING_S", doublings),
             r.started("worker start"),
             r.reading("load the base: every rank its shard", rank_bytes * world, nodes)]
    steps = sum(d["max_steps"] for d in inp.data)
    terms.append(Term(f"{steps:,} optimizer steps x {step_s:.3g} s (planner cost model)",
                      steps * step_s, r.mfu_basis))
    terms.append(r.fixed(f"{steps:,} steps x per-step overhead", "STEP_OVERHEAD_S", steps))
    # exact-match eval: decode steps of eval_batch_size sequences; each costs host time (Python,
    # sampling), its FLOPs through the planner's cost model and at least one read of the active
    # weights, so a larger model is priced by its own size, not the demo's speed
    gen = len(inp.data) * min(ft.max_eval_examples or 0, 10 ** 9) * 16
    eval_steps = gen / max(1, ft.eval_batch_size)
    terms += [r.fixed(f"exact-match eval: {eval_steps:,.0f} decode steps, host side", "EVAL_STEP_S",
                      eval_steps),
              r.computing(f"exact-match eval: {gen:,.0f} generated tokens", _active_flops(inp, gen)),
              Term("exact-match eval: decode steps bound by HBM", _decode_floor(inp, eval_steps),
                   f"published: {hw.name} hbm_bandwidth_gbs")]
    ckpts = sum(math.ceil(d["max_steps"] / ft.checkpoint_every) for d in inp.data)
    terms.append(r.writing(f"{ckpts} adapter checkpoints", ckpts * inp.adapter_bytes))
    mem = cand.memory.total if cand else 0.0
    return StageEstimate("finetune", placement, devices=world if (gpu or r.cpu) else 0, nodes=nodes,
                         memory_per_device=mem, bytes_read=rank_bytes * world,
                         bytes_written=ckpts * inp.adapter_bytes, terms=terms)


def _decode_floor(inp: Inputs, steps: float) -> float:
    """Decode steps bound by reading the active weights from HBM (large models)."""
    active_bytes = 2 * inp.counts.active
    return steps * active_bytes / (inp.hw.hbm_bandwidth_gbs * GB)


def calibrate_workers(inp: Inputs) -> int:
    """calibrate.layer_workers as the stage resolves it (tasks/calibrate.py)."""
    setting = inp.cfg.calibrate.layer_workers
    if setting != "auto":
        return min(int(setting), inp.spec.layers)
    return 1 if _fits_one_device(inp, 4) else min(inp.spec.layers, inp.hw.devices_per_node)


def calibrate(inp: Inputs, r: Rates) -> StageEstimate:
    """Layer by layer: quantise, then baseline vs quantised on the golden set, in one
    process or over layer workers (ranges of layers)."""
    c = inp.cfg.calibrate
    placement, devices = _one_device(inp, r, "calibrate")
    workers = calibrate_workers(inp)
    tokens = c.samples * max(1.0, inp.suite["prompt_tokens"] / max(1, inp.suite["records"]))
    layer, outer = _unit_params(inp.spec)
    stored = inp.converted_bytes / max(1, inp.counts.total)  # bytes per parameter on disk
    # a layer is built in float32 (the compare's dtype), each stored tensor released once cast
    largest = max((t.numel for t in inp.spec.tensors if t.layer is not None), default=0)
    layer_mem = layer * 4 + largest * stored
    front = outer * 4 + tokens * inp.spec.hidden * 4 * 4  # + hidden states of both sides
    mem = layer_mem + front if workers == 1 else max(layer_mem, front)
    if workers > 1:
        placement += f" + {workers} layer workers (ranges of layers)"
        devices = devices + workers if devices else 0
    return StageEstimate(
        "calibrate", placement, devices=devices, nodes=1,
        memory_per_device=mem,
        bytes_read=2 * inp.converted_bytes + inp.quantised_bytes, bytes_written=inp.quantised_bytes,
        terms=[r.fixed("stage task and its MLflow run", "STAGE_OVERHEAD_S"),
               _worker_start(inp, r, "calibrate"),
               r.reading("read the converted model (quantise, then compare)", 2 * inp.converted_bytes),
               r.writing(f"write the {c.scheme} checkpoint", inp.quantised_bytes),
               r.reading("read it back layer by layer", inp.quantised_bytes),
               r.computing(f"{c.samples} samples through 2 models", 2 * _active_flops(inp, tokens)),
               r.fixed("compare passes of the precision plan, report", "CALIBRATE_S")])


def regress(inp: Inputs, r: Rates) -> StageEstimate:
    """Every produced model on the suite: base, each adapter, the calibrated checkpoint."""
    shards = max(1, inp.cfg.regress.shards)
    models = 1 + len(inp.data) + (1 if "calibrate" in inp.stage_specs else 0)
    placement, devices = _one_device(inp, r, "regress")
    if shards > 1:
        placement = placement.replace("1 Ray task", f"{shards} Ray tasks (shards)")
    tokens = inp.suite["prompt_tokens"] + inp.suite["gen_tokens"]
    gen_steps = inp.suite["gen_tokens"] / 16  # generations batched ~16 at a time
    return StageEstimate(
        "regress", placement, devices=devices * shards, nodes=min(shards, inp.hw.nodes),
        memory_per_device=inp.converted_bytes, bytes_read=models * inp.converted_bytes,
        bytes_written=0.0,
        terms=[r.fixed("stage task and its MLflow run", "STAGE_OVERHEAD_S"),
               _worker_start(inp, r, "regress") if shards == 1 else
               r.started("shard workers start"),
               r.reading(f"load {models} models", models * inp.converted_bytes / shards),
               r.computing(f"{models} models x {tokens:,.0f} suite tokens",
                           models * _active_flops(inp, tokens) / shards),
               Term("decode steps bound by HBM", models * _decode_floor(inp, gen_steps) / shards,
                    f"published: {inp.hw.name} hbm_bandwidth_gbs"),
               r.fixed(f"{models} models x load, scoring and tables", "EVAL_MODEL_S", models)])


def _replica(inp: Inputs, search: bool = False) -> tuple[int, int]:
    s = inp.serve.get("search", {}) if search else inp.serve
    return int(s.get("replicas", 1)), int(s.get("devices_per_replica", 1))


def _backend(inp: Inputs) -> str:
    """The backend that serves (workflows/dryrun.py resolved deploy.backend auto)."""
    return inp.serve.get("backend", inp.cfg.deploy.backend)


def _replica_text(inp: Inputs, search: bool = False) -> str:
    """What one replica holds: a vLLM engine of the plan's layout, or the local engine's one device."""
    replicas, per = _replica(inp, search)
    layout = (inp.serve.get("search", {}) if search else inp.serve).get("layout")
    return f"{replicas} replica(s) x {per} device(s)" + (f" ({layout})" if layout else "")


def serving(inp: Inputs, r: Rates) -> StageEstimate:
    """Candidates of moeflow's local engine deployed one after another within `serving.budget_s`
    (the default and one candidate always are, however long deploying takes); its knobs are
    rendered for vLLM too (tasks/serving.py), so the search needs the model on one device."""
    sv = inp.cfg.serving
    replicas, per = _replica(inp, search=True)
    core = (CORE_START_S if _core_process(inp, "local") else 0.0) * r.host + _compile_warmup(inp, "local") * r.host
    deploy_one = r.start + core + inp.converted_bytes * replicas / (r.read * GB * max(1, replicas * per
                                                                          // inp.hw.devices_per_node))
    searched = max(sv.budget_s, 2 * deploy_one)
    devices = replicas * per
    return StageEstimate(
        "serving", f"Ray Serve (local): {min(sv.max_candidates, 2)}+ candidates x "
        f"{_replica_text(inp, search=True)}, one candidate at a time", devices=devices,
        nodes=max(1, math.ceil(devices / inp.hw.devices_per_node)),
        memory_per_device=inp.serve.get("search", {}).get("memory_bytes", 0.0),
        bytes_read=2 * replicas * inp.converted_bytes, bytes_written=0.0,
        terms=[Term("search within serving.budget_s (at least 2 deployments)", searched,
                    "assumed: serving.budget_s" if searched == sv.budget_s else r.read_basis),
               r.fixed("teardown and reports", "SERVING_TAIL_S")])


def _core_process(inp: Inputs, backend: str | None = None) -> bool:
    """Whether deployed replicas start an engine core process: moeflow's engine with
    deploy.engine_process true, or auto on a model without a vision tower (auto serves an
    image-text model in the replica's own process, moeflow/serving/service.py)."""
    d = inp.cfg.deploy
    if (backend or _backend(inp)) != "local" or d.engine_process is False:
        return False
    return d.engine_process is True or not inp.counts.vision


def _compile_warmup(inp: Inputs, backend: str | None = None) -> float:
    """Seconds a replica compiles before serving (deploy.compile, moeflow's engine only)."""
    return COMPILE_WARMUP_S if (backend or _backend(inp)) == "local" and inp.cfg.deploy.compile else 0.0


def deploy(inp: Inputs, r: Rates) -> StageEstimate:
    replicas, per = _replica(inp)
    devices = replicas * per
    nodes = max(1, math.ceil(devices / inp.hw.devices_per_node))
    return StageEstimate(
        "deploy", f"Ray Serve ({_backend(inp)}): {_replica_text(inp)} over {nodes} node(s)",
        devices=devices, nodes=nodes, memory_per_device=inp.serve.get("memory_bytes", 0.0),
        bytes_read=replicas * inp.converted_bytes, bytes_written=0.0,
        terms=[r.fixed("stage task and its MLflow run", "STAGE_OVERHEAD_S"),
               r.started("replica start"),
               r.fixed("each replica's engine core process starts beside it (deploy.engine_process)",
                       "CORE_START_S", 1 if _core_process(inp) else 0),
               r.fixed("each replica compiles its forwards before serving (deploy.compile)",
                       "COMPILE_WARMUP_S", 1 if _compile_warmup(inp) else 0),
               r.reading("every replica loads the weights", replicas * inp.converted_bytes, nodes),
               r.fixed("smoke test, one request per model", "SMOKE_S", 1 + len(inp.data))])


ESTIMATORS = {"convert": convert, "plan": plan, "operators": operators, "finetune": finetune,
              "calibrate": calibrate, "regress": regress, "serving": serving, "deploy": deploy}


# ------------------------------------------------------------ the pipeline


def estimate(inp: Inputs) -> PipelineEstimate:
    """Every enabled stage, the critical path, and the checks.

    Returns:
        PipelineEstimate: stages in DAG order; a stage without a model here (a plugin) has no
        terms and says so.
    """
    r = Rates(inp)
    stages = []
    for name, spec in inp.stage_specs.items():
        fn = ESTIMATORS.get(name)
        st = fn(inp, r) if fn else StageEstimate(name, "plugin stage", 0, 1, 0.0, 0.0, 0.0,
                                                 notes=["no estimate model for this stage"])
        st.upstream = tuple(u for u in spec.upstream if u in inp.stage_specs)
        stages.append(st)
    path, wall = critical_path(stages)
    price = (inp.cfg.estimate.price_per_device_hour if inp.cfg.estimate.price_per_device_hour
             is not None else inp.hw.price_per_device_hour)
    est = PipelineEstimate(stages, [], path, wall + PIPELINE_START_S * r.host, inp.hw.world_size, price,
                           assumptions=_assumptions(r, price, inp), host=r.host)
    est.checks = checks(inp, est)
    return est


def critical_path(stages: list[StageEstimate]) -> tuple[list[str], float]:
    """The longest chain of stages through the DAG and its length in seconds."""
    finish: dict[str, float] = {}
    via: dict[str, str | None] = {}
    for s in stages:  # DAG order: upstream first
        ups = [u for u in s.upstream if u in finish]
        prev = max(ups, key=lambda u: finish[u]) if ups else None
        finish[s.name] = (finish[prev] if prev else 0.0) + s.seconds
        via[s.name] = prev
    if not finish:
        return [], 0.0
    end = max(finish, key=lambda k: finish[k])
    path = [end]
    while prev := via[path[-1]]:
        path.append(prev)
    return path[::-1], finish[end]


def _assumptions(r: Rates, price: float | None, inp: Inputs) -> dict[str, str]:
    return {"mfu": f"{r.mfu:g} ({r.mfu_basis})", "storage_read": f"{r.read:g} GB/s ({r.read_basis})",
            "storage_write": f"{r.write:g} GB/s ({r.write_basis})",
            "process_start": f"{r.start:g} s ({r.start_basis})",
            "host_speed": (f"x{r.host:.3f}: probe {inp.host_probe_s:.4f} s here vs {ANCHOR_PROBE_S} s "
                           f"on {ANCHOR_HOST}'s anchor") if r.host != 1.0 else
                          "x1 (host costs as measured on the anchor)",
            "price_per_device_hour": "not set (hardware spec or estimate.price_per_device_hour)"
            if price is None else f"{price:g}",
            "checkpoint_bytes": inp.src_basis, "storage_free": inp.storage_free[1]}


# ------------------------------------------------------------ checks


def checks(inp: Inputs, est: PipelineEstimate) -> list[Check]:
    """What a real run would find hours in: space, memory, the SLOs, the data."""
    return [*inp.plan_checks, space_check(inp, est), *memory_checks(inp, est), *slo_checks(inp),
            *data_checks(inp)]


def space_check(inp: Inputs, est: PipelineEstimate) -> Check:
    """Convert's output, the placed and quantised copies and the adapters vs free space."""

    written = {s.name: s.bytes_written for s in est.stages}
    need = sum(written.values())
    if inp.cfg.finetune.merge:
        need += len(inp.data) * inp.converted_bytes
    free, where = inp.storage_free
    parts = ", ".join(f"{k} {human(v)}" for k, v in written.items() if v)
    if free is None:
        return Check("space", "warn", f"outputs need {human(need)} ({parts}); free space not "
                     f"known ({where}): set estimate.storage_free_gb")
    if need > free:
        return Check("space", "fail", f"outputs need {human(need)} ({parts}) but {where} has "
                     f"{human(free)} free")
    status = "warn" if need > 0.8 * free else "ok"
    return Check("space", status, f"outputs need {human(need)} of {human(free)} free ({where})")


def memory_checks(inp: Inputs, est: PipelineEstimate) -> list[Check]:
    """Every stage's memory per device against the spec's device: a stage over it cannot run
    as planned, so it fails (the dry run refuses, exit 2) naming what it needs and what fixes it."""
    out, budget = [], inp.hw.memory_bytes
    for s in est.stages:
        if s.memory_per_device > budget:
            out.append(Check(f"memory.{s.name}", "fail", f"{s.name} needs {human(s.memory_per_device)} "
                             f"per device, over {human(budget)} on {inp.hw.name}: {_fix(inp, s.name)}"))
    if ("serving" in inp.stage_specs or "deploy" in inp.stage_specs) and inp.serve.get("unfit"):
        out.append(Check("memory.deploy", "fail", inp.serve["unfit"]))
    return out or [Check("memory", "ok", "every planned stage fits its devices")]


def _fix(inp: Inputs, stage: str) -> str:
    """The setting that brings `stage` within one device (or leaves it out)."""
    c, ft = inp.cfg, inp.cfg.finetune
    leave = f"leave {stage} out of stages.enabled, or pick a hardware.spec with larger devices"
    if stage == "finetune":
        return (f"finetune.micro_batch_size {ft.micro_batch_size} with gradient_checkpointing "
                f"{ft.gradient_checkpointing} (the plan assumed plan.micro_batch_size "
                f"{c.plan.micro_batch_size}): lower it, or set finetune.gradient_checkpointing: true")
    if stage == "calibrate":
        layer = inp.converted_bytes / max(1, inp.spec.layers)
        if 2 * layer < inp.hw.memory_bytes:
            return (f"two decoder layers take {human(2 * layer)}, the rest is the golden set's "
                    f"activations: lower calibrate.samples ({c.calibrate.samples})")
        return f"one decoder layer alone takes {human(layer)}: {leave}"
    if stage == "serving":
        return SEARCH_LOCAL_ONLY
    if stage == "deploy":
        return "the local engine holds the whole model on one device: set deploy.backend auto or vllm"
    if stage in WHOLE_MODEL_STAGES:
        return f"it loads the whole model on one device: {leave}"
    return leave


def slo_checks(inp: Inputs) -> list[Check]:
    """The traffic profile's SLOs against the serving plan: TPOT, TTFT, tokens/s and bursts."""
    prof, s = inp.profile, inp.serve
    if not prof or "serving" not in inp.stage_specs and "deploy" not in inp.stage_specs:
        return []
    if not s.get("tpot_s"):
        return [Check("slo", "warn", "no serving plan fits: SLOs not checked")]
    replicas = int(s.get("replicas", 1))
    out = []
    tpot_ms, ttft_ms = 1000 * s["tpot_s"], 1000 * s["ttft_s"]  # both backends: the cost model's
    if prof.get("tpot_ms") is not None:
        ok = tpot_ms <= prof["tpot_ms"]
        out.append(Check("slo.tpot", "ok" if ok else "warn",
                         f"planned TPOT {tpot_ms:.3g} ms at batch {s['batch']} vs SLO "
                         f"{prof['tpot_ms']:g} ms"))
    if prof.get("ttft_ms") is not None:
        ok = ttft_ms <= prof["ttft_ms"]
        out.append(Check("slo.ttft", "ok" if ok else "warn",
                         f"planned prefill of a {s['context']}-token context {ttft_ms:.3g} ms vs "
                         f"SLO {prof['ttft_ms']:g} ms"))
    need = prof["rate"] * prof["mean_output"]
    have = replicas * s["tok_s"]
    out.append(Check("slo.throughput", "ok" if need <= have else "warn",
                     f"{prof['rate']:g} req/s x {prof['mean_output']:.0f} output tokens = "
                     f"{need:,.0f} tok/s vs {replicas} replica(s) x {s['tok_s']:,.0f} tok/s planned"
                     + ("" if need <= have else
                        f": needs {math.ceil(need / max(s['tok_s'], 1e-9))} replicas")))
    engines = int(s.get("engines_per_replica", 1))  # vLLM's data-parallel ranks: a scheduler each
    slots = replicas * engines * s["max_num_seqs"]
    burst = prof.get("burst_size") or 1
    out.append(Check("slo.burst", "ok" if burst <= slots else "warn",
                     f"a burst of {burst} requests vs {replicas} replica(s) x "
                     + (f"{engines} engine(s) x " if engines > 1 else "")
                     + f"{s['max_num_seqs']} sequences (deploy.max_num_seqs)"
                     + ("" if burst <= slots else ": the rest wait a whole request, past the TTFT "
                        "SLO (the serving stage searches max_num_seqs)")))
    return out


def data_checks(inp: Inputs) -> list[Check]:
    """Each adapter's training file: enough packed rows for the DP ranks, and how many passes
    its max_steps make over it."""
    out = []
    dp = inp.lora.plan.dp if inp.lora else 1
    seq = inp.lora_work.seq_len if inp.lora_work else inp.cfg.data.seq_len
    ft = inp.cfg.finetune
    for d in inp.data:
        name = f"data.{d['name']}"
        if d.get("tokens") is None:
            out.append(Check(name, "warn", f"{d['path']}: {d['basis']}: tokens not checked"))
            continue
        rows = d["tokens"] / seq
        need = d["max_steps"] * ft.micro_batch_size * ft.grad_accum * dp * seq
        if rows < dp:
            out.append(Check(name, "fail", f"{d['path']}: about {rows:.1f} packed rows of {seq} "
                             f"tokens for {dp} data-parallel ranks; add data or lower data.seq_len"))
            continue
        epochs = need / d["tokens"]
        status = "warn" if epochs > inp.cfg.estimate.max_epochs else "ok"
        out.append(Check(name, status, f"{d['path']}: {d['tokens']:,.0f} tokens ({d['basis']}); "
                         f"{d['max_steps']} steps x {ft.micro_batch_size * ft.grad_accum} x {dp} "
                         f"ranks x {seq} = {need:,.0f} tokens, {epochs:.2g} passes"
                         + (f" (more than estimate.max_epochs {inp.cfg.estimate.max_epochs:g})"
                            if status == "warn" else "")))
    return out
