"""Which plans can run at all: divisibility, TP inside the high-bandwidth domain, and the
runtimes' measured limits (docs/facts.md). Memory is checked after (moeflow.parallel.memory).

    python -c "from moeflow.parallel.rules import structural_reason"   # library
"""

from __future__ import annotations

from moeflow.core.hardware import HardwareSpec
from moeflow.model.params import ModelSpec
from moeflow.parallel.memory import Plan, Workload, lora_targets

RUNTIMES = ("transformers", "generic", "vllm")

# measured limits of the transformers + PEFT runtime (docs/facts.md)
WHY_EXPERT_LORA_EP = ("PEFT expert LoRA does not combine with transformers expert parallelism "
                      "(DTensor mixing); moeflow's split expert LoRA runs on EP-sharded experts "
                      "when EP equals TP (the EP group is the TP group) without FSDP; plan "
                      "EP equal to TP, or EP 1")
# Ray Serve LLM gives each engine data-parallel rank a replica of its own; their experts' all-to-all
# on vLLM's CPU build (gloo) has not been run by moeflow: on CPU an engine's EP stays inside its TP
WHY_CPU_ENGINE_DP = ("on CPU devices the vllm backend keeps expert parallelism inside one engine "
                     "(EP <= TP): engine data parallelism on vLLM's CPU build is not supported here")
WHY_CP_LINEAR = ("context parallelism splits softmax attention only; the linear-attention "
                 "layers' recurrence is not split")


def target_kinds(spec: ModelSpec, work: Workload) -> set[str]:
    """Kinds of the tensors the workload's LoRA adapts."""
    return {t.kind for t in lora_targets(spec, work.lora_targets)}


def structural_reason(spec: ModelSpec, hw: HardwareSpec, p: Plan, work: Workload,
                      runtime: str = "transformers") -> str | None:
    """Why `p` cannot run at all (None: it can, memory permitting)."""
    if p.world != hw.world_size:
        return f"uses {p.world} devices, the hardware has {hw.world_size}"
    if p.tp > (hw.hbd_size or hw.devices_per_node):
        return f"TP={p.tp} exceeds the high-bandwidth domain ({hw.hbd_size} devices)"
    if spec.heads % p.tp:
        return f"TP={p.tp} does not divide {spec.heads} attention heads"
    if spec.attention != "mla" and spec.kv_heads % p.tp and p.tp % spec.kv_heads:
        return f"TP={p.tp} neither divides nor is a multiple of {spec.kv_heads} KV heads"
    if p.pp > spec.layers:
        return f"PP={p.pp} exceeds {spec.layers} layers"
    if p.ep > 1 and spec.num_experts % p.ep:
        return f"EP={p.ep} does not divide {spec.num_experts} experts"
    if p.ep > 1 and (p.ep % p.tp or (p.tp * p.dp) % p.ep):
        return f"EP={p.ep} must be a multiple of TP={p.tp} and divide TP x DP={p.tp * p.dp}"
    if p.dp % p.fsdp:
        return f"FSDP={p.fsdp} does not divide DP={p.dp}"
    if work.mode == "inference" and p.fsdp > 1:
        return "FSDP is for training"
    if p.cp > 1:
        why = cp_reason(spec, p, work)
        if why:
            return why
    if runtime == "transformers":
        return transformers_reason(spec, p, work)
    if runtime == "vllm":
        return vllm_reason(p, work, hw)
    return None


def cp_reason(spec: ModelSpec, p: Plan, work: Workload) -> str | None:
    """Why context parallelism of degree p.cp cannot run (None: it can)."""
    if work.mode != "lora":
        return "context parallelism is for training"
    if p.dp % p.cp:
        return f"CP={p.cp} does not divide DP={p.dp}"
    local = spec.heads // p.tp if spec.attention != "mla" else spec.heads
    if local % p.cp:
        return f"CP={p.cp} does not divide the {local} attention heads per TP rank"
    if work.seq_len % p.cp:
        return f"CP={p.cp} does not divide seq_len {work.seq_len}"
    if spec.linear_attention_layers:
        return WHY_CP_LINEAR
    return None


def vllm_reason(p: Plan, work: Workload, hw: HardwareSpec | None = None) -> str | None:
    """What vLLM (behind Ray Serve LLM) cannot run: it serves; its EP group is TP x engine DP.
    On CPU devices (`hw.cpu_devices`) one engine's workers share one node, and EP stays in TP."""
    if work.mode != "inference":
        return "the vllm runtime serves (plan.mode inference); LoRA training runs on transformers"
    if hw is not None and hw.cpu_devices:
        if p.ep > p.tp:  # vllm_layout: EP beyond TP is engine data parallelism
            return WHY_CPU_ENGINE_DP
        if p.tp * p.pp > hw.devices_per_node:
            return (f"TP x PP = {p.tp * p.pp} vLLM workers in one engine: Ray Serve LLM runs vLLM's CPU build "
                    f"with its multiprocessing executor, which keeps an engine on one node "
                    f"({hw.devices_per_node} devices)")
    return None  # expert LoRA under EP: deploy serves such adapters merged (vllm_backend)


def transformers_reason(spec: ModelSpec, p: Plan, work: Workload) -> str | None:
    """Limits of transformers' DistributedConfig and PEFT (measured, docs/facts.md)."""
    if work.mode == "lora":
        kinds = target_kinds(spec, work)
        if p.ep > 1 and (p.ep != p.tp or p.fsdp > 1) and kinds & {"experts", "vision_experts"}:
            return WHY_EXPERT_LORA_EP
        if p.ep > 1 and (p.fsdp * p.tp) % p.ep:
            return f"transformers places EP groups inside FSDP x TP: EP={p.ep} needs FSDP x TP divisible by it"
        if p.fsdp not in (1, p.dp):  # what moeflow.training.driver.check_plan accepts
            return f"the finetune stage shards over all data ranks (no HSDP replicas): FSDP must be 1 or DP={p.dp}"
    elif p.ep > 1 and p.ep != p.tp:
        return "transformers serves EP inside one replica: EP must equal TP"
    if p.pp > 1 and p.dp > 1:
        return "transformers does not combine pipeline parallelism with data parallelism / FSDP"
    if p.pp > 1 and p.ep > p.tp:
        return "transformers does not combine EP token dispatch with pipeline parallelism"
    return None
