"""`calibrate:` section — quantisation scheme, golden set, end-to-end tolerance."""

from typing import Annotated, Literal

from pydantic import Field

from moeflow.core.sections import ExistingPath, Section


class CalibrateSection(Section):
    # fp8: FP8_DYNAMIC; w8a16: int8 weights; fp8-block: 128x128 scales; int8: W8A8
    # (fp8-block and int8 are run by moeflow's own loader; transformers cannot load them)
    scheme: Literal["fp8", "w8a16", "fp8-block", "int8"] = "fp8"
    golden: ExistingPath | None = None  # suite YAML whose records are the golden set; None: the shipped one
    samples: int = Field(default=64, ge=1)  # golden records used (round-robin over its tasks)
    max_tokens: int = Field(default=64, ge=1)  # text samples are cut to this many tokens
    ignore: list[str] = Field(default_factory=list)  # more modules kept in high precision (names or re:)
    quantize_vision: bool = False  # the vision tower and projector stay unquantised unless asked
    min_logits_cosine: float = Field(default=0.999, ge=0, le=1)  # end-to-end check on final logits
    min_top1_agreement: float = Field(default=0.99, ge=0, le=1)  # greedy next-token agreement
    # a top-1 flip whose log-odds swing is at most this (nats) is a near tie and agrees
    # (moeflow.evaluation.ties.TIE_MARGIN; the section sits below it: same value)
    tie_margin: float = Field(default=0.05, ge=0)
    precision_plan: bool = True  # return sensitive modules to high precision until the check holds
    plan_step: int = Field(default=1, ge=1)  # modules returned per round (larger: fewer rounds)
    max_plan_steps: int = Field(default=16, ge=0)  # rounds before giving up (the stage then fails)
    shards: int = Field(default=1, ge=1)  # Ray tasks the golden set is split over; 1: in-process
    # Ray workers the decoder layers are split over (contiguous ranges: each quantises and
    # compares only its layers, same report); auto: one process while the model in float32
    # fits one device of hardware.spec, else one worker per device of a node
    layer_workers: Annotated[int, Field(ge=1)] | Literal["auto"] = "auto"
    # routed experts of a layer split into this many groups, one worker each; auto: fewest that fit a device
    expert_groups: Annotated[int, Field(ge=1)] | Literal["auto"] = "auto"
