"""What a real run would find late, checked before it starts: free space for the outputs,
every stage's memory per device against the spec's device (over it: refused, naming the
setting that fixes it), the traffic profile's SLOs against the serving plan, the data.

    python -c "from moeflow.parallel.checks import checks"   # library; moeflow/parallel/estimate.py
"""

from __future__ import annotations

import math

from moeflow.parallel.memory import human
from moeflow.parallel.pricing import Check, Inputs, PipelineEstimate
from moeflow.parallel.serving_prices import backend
from moeflow.parallel.stage_prices import calibrate_plan


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
    for s in est.stages:  # a forced layout can ask for more devices than the spec has
        if s.name == "regress" and s.devices > inp.hw.world_size:
            out.append(Check("devices.regress", "fail", f"regress needs {s.devices} devices, over the "
                             f"{inp.hw.world_size} of {inp.hw.name}: set regress.layout auto (it picks "
                             f"layer ranges only where they fit the spec, else one layer at a time), "
                             f"or lower regress.shards ({inp.cfg.regress.shards})"))
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
        lay = calibrate_plan(inp)
        if lay.expert_groups < max(1, inp.spec.num_experts) and lay.split:
            return (f"{lay.layer_workers} layer workers x {lay.expert_groups} expert groups: set "
                    f"calibrate.expert_groups auto (or above {lay.expert_groups}) to split each layer's "
                    f"experts further, lower calibrate.samples ({c.calibrate.samples}), or {leave}")
        if not lay.split:
            return (f"it runs in one process (calibrate.layer_workers {c.calibrate.layer_workers}, "
                    f"expert_groups {c.calibrate.expert_groups}): set calibrate.layer_workers and "
                    f"calibrate.expert_groups auto to split it over workers, lower calibrate.samples "
                    f"({c.calibrate.samples}), or {leave}")
        return f"lower calibrate.samples ({c.calibrate.samples}), or {leave}"
    if stage in ("operators", "regress"):
        sec = getattr(c, stage)
        if stage == "regress" and sec.layout_setting == "whole":
            return (f"regress.layout whole (or regress.streamed never) loads the whole model on one device: "
                    f"set regress.layout auto (resident layer ranges, else one layer at a time), or {leave}")
        if sec.streamed == "never":
            return (f"{stage}.streamed never loads the whole model on one device: set it auto "
                    f"(one decoder layer at a time), or {leave}")
        if stage == "regress" and c.regress.dtype == "float32":
            return ("one decoder layer in regress.dtype float32 and the carried hidden states take "
                    f"that: set regress.dtype bfloat16 (half the layer), or {leave}")
        return f"one decoder layer and the carried hidden states take that: {leave}"
    if stage in ("serving", "deploy") and backend(inp) == "local":
        return ("the local engine holds the whole model on one device (deploy.backend local): set "
                "deploy.backend auto or vllm to serve (and search) it with vLLM across devices")
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
