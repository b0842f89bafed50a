"""The DAG: dependency order, selection of stages, and cache keys.

A stage's cache key is a hash of its name, its config sections, its code
version (the source of every moeflow module it can reach, tasks/base.py), the
installed versions of the libraries whose behaviour shapes its outputs
(`LIBRARIES`), fingerprints of the local files its config names, and its
upstream stages' keys — so changing any of those reruns the stage and
everything downstream of it.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import pkgutil
from dataclasses import replace
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Any, Mapping

import tasks
from moeflow.core.errors import UserError
from tasks.base import StageSpec


def registry() -> dict[str, StageSpec]:
    """All stages defined in `tasks/` (each module's `STAGE`), in dependency order
    (upstream first; optional edges order stages too)."""
    found: dict[str, StageSpec] = {}
    for info in sorted(pkgutil.iter_modules(tasks.__path__), key=lambda m: m.name):
        if info.name.startswith("_") or info.name == "base":
            continue
        module = importlib.import_module(f"tasks.{info.name}")
        spec = getattr(module, "STAGE", None)
        if isinstance(spec, StageSpec):
            found[spec.name] = spec
    order = topological_order(with_optional_edges(found))
    return {name: found[name] for name in order}


def topological_order(stages: Mapping[str, Any]) -> list[str]:
    """Stage names, upstream before downstream (ties in name order).

    Raises:
        UserError: an upstream names a stage that does not exist, or a cycle.
    """
    for name, spec in stages.items():
        for up in spec.upstream:
            if up not in stages:
                raise UserError(f"stage {name} depends on unknown stage {up!r}; "
                                f"known: {', '.join(sorted(stages))}")
    order: list[str] = []
    state: dict[str, int] = {}  # 1 visiting, 2 done

    def visit(name: str, path: tuple[str, ...]) -> None:
        if state.get(name) == 2:
            return
        if state.get(name) == 1:
            raise UserError(f"stage dependency cycle: {' -> '.join(path + (name,))}")
        state[name] = 1
        for up in sorted(stages[name].upstream):
            visit(up, path + (name,))
        state[name] = 2
        order.append(name)

    for name in sorted(stages):
        visit(name, ())
    return order


def with_optional_edges(stages: Mapping[str, Any], enabled=None) -> dict[str, Any]:
    """Stages whose `after` names that are present (and enabled, when `enabled` is
    given) are folded into `upstream`; absent ones are dropped. Keeps the given order."""
    present = {n for n in stages if enabled is None or n in enabled}
    out = {}
    for name, spec in stages.items():
        extra = tuple(a for a in getattr(spec, "after", ()) if a in present and a not in spec.upstream)
        out[name] = replace(spec, upstream=spec.upstream + extra) if extra else spec
    return out


def downstream(stages: Mapping[str, Any], roots: set[str]) -> set[str]:
    """`roots` plus every stage that depends on them, transitively."""
    out = set(roots)
    changed = True
    while changed:
        changed = False
        for name, spec in stages.items():
            if name not in out and any(u in out for u in spec.upstream):
                out.add(name)
                changed = True
    return out


def upstream_closure(stages: Mapping[str, Any], roots: set[str]) -> set[str]:
    """`roots` plus every stage they depend on, transitively."""
    out, todo = set(), list(roots)
    while todo:
        name = todo.pop()
        if name not in out:
            out.add(name)
            todo.extend(stages[name].upstream)
    return out


def fingerprint_paths(value: Any) -> list[list]:
    """Size and mtime of the local files (or directories) named in `value`.

    Cheap (no content hashing), so editing a data file or rebuilding a model
    changes the key of the stages that read it. A directory contributes its
    top-level files.
    """
    found: list[list] = []

    def walk(v: Any) -> None:
        if isinstance(v, dict):
            for item in v.values():
                walk(item)
        elif isinstance(v, (list, tuple)):
            for item in v:
                walk(item)
        elif isinstance(v, str) and "://" in v:
            from moeflow.core.storage import fingerprint  # a store URI: its manifest's or object's identity

            found.append([v, fingerprint(v)])
        elif isinstance(v, str) and v:
            path = Path(v)
            try:
                if path.is_file():
                    st = path.stat()
                    found.append([v, st.st_size, st.st_mtime_ns])
                elif path.is_dir():
                    for child in sorted(path.iterdir()):
                        if child.is_file():
                            st = child.stat()
                            found.append([str(child), st.st_size, st.st_mtime_ns])
            except OSError:
                pass

    walk(value)
    return found


def lookup(data: dict, dotted: str) -> Any:
    node: Any = data
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def lookup_all(data: dict, dotted: str) -> list:
    """Values at a dotted key whose parts may be `*` (every key of a mapping), in key order."""
    nodes: list = [data]
    for part in dotted.split("."):
        nxt = []
        for node in nodes:
            if not isinstance(node, dict):
                continue
            if part == "*":
                nxt += [node[k] for k in sorted(node)]
            elif part in node:
                nxt.append(node[part])
        nodes = nxt
    return nodes


# libraries whose version changes what a stage writes (conversion, training
# numerics, adapter format, Ray Train's checkpoint layout, MLflow's records)
LIBRARIES = ("torch", "transformers", "peft", "ray", "mlflow", "safetensors")


@lru_cache(maxsize=1)
def library_versions() -> dict[str, str]:
    """Installed versions of `LIBRARIES` ("-" for one that is not installed)."""
    out = {}
    for lib in LIBRARIES:
        try:
            out[lib] = metadata.version(lib)
        except metadata.PackageNotFoundError:
            out[lib] = "-"
    return out


def cache_key(name: str, section_config: dict, code_version: str,
              upstream_keys: Mapping[str, str], files: list | tuple = (),
              libraries: Mapping[str, str] | None = None) -> str:
    """Deterministic key of one stage execution's inputs.

    Args:
        files: paths (or None) whose size/mtime are part of the key.
        libraries: library versions (default: the installed `library_versions()`).
    """
    material = {
        "stage": name,
        "config": section_config,
        "files": fingerprint_paths([f for f in files if f]),
        "code": code_version,
        "libraries": dict(library_versions() if libraries is None else libraries),
        "upstream": dict(sorted(upstream_keys.items())),
    }
    blob = json.dumps(material, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:20]
