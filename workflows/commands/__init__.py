"""Per-stage CLI commands: each module here defines `register(app: typer.Typer)`.

`workflows.cli` calls every module's `register`, so a stage adds its commands
(`moeflow convert`, `moeflow plan`, ...) by adding a module, without editing
the core CLI.
"""

from __future__ import annotations

import importlib
import pkgutil


def register_all(app) -> None:
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        if hasattr(module, "register"):  # stage.py is the stage commands' helper, not commands
            module.register(app)
