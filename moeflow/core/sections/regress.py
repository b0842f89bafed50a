"""`regress:` section — evaluation suite and regression gate."""

from typing import Literal

from pydantic import Field, model_validator

from moeflow.core.sections import ExistingPath, Section


class RegressSection(Section):
    suite: ExistingPath | None = None  # suite YAML; None: the shipped golden suite (configs/suites/golden.yaml)
    # compare against this recorded baseline; None: the suite's latest on a base of the same
    # architecture (config.json architectures[0]), if any
    baseline: str | None = None
    record_baseline: str | None = None  # record the adapter's results under this name when the gate passes
    target_tasks: list[str] | None = None  # the fine-tune must improve these; None: the suite's target_tasks
    min_gain: float = Field(default=0.0, ge=0)  # required improvement on target tasks (metric units)
    compare_base: bool = True  # gate the adapter against its own base model
    shards: int = Field(default=2, ge=1)  # Ray tasks the eval set is split over; 1: in-process
    batch_size: int = Field(default=16, ge=1)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # eval compute dtype
    # output agreement (greedy tokens, per-token KL / top-1) with the last baseline when the
    # model is the one it recorded (same weights): beyond these an unchanged model fails
    max_kl: float = Field(default=1e-3, ge=0)  # mean per-token KL(reference || candidate), nats
    min_token_agreement: float = Field(default=0.95, ge=0, le=1)  # tokens equal to the reference's
    # a flip of the greedy / top-1 token whose log-odds swing is at most this (nats) is a near
    # tie, not a change (moeflow.evaluation.ties; the section sits below it: same value)
    tie_margin: float = Field(default=0.05, ge=0)
    # a quantised model (calibrate stage) vs its base: looser, precision loss is expected
    calibrated_max_kl: float = Field(default=0.05, ge=0)
    calibrated_min_token_agreement: float = Field(default=0.85, ge=0, le=1)
    calibrated_tie_margin: float = Field(default=0.05, ge=0)
    # perplexity task of the suite holding held-out text of the base's language: the base's
    # token perplexity on it (vs uniform) and its expert-load skew are logged; None: skip
    probe_task: str | None = "demo_text"
    # where base and candidates run: whole (loaded on one device), streamed (one decoder layer
    # resident, read from storage every pass: moeflow.evaluation.streamed_runner), ranges
    # (contiguous ranges of decoder layers resident on Ray workers, one device each, sized by
    # the planner: moeflow.evaluation.ranges_runner); auto: whole where the model in regress.dtype
    # fits one device, else ranges where hardware.spec has the devices (shards x (ranges + 1)),
    # else streamed
    layout: Literal["auto", "whole", "streamed", "ranges"] = "auto"
    # the earlier switch, still read: always = layout streamed, never = layout whole (with
    # layout auto); auto defers to regress.layout
    streamed: Literal["auto", "always", "never"] = "auto"

    @model_validator(mode="after")
    def _one_layout(self) -> "RegressSection":
        implied = {"always": "streamed", "never": "whole"}.get(self.streamed)
        if implied and self.layout not in ("auto", implied):
            raise ValueError(f"regress.streamed {self.streamed} contradicts regress.layout {self.layout}: "
                             f"set only regress.layout")
        return self

    @property
    def layout_setting(self) -> str:
        """regress.layout with the earlier regress.streamed folded in: auto, whole, streamed, ranges."""
        if self.layout != "auto":
            return self.layout
        return {"always": "streamed", "never": "whole"}.get(self.streamed, "auto")
