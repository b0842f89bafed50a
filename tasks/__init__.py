"""Pipeline stages: one module per stage, each defining `STAGE = StageSpec(...)`.

`workflows.dag.registry()` discovers them, so adding a stage is adding a module here.
"""

from __future__ import annotations

from tasks.base import StageContext, StageSpec

__all__ = ["StageContext", "StageSpec"]
