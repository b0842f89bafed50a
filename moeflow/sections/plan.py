"""`plan:` section — options of the parallel-strategy planner."""

from typing import Literal

from pydantic import Field

from moeflow.sections import Section


class PlanSection(Section):
    mode: Literal["lora", "inference"] = "lora"
    micro_batch_size: int = Field(default=1, ge=1)
    recompute: bool = True  # activation recomputation (gradient checkpointing)
