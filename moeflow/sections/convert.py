"""`convert:` section — options of the weight conversion stage."""

from typing import Literal

from pydantic import Field

from moeflow.sections import Section


class ConvertSection(Section):
    dtype: Literal["bf16", "fp32", "keep", "fp8"] = "bf16"  # target precision
    workers: int | None = Field(default=None, ge=1)  # parallel Ray tasks; None: one per CPU
    allow_nonfinite: bool = False  # NaN/Inf in a weight is an error unless set
