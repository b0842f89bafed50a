"""The pipeline's model stages priced: convert, plan, operators, finetune, calibrate, regress
(the serving search and deploy: moeflow/parallel/serving_prices.py). Each returns a
StageEstimate whose time is a sum of named terms (moeflow/parallel/pricing.py), and whose
memory per device is that of the fullest process the stage runs as planned.

Terms per stage (s = seconds; R/W = storage read/write bandwidth of one node; D = devices):
  convert    start + source bytes / R + converted bytes / W + (source + converted) / R (verify)
  plan       start + the planner's own time, measured in this dry run
  operators  start + weights / R + calibration tokens x 2 active FLOPs / (peak x MFU)
  finetune   Ray Train set-up (+ per doubling of workers past 2) + start + rank bytes per node
             / R + steps x (the cost model's step_s + STEP_OVERHEAD) per adapter + eval decode
             steps x (EVAL_STEP host time + FLOPs + HBM floor) + checkpoints / W
  calibrate  start + weights / R + quantised bytes / W + samples x 2 models x FLOPs, over
             layer workers x expert groups where the model exceeds a device
  regress    per model evaluated: weights / R (layer-streamed: once per pass, a pass per
             generated token; resident layer ranges: each checkpoint once per shard, over the
             ranges' nodes, + the hidden states' hops / link + Ray calls) + suite tokens x FLOPs
             + EVAL_MODEL overhead

    python -c "from moeflow.parallel.stage_prices import calibrate"   # library
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

from moeflow.parallel.cost import active_flops, decode_floor_seconds, lora_cost, lora_params_on_rank
from moeflow.parallel.footprint import (
    WORKER_RUNTIME,
    CalibrateLayout,
    calibrate_layout,
    fits_one_device,
    streamed_bytes,
)
from moeflow.parallel.memory import human
from moeflow.parallel.pricing import Inputs, Rates, StageEstimate, Term, one_device, worker_start


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
    placement, devices = one_device(inp, r, "plan")
    return StageEstimate(
        "plan", placement, devices=devices, nodes=1, memory_per_device=0.0,
        bytes_read=0.0, bytes_written=0.0,
        terms=[r.fixed("stage task and its MLflow run", "STAGE_OVERHEAD_S"),
               Term("the planner's searches (timed in this dry run)", inp.plan_seconds,
                    "measured: this dry run planned it"),
               r.fixed("the memory chart", "CHART_S")])


def _streams(setting: str, inp: Inputs, dtype_bytes: float) -> bool:
    """A stage's `streamed` setting resolved: always, never, or auto (the model in its compute
    dtype exceeds one device)."""
    return setting == "always" or (setting == "auto" and not fits_one_device(inp.counts, inp.hw, dtype_bytes))


def operators(inp: Inputs, r: Rates) -> StageEstimate:
    """The load profile (the whole model on one device, or layer-streamed where it does not
    fit: one decoder layer resident), EPLB, kernels timed on one block."""
    op = inp.cfg.operators
    placement, devices = one_device(inp, r, "operators")
    tokens = int(op.max_calibration or inp.suite["records"]) * op.max_tokens  # golden prompts
    block = op.bench_tokens * op.bench_reps * 3 * 2  # impls x (forward, forward+backward)
    per_layer = 2 * (inp.counts.active - inp.counts.active_by_kind.get("embed", 0)) / max(1, inp.spec.layers)
    size = 4 if inp.cfg.model.dtype == "float32" else 2  # the profile's compute dtype
    streamed = _streams(op.streamed, inp, size)
    acts = 2 * tokens * inp.spec.hidden * 4
    if streamed:  # the front (embeddings, head) + the largest layer + every batch's hidden states
        mem = streamed_bytes(inp.spec, size, acts)
        placement += ", layer-streamed"
    else:
        mem = inp.converted_bytes + acts
    return StageEstimate(
        "operators", placement, devices=devices, nodes=1, memory_per_device=mem,
        bytes_read=inp.converted_bytes, bytes_written=inp.converted_bytes,
        terms=[r.fixed("stage task and its MLflow run", "STAGE_OVERHEAD_S"),
               worker_start(inp, r, "operators"),
               r.reading("read the converted model" + (" a layer at a time" if streamed else ""),
                         inp.converted_bytes),
               r.computing(f"route {tokens:,} calibration tokens", active_flops(inp.counts, tokens)),
               r.computing("time the experts kernels on one block", per_layer * block),
               r.fixed("dispatch timing: 2 gloo processes spawned", "SPAWN_START_S", 1 if op.dispatch else 0),
               r.fixed("EPLB, heatmap, MLflow artifacts", "EPLB_S"),
               r.writing("placed copy of the checkpoint (when it lowers the hottest rank)",
                         inp.converted_bytes)])


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
                       lora_params_on_rank(inp.spec, cand.plan, inp.lora_work),
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
    # sampling), its FLOPs through the cost model and at least one read of the active
    # weights, so a larger model is priced by its own size, not the demo's speed
    gen = len(inp.data) * min(ft.max_eval_examples or 0, 10 ** 9) * 16
    eval_steps = gen / max(1, ft.eval_batch_size)
    terms += [r.fixed(f"exact-match eval: {eval_steps:,.0f} decode steps, host side", "EVAL_STEP_S",
                      eval_steps),
              r.computing(f"exact-match eval: {gen:,.0f} generated tokens", active_flops(inp.counts, gen)),
              Term("exact-match eval: decode steps bound by HBM", decode_floor_seconds(inp.counts, hw, eval_steps),
                   f"published: {hw.name} hbm_bandwidth_gbs")]
    ckpts = sum(math.ceil(d["max_steps"] / ft.checkpoint_every) for d in inp.data)
    terms.append(r.writing(f"{ckpts} adapter checkpoints", ckpts * inp.adapter_bytes))
    mem = cand.memory.total if cand else 0.0
    return StageEstimate("finetune", placement, devices=world if (gpu or r.cpu) else 0, nodes=nodes,
                         memory_per_device=mem, bytes_read=rank_bytes * world,
                         bytes_written=ckpts * inp.adapter_bytes, terms=terms)


def calibrate_tokens(inp: Inputs) -> float:
    """Golden-set tokens calibrate records: samples x the suite's mean prompt tokens."""
    c = inp.cfg.calibrate
    return c.samples * max(1.0, inp.suite["prompt_tokens"] / max(1, inp.suite["records"]))


def calibrate_plan(inp: Inputs) -> CalibrateLayout:
    """calibrate.layer_workers x calibrate.expert_groups as the stage resolves them
    (moeflow.parallel.footprint.calibrate_layout)."""
    c = inp.cfg.calibrate
    stored = inp.converted_bytes / max(1, inp.counts.total)  # bytes per parameter on disk
    return calibrate_layout(inp.spec, inp.counts, inp.hw, c.layer_workers, c.expert_groups, stored,
                            calibrate_tokens(inp))


def calibrate(inp: Inputs, r: Rates) -> StageEstimate:
    """Layer by layer: quantise, then baseline vs quantised on the golden set, in one
    process or over workers: ranges of layers, each layer's routed experts split into
    groups where one layer exceeds a device."""
    c = inp.cfg.calibrate
    placement, devices = one_device(inp, r, "calibrate")
    lay = calibrate_plan(inp)
    nodes = 1
    if lay.split:
        placement += (f" + {lay.layer_workers} layer workers (ranges of layers)" if lay.expert_groups == 1
                      else f" + {lay.workers} workers: {lay.layer_workers} ranges of layers x "
                           f"{lay.expert_groups} expert groups")
        devices = devices + lay.workers if devices else 0
        nodes = max(1, min(inp.hw.nodes, math.ceil(lay.workers / inp.hw.devices_per_node)))
    tokens = calibrate_tokens(inp)
    return StageEstimate(
        "calibrate", placement, devices=devices, nodes=nodes, memory_per_device=lay.memory_bytes,
        bytes_read=2 * inp.converted_bytes + inp.quantised_bytes, bytes_written=inp.quantised_bytes,
        terms=[r.fixed("stage task and its MLflow run", "STAGE_OVERHEAD_S"),
               worker_start(inp, r, "calibrate"),
               r.reading("read the converted model (quantise, then compare)", 2 * inp.converted_bytes, nodes),
               r.writing(f"write the {c.scheme} checkpoint", inp.quantised_bytes, nodes),
               r.reading("read it back layer by layer", inp.quantised_bytes, nodes),
               r.computing(f"{c.samples} samples through 2 models", 2 * active_flops(inp.counts, tokens)),
               r.fixed("compare passes of the precision plan, report", "CALIBRATE_S")],
        notes=lay.why)


# a Ray actor call's host cost (serialise the hidden states, schedule, reply) beside its bytes:
# assumed from Ray's documented per-call overhead of the order of a millisecond
RANGE_CALL_S = 2e-3


@dataclass
class RegressLayout:
    """Where regress runs each model (regress.layout resolved): `kind` whole, streamed or
    ranges; for ranges, the [start, stop) layer ranges, each a Ray worker holding them
    resident, and the bytes each holds; `front` the bytes the evaluating process holds."""

    kind: str
    ranges: list[tuple[int, int]] = field(default_factory=list)
    range_bytes: list[float] = field(default_factory=list)
    front: float = 0.0
    why: str = ""

    @property
    def devices_per_shard(self) -> int:
        """Devices one evaluating shard holds: its own (the front), and one per range."""
        return 1 + len(self.ranges)


def layer_params(spec) -> list[int]:
    """Parameters of each decoder layer, in order."""
    per = [0] * spec.layers
    for t in spec.tensors:
        if t.layer is not None and t.layer < spec.layers:
            per[t.layer] += t.numel
    return per


def pack_ranges(loads: Sequence[float], capacity: float) -> list[tuple[int, int]]:
    """`loads` (bytes per layer) cut into the fewest contiguous [start, stop) ranges whose sums
    are within `capacity`, balanced: cut at equal shares of the total where that keeps every
    range within the smallest cap that allows that count, else greedily at that cap (a layer
    over `capacity` gets a range of its own). Hand-written: a linear partition of a few
    hundred numbers, no library's."""

    def greedy(cap: float) -> list[tuple[int, int]]:
        out, start, total = [], 0, 0.0
        for i, x in enumerate(loads):
            if i > start and total + x > cap:
                out.append((start, i))
                start, total = i, 0.0
            total += x
        return out + [(start, len(loads))] if loads else out

    fewest = len(greedy(capacity))
    lo, hi = max(loads, default=0.0), max(capacity, max(loads, default=0.0))
    for _ in range(60):  # bisect the cap down to the smallest with the same count
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if len(greedy(mid)) <= fewest else (mid, hi)
    # cuts nearest to equal shares of the total, where they keep every range within that cap
    # (greedy alone leaves the remainder to the last range: 3 + 3 + 3 + 1)
    prefix = [0.0]
    for x in loads:
        prefix.append(prefix[-1] + x)
    cuts = [0] + [min(range(1, len(loads)), key=lambda i: abs(prefix[i] - prefix[-1] * j / fewest))
                  for j in range(1, fewest)] + [len(loads)]
    even = list(zip(cuts, cuts[1:]))
    if all(b > a and prefix[b] - prefix[a] <= hi for a, b in even):
        return even
    return greedy(hi)


def regress_layout(rg, spec, counts, hw, stored_per_value: float, tokens_per_record: float,
                   shards: int | None = None) -> RegressLayout:
    """regress.layout resolved on `spec` and the device of `hw` (the dry run's and the stage's
    own choice, moeflow.evaluation.ranges_runner): whole where the model in regress.dtype fits
    one device; else ranges -- each range as many decoder layers as fit one device (its layers
    in the compute dtype, on a CPU spec the largest layer as stored while it is cast, the
    batch's hidden states and the worker's compute runtime) -- where the spec has shards x (ranges + 1)
    devices; else streamed. `stored_per_value`: the checkpoint's bytes per parameter."""
    size = 2 if rg.dtype in ("bfloat16", "float16") else 4  # the eval's compute dtype
    shards = max(1, rg.shards if shards is None else shards)
    setting = rg.layout_setting
    per_layer = layer_params(spec)
    outer = counts.total - sum(per_layer)
    batch_tokens = rg.batch_size * max(1.0, tokens_per_record)
    # the front's process: its weights, a batch's logits in float32, every batch's hidden states
    front = outer * size + batch_tokens * spec.vocab * 4 + 2 * batch_tokens * spec.hidden * 4
    if setting == "whole" or (setting == "auto" and fits_one_device(counts, hw, size)):
        return RegressLayout("whole", front=counts.total * size, why="the model fits one device")
    # a layer is built in host memory from its stored tensors, then moved to the device: the
    # stored copy beside the cast one counts where the device is the host's (a CPU spec)
    cpu = "cpu" in (hw.accelerator or "").lower()
    cast = stored_per_value if cpu and abs(stored_per_value - size) > 0.05 else 0.0
    # hidden states in and out of a layer, the residual and attention's, float32 at most
    carried = 4 * batch_tokens * spec.hidden * 4 + WORKER_RUNTIME
    loads = [p * size for p in per_layer]
    ranges = pack_ranges(loads, hw.memory_bytes - carried - max(per_layer, default=0) * cast)
    held = [sum(loads[a:b]) + max(per_layer[a:b]) * cast + carried for a, b in ranges]
    lay = RegressLayout("ranges", ranges, held, front)
    if setting == "ranges":
        lay.why = "regress.layout ranges"
        return lay
    if setting == "auto" and max(held, default=0.0) <= hw.memory_bytes and \
            shards * lay.devices_per_shard <= hw.world_size:
        lay.why = (f"the model exceeds one device: {len(ranges)} ranges of layers x {shards} shard(s) "
                   f"+ the shards' fronts fit {hw.world_size} devices")
        return lay
    why = ("one decoder layer exceeds a device" if max(held, default=0.0) > hw.memory_bytes else
           f"{shards} shard(s) x {lay.devices_per_shard} devices exceed the spec's {hw.world_size}")
    return RegressLayout("streamed", front=front, why=f"the model exceeds one device and {why}")


def regress_plan(inp: Inputs) -> RegressLayout:
    """regress_layout on the dry run's inputs."""
    stored = inp.converted_bytes / max(1, inp.counts.total)
    per_record = inp.suite["prompt_tokens"] / max(1, inp.suite["records"])
    return regress_layout(inp.cfg.regress, inp.spec, inp.counts, inp.hw, stored, per_record)


def regress(inp: Inputs, r: Rates) -> StageEstimate:
    """Every produced model on the suite: base, each adapter, the calibrated checkpoint; each
    loaded whole, layer-streamed (every pass -- one per scoring task, one per generated token of
    a generation task -- reads every layer from storage once), or over resident layer ranges
    (each checkpoint read once, a pass costs compute and the hidden states' hops)."""
    rg = inp.cfg.regress
    shards = max(1, rg.shards)
    models = 1 + len(inp.data) + (1 if "calibrate" in inp.stage_specs else 0)
    placement, devices = one_device(inp, r, "regress")
    if shards > 1:
        placement = placement.replace("1 Ray task", f"{shards} Ray tasks (shards)")
    tokens = inp.suite["prompt_tokens"] + inp.suite["gen_tokens"]
    gen_steps = inp.suite["gen_tokens"] / 16  # generations batched ~16 at a time
    size = 2 if rg.dtype in ("bfloat16", "float16") else 4  # the eval's compute dtype
    lay = regress_plan(inp)
    streamed = lay.kind != "whole"
    nodes = min(shards, inp.hw.nodes)
    passes = max(1, int(inp.suite.get("streamed_passes", 0))) if streamed else 1
    notes: list[str] = []
    starts = r.started("shard workers start") if shards > 1 else worker_start(inp, r, "regress")
    extra: list[Term] = []
    if lay.kind == "ranges":
        per_device = shards * lay.devices_per_shard
        nodes = max(1, min(inp.hw.nodes, math.ceil(per_device / inp.hw.devices_per_node)))
        mem = max([lay.front, *lay.range_bytes])
        placement += f", {len(lay.ranges)} ranges of layers resident per shard (Ray actors), over {nodes} node(s)"
        checkpoints = inp.converted_bytes + (inp.quantised_bytes if "calibrate" in inp.stage_specs else 0.0)
        read = shards * checkpoints
        load = r.reading(f"each checkpoint read once per shard: every range worker its layers "
                         f"({shards} shard(s), spread over {nodes} node(s))", read, nodes)
        sets = 2 if "calibrate" in inp.stage_specs else 1  # the base's range workers, then the calibrated's
        starts = r.started("shard workers, then their range workers start, once per checkpoint",
                           sets * (2 if shards > 1 else 1))
        hops = len(lay.ranges) + 1  # front -> range 0 -> ... -> the front again
        hop_bytes = models * passes * tokens * (inp.spec.hidden + 2 * inp.spec.head_dim) * size * hops
        batches = math.ceil(inp.suite["records"] / (shards * rg.batch_size))
        calls = models * passes * batches * hops
        bw = inp.hw.inter_node_bandwidth_gbs
        extra = [Term(f"hidden states through {hops} hops a pass ({models} models x {passes} passes, at most)",
                      hop_bytes / shards / (bw * 1e9), f"published: {inp.hw.name} inter_node_bandwidth_gbs"),
                 Term(f"{calls:,.0f} Ray actor calls per shard (batches x hops x passes)", calls * RANGE_CALL_S,
                      f"assumed: RANGE_CALL_S {RANGE_CALL_S * 1e3:g} ms per Ray actor call")]
        devices = per_device
        notes.append(f"resident layer ranges: {len(lay.ranges)} per shard, {human(max(lay.range_bytes))} on "
                     f"the fullest range's device, the front {human(lay.front)}; {lay.why}")
    elif streamed:
        per_record = tokens / max(1, inp.suite["records"])
        # hidden states in and out of a layer, and one batch's fp32 logits; generation recomputes
        # the sequence each pass (moeflow/evaluation/streamed_runner.py): no KV cache carried
        carried = 2 * tokens / shards * inp.spec.hidden * 4 + rg.batch_size * per_record * inp.spec.vocab * 4
        mem = streamed_bytes(inp.spec, size, carried)
        placement += ", layer-streamed"
        share = math.ceil(shards / nodes)  # shards on one node share its storage bandwidth
        load = r.reading(f"{models} models x {passes} passes, every layer read from storage each "
                         f"pass ({shards} shard(s) each read the model)",
                         models * passes * inp.converted_bytes * share)
        read = models * passes * inp.converted_bytes * shards
        devices *= shards
        notes.append(f"layer-streamed: {human(mem)} per device, the model is {human(inp.converted_bytes)}"
                     + (f"; {lay.why}" if lay.why else ""))
    else:  # the whole model in the eval's compute dtype
        mem = inp.counts.total * size
        load = r.reading(f"load {models} models", models * inp.converted_bytes / shards)
        read = models * inp.converted_bytes
        devices *= shards
    return StageEstimate(
        "regress", placement, devices=devices, nodes=nodes,
        memory_per_device=mem, bytes_read=read, bytes_written=0.0,
        terms=[r.fixed("stage task and its MLflow run", "STAGE_OVERHEAD_S"), starts, load,
               r.computing(f"{models} models x {tokens:,.0f} suite tokens"
                           + (f" x {passes} passes (at most: generation recomputes)" if streamed else ""),
                           models * passes * active_flops(inp.counts, tokens) / shards),
               *extra,
               Term("decode steps bound by HBM",
                    models * decode_floor_seconds(inp.counts, inp.hw, gen_steps) / shards,
                    f"published: {inp.hw.name} hbm_bandwidth_gbs"),
               r.fixed(f"{models} models x load, scoring and tables", "EVAL_MODEL_S", models)],
        notes=notes)
