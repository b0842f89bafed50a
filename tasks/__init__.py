"""Pipeline stages: one module per stage, each defining `STAGE = StageSpec(...)`.

`registry()` discovers them, so adding a stage is adding a module here.
"""

from __future__ import annotations

import importlib
import pkgutil

from tasks.base import StageContext, StageSpec

__all__ = ["StageContext", "StageSpec", "registry"]


def registry() -> dict[str, StageSpec]:
    """All stages defined in `tasks/`, in dependency order (upstream first)."""
    found: dict[str, StageSpec] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name.startswith("_") or info.name == "base":
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        spec = getattr(module, "STAGE", None)
        if isinstance(spec, StageSpec):
            found[spec.name] = spec
    from workflows.dag import topological_order, with_optional_edges  # local: workflows imports tasks

    order = topological_order(with_optional_edges(found))  # optional edges order stages too
    return {name: found[name] for name in order}
