"""`serving:` section — the serving-configuration search (stage `serving`, step 5)."""

from pydantic import Field

from moeflow.core.sections import ExistingPath, Section


class SearchSpace(Section):
    """Values tried per knob (deploy: names); a knob left empty keeps the deploy: value."""

    max_num_seqs: list[int] = Field(default_factory=lambda: [16, 32, 64])  # engine batch rows
    max_num_batched_tokens: list[int] = Field(default_factory=lambda: [256, 512, 1024])  # tokens/step
    enable_chunked_prefill: list[bool] = Field(default_factory=lambda: [True, False])
    long_prefill_token_threshold: list[int | None] = Field(default_factory=lambda: [None, 64, 128])
    # vLLM knob; searched only when the serving engine implements it
    max_num_partial_prefills: list[int] = Field(default_factory=list)
    max_long_partial_prefills: list[int] = Field(default_factory=lambda: [1, 2])
    num_replicas: list[int] = Field(default_factory=lambda: [1, 2])  # capped by devices / (TP x PP)
    max_ongoing_requests: list[int] = Field(default_factory=lambda: [32, 64, 128])  # per replica


class ServingSection(Section):
    profile: ExistingPath = "configs/traffic/demo.yaml"  # traffic profile YAML (relative: cwd, then the repo)
    budget_s: float = Field(default=60, gt=0)  # wall clock for deploy + probes + rate search
    max_candidates: int = Field(default=6, ge=1)  # settings tried, the deploy: default included
    eta: int = Field(default=2, ge=2)  # successive halving: keep 1/eta after the probe
    rate_step: float = Field(default=1.5, gt=1)  # factor between request rates tried
    rate_points: int = Field(default=2, ge=0)  # rates tried per finalist beyond the profile's
    replica_cpus: float | None = Field(default=None, gt=0)  # Ray CPUs per candidate replica; None: fit all
    search: SearchSpace = Field(default_factory=SearchSpace)
