"""`estimate:` section — assumptions of the dry run (`moeflow run CONFIG --dry-run`).

Every figure here is an assumption the dry run names as such in its table; leave a key
null to use the hardware spec's figure (when it states one) or the measured default in
moeflow/parallel/estimate.py.
"""

from pydantic import Field

from moeflow.core.sections import Section


class EstimateSection(Section):
    mfu: float | None = Field(default=None, gt=0, le=1)  # fraction of peak FLOP/s; null: the planner's
    storage_read_gbs: float | None = Field(default=None, gt=0)  # per node; null: hardware spec, else 2
    storage_write_gbs: float | None = Field(default=None, gt=0)  # per node; null: hardware spec, else 1
    storage_free_gb: float | None = Field(default=None, ge=0)  # space for outputs; null: spec, else local disk
    price_per_device_hour: float | None = Field(default=None, ge=0)  # null: the hardware spec's
    process_start_s: float | None = Field(default=None, ge=0)  # a fresh Ray worker importing torch
    source_dtype: str | None = None  # checkpoint dtype while it is absent; null: config.json's
    bytes_per_token: float = Field(default=4.0, gt=0)  # text bytes per token without a tokenizer
    max_epochs: float = Field(default=3.0, gt=0)  # warn when max_steps needs more passes over the data
    # a vLLM engine's start beyond loading its weights (torch.compile, CUDA graphs, KV cache
    # allocation): vLLM documents no figure; ~1-3 min on GPU servers
    vllm_start_s: float = Field(default=120.0, ge=0)
