"""`plan:` section — options of the parallel-strategy planner (moeflow/parallel/planner.py).

LoRA-mode sizes (sequence length, targets, rank) come from `data:` and `lora:`;
this section adds the batch shape and what the planner may assume.
"""

from typing import Literal

from pydantic import Field

from moeflow.core.sections import Section


class PlanSection(Section):
    mode: Literal["lora", "inference"] = "lora"  # what the plan is for
    micro_batch_size: int = Field(default=1, ge=1)  # lora: sequences per DP rank per micro-batch
    grad_accum: int = Field(default=1, ge=1)  # lora: micro-batches per step (pipeline depth)
    # activation recomputation per layer: less memory, one more forward; auto: where the
    # sequence's activations do not fit without it (then CP, if still not)
    recompute: bool | Literal["auto"] = "auto"
    batch: int = Field(default=8, ge=1)  # inference: concurrent sequences per replica
    context: int = Field(default=4096, ge=1)  # inference: tokens in each sequence's KV cache
    prefill_chunk: int = Field(default=2048, ge=1)  # inference: tokens per prefill step
    # weight precision the plan assumes; auto: model.dtype (fp8/int8 halve bf16 weights)
    weight_dtype: Literal["auto", "bf16", "fp16", "fp32", "fp8", "int8"] = "auto"
    kv_dtype: Literal["bf16", "fp16", "fp8"] = "bf16"
    # transformers: honour the measured transformers/PEFT limits (docs/facts.md); generic: none;
    # vllm: serving plans for vLLM
    runtime: Literal["transformers", "generic", "vllm"] = "transformers"
    alternatives: int = Field(default=5, ge=0)  # how many runner-up plans to record
    # pinned parallel degrees that cannot run: strict fails the stage; nearest plans the
    # nearest runnable degrees (then a shorter seq_len) and records what it replaced and why
    explicit: Literal["strict", "nearest"] = "strict"
    # weights the vllm serving sub-plan assumes; auto: bf16 if it fits, else fp8 (int8 without fp8)
    serving_weight_dtype: Literal["auto", "bf16", "fp8", "int8"] = "auto"
    # config.json (or a configs/models name) to plan from while model.path does not exist yet:
    # planning needs only the architecture, not the weights
    architecture: str | None = None
