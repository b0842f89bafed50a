"""`finetune:` section — training-loop options (LoRA itself is `lora:`)."""

from typing import Literal

from pydantic import Field

from moeflow.core.sections import LocalPath, Section


class TenantAdapter(Section):
    """One more adapter on the same base, trained on its own data (one base, many tenants)."""

    train_file: LocalPath  # JSONL, as data.train_file
    eval_file: LocalPath | None = None  # default: a held-out split of train_file
    max_steps: int | None = Field(default=None, ge=1)  # default: finetune.max_steps
    # suite tasks this adapter must improve in `regress` (default: none; it must not regress any)
    target_tasks: list[str] = Field(default_factory=list)


class FinetuneSection(Section):
    max_steps: int = Field(default=100, ge=1)  # optimizer steps
    micro_batch_size: int = Field(default=4, ge=1)  # packed rows of data.seq_len per worker
    grad_accum: int = Field(default=1, ge=1)  # micro-batches per optimizer step
    gradient_checkpointing: bool = False  # recompute activations: less memory, more time
    checkpoint_every: int = Field(default=50, ge=1)  # steps between Ray Train checkpoints
    max_failures: int = Field(default=2, ge=0)  # worker deaths survived (restore from checkpoint)
    # MoE router load-balancing loss weight; null keeps the family's default
    router_aux_loss_coef: float | None = Field(default=None, ge=0)
    # grouped_mm: fast fused experts (backward ~7x eager on CPU); split_lora: grouped_mm with
    # expert LoRA applied as x·A·B per expert, never the delta weight; auto: operators.json's pick
    experts_implementation: Literal["auto", "grouped_mm", "eager", "batched_mm", "split_lora"] = "auto"
    log_every: int = Field(default=1, ge=1)  # steps between MLflow metric points
    spike_window: int = Field(default=20, ge=2)  # rolling window of the loss-spike detector
    spike_k: float = Field(default=3.0, gt=0)  # spike: loss > mean + k * std of the window
    max_eval_examples: int | None = Field(default=200, ge=1)  # exact-match generations
    eval_batch_size: int = Field(default=32, ge=1)
    cpus_per_worker: float = Field(default=1, gt=0)  # Ray Train worker resources
    use_gpu: bool | Literal["auto"] = "auto"  # auto: when the Ray cluster has GPUs
    merge: bool = False  # also write merged full weights (base + adapter)
    register_model: bool = True  # register the adapter as an MLflow model version
    # more adapters trained after the main one (data:), same lora/optimizer settings,
    # each in its own nested MLflow run; regress gates each, deploy serves them all
    adapters: dict[str, TenantAdapter] = Field(default_factory=dict)
