"""`finetune:` section — training-loop options (LoRA itself is `lora:`)."""

from pydantic import Field

from moeflow.sections import Section


class FinetuneSection(Section):
    max_steps: int = Field(default=100, ge=1)
    micro_batch_size: int = Field(default=4, ge=1)
    grad_accum: int = Field(default=1, ge=1)
    gradient_checkpointing: bool = False  # recompute activations: less memory, more time
    checkpoint_every: int = Field(default=50, ge=1)
