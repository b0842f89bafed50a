"""`operators:` section — expert-load profile, EPLB placement and operator timings.

EP size and node count come from the plan stage unless set here; the kernel
timings use the model's own MoE block shapes with a token count you size to
the machine.
"""

from typing import Literal

from pydantic import Field

from moeflow.core.sections import ExistingPath, Section


class OperatorsSection(Section):
    # JSONL of prompt / text / messages records; null: the golden suite's prompts
    calibration_file: ExistingPath | None = None
    max_calibration: int | None = Field(default=None, ge=1)  # use at most this many texts
    max_tokens: int = Field(default=512, ge=1)  # per text (truncated beyond)
    shard_size: int = Field(default=256, ge=1)  # texts per Ray task when the set is bigger
    # the profile's forward one decoder layer at a time (memory: the largest layer, not the
    # model); auto: when the model does not fit one device of hardware.spec
    streamed: Literal["auto", "always", "never"] = "auto"
    # replicas of hot experts for engines that replicate them (vLLM / SGLang EPLB); 0: none
    num_redundant_experts: int = Field(default=0, ge=0)
    ep_size: int | None = Field(default=None, ge=1)  # null: the plan's expert-parallel degree
    # expert groups for hierarchical placement; null: the model's n_group (routing groups), else 1
    num_groups: int | None = Field(default=None, ge=1)
    # permute experts in a copy of the checkpoint so hot ones spread over EP ranks
    # (transformers has no replicas); auto: when EP > 1 and it lowers the heaviest rank
    apply_placement: Literal["auto", "always", "never"] = "auto"
    hot_factor: float = Field(default=2.0, gt=1)  # "hot": more than this x the layer's mean load
    bench_tokens: int = Field(default=1024, ge=1)  # tokens per timed MoE block (size to the machine)
    bench_dtype: Literal["auto", "bfloat16", "float32"] = "auto"  # auto: model.dtype
    bench_reps: int = Field(default=2, ge=1)  # best of this many timed runs
    max_block_gb: float = Field(default=4.0, gt=0)  # build fewer experts above this (same shapes)
    dispatch: bool = True  # time all-to-all vs all-gather token dispatch on 2 gloo ranks
    # also load the checkpoint with DistributedConfig(ep_size) in EP processes and count
    # per-rank routed tokens before/after the permutation (slow: EP interpreters)
    measure_ep_load: bool = False
