"""`convert:` section — options of the weight conversion stage."""

from typing import Literal

from pydantic import Field

from moeflow.core.sections import Section


class ConvertSection(Section):
    # target precision; FP8 block-scaled source weights are dequantised to it,
    # or kept as FP8 with their (fused) scales for "fp8"
    dtype: Literal["bf16", "fp32", "keep", "fp8"] = "bf16"
    workers: int | None = Field(default=None, ge=1)  # parallel Ray tasks; None: one per CPU
    allow_nonfinite: bool = False  # NaN/Inf in a weight is an error unless set
    # manifest checksum per tensor: xxh3_128 runs at memory speed; sha256 for a cryptographic digest
    checksum: Literal["xxh3_128", "sha256"] = "xxh3_128"
