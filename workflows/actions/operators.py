"""What `moeflow eplb` does (workflows/commands/operators.py declares what it takes): place experts
and their replicas on EP ranks from a load file, balancedness per layer before/after."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
from rich.table import Table

from moeflow.core.errors import UserError
from moeflow.operators import eplb as E
from workflows.printer import make_console


def read_load(path: str):
    """[layers, experts] float64 array from a .json or .npy file (UserError naming the file)."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{path}: no such load file")
    if p.suffix == ".npy":
        try:
            arr = np.load(p, allow_pickle=False)
        except ValueError as exc:
            raise UserError(f"{path}: not a numeric .npy array ({exc})") from None
    elif p.suffix == ".json":
        try:
            data = json.loads(p.read_text())
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}: invalid JSON at line {exc.lineno}: {exc.msg}") from None
        data = data.get("counts") if isinstance(data, dict) else data
        try:
            arr = np.asarray(data, dtype=np.float64)
        except (TypeError, ValueError):
            raise UserError(f"{path}: expected a layers x experts list of number rows of equal length") from None
    else:
        raise UserError(f"{path}: expected a .json or .npy load file")
    if arr.dtype.kind not in "iuf":
        raise UserError(f"{path}: expected numbers, got dtype {arr.dtype}")
    if arr.ndim != 2:
        raise UserError(f"{path}: expected a layers x experts matrix, got shape {list(arr.shape)}")
    return arr.astype(np.float64)


def eplb(load: str, ep: int, redundant: int, nodes: int, groups: int, as_json: bool) -> None:
    """Print the placement's balancedness table (or the placement as JSON)."""
    weight = read_load(load)
    if redundant < 0:
        raise UserError(f"--redundant {redundant}: must be >= 0")
    start = time.perf_counter()
    phy2log, _, logcnt = E.rebalance_experts(weight, weight.shape[1] + redundant, groups, nodes, ep)
    seconds = time.perf_counter() - start
    summary = E.summary(weight, phy2log, logcnt, ep)
    if as_json:
        sys.stdout.write(json.dumps(summary) + "\n")
        return
    console = make_console(width=120)
    mode = "hierarchical" if groups % nodes == 0 and nodes > 1 else "global"
    table = Table(title=f"EPLB {mode}: {weight.shape[0]} layers x {weight.shape[1]} experts, "
                        f"EP {ep}, {redundant} redundant, {nodes} node(s), {groups} group(s)")
    for col in ("layer", "before", "after"):
        table.add_column(col, justify="right")
    fmt = lambda x: "-" if x is None else f"{x:.4f}"  # noqa: E731
    for row in summary["layers"]:
        table.add_row(str(row["layer"]), fmt(row["before"]), fmt(row["after"]))
    table.add_row("mean", fmt(summary["balancedness_before"]), fmt(summary["balancedness_after"]))
    console.print(table)
    console.print(f"balancedness (mean/max tokens per rank) {fmt(summary['balancedness_before'])} -> "
                  f"{fmt(summary['balancedness_after'])} in {seconds:.2f} s")
