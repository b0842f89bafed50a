"""What `moeflow inspect`, `convert` and `export` do (workflows/commands/convert.py declares what
they take): a checkpoint's report, its conversion to the runtime layout, and back to HF's."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from rich.table import Table

from moeflow.checkpoint.convert import convert_checkpoint
from moeflow.checkpoint.export import export_hf
from moeflow.checkpoint.parse import read_checkpoint
from moeflow.checkpoint.report import inspect_tables, log_to_mlflow, verification_table
from moeflow.checkpoint.st_io import read_header
from moeflow.checkpoint.summary import summarize
from moeflow.core.errors import UserError
from moeflow.model.remote_code import activate
from workflows.printer import make_console
from workflows.raylocal import ray_session

console = make_console(width=160)


def inspect(path: str, as_json: bool) -> None:
    """Print (or print as JSON) a checkpoint's or a PEFT adapter's report."""
    if (Path(path) / "adapter_config.json").is_file() and not (Path(path) / "config.json").is_file():
        info = adapter_summary(Path(path))
        if as_json:
            print(json.dumps(info, indent=2))
            return
        table = Table(title=f"PEFT adapter {path}", show_header=False, title_justify="left")
        table.add_column("field", no_wrap=True)
        table.add_column("value", overflow="fold")
        for key, value in info.items():
            table.add_row(key, ", ".join(map(str, value)) if isinstance(value, list) else str(value))
        console.print(table)
        return
    summary = summarize(read_checkpoint(path))
    if as_json:
        print(json.dumps(summary, indent=2))
        return
    for table in inspect_tables(summary):
        console.print(table)


def adapter_summary(path) -> dict:
    """What `inspect` reports for a PEFT adapter dir: its config and tensor headers
    (adapter_model.safetensors read for its header only).

    Raises:
        UserError: unreadable adapter_config.json or a missing/corrupt weights file.
    """
    conf_path = path / "adapter_config.json"
    try:
        conf = json.loads(conf_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"{conf_path}: not readable JSON ({exc})") from None
    weights = path / "adapter_model.safetensors"
    if not weights.is_file():
        raise UserError(f"{path}: PEFT adapter without adapter_model.safetensors")
    tensors, _ = read_header(weights)
    dtypes = sorted({t.dtype for t in tensors.values()})
    targets = conf.get("target_modules") or []
    return {"kind": "PEFT adapter", "peft_type": conf.get("peft_type"),
            "base_model": conf.get("base_model_name_or_path"), "rank": conf.get("r"),
            "alpha": conf.get("lora_alpha"),
            "target_modules": sorted(targets) if isinstance(targets, list) else targets,
            "target_parameters": conf.get("target_parameters") or [],
            "tensors": len(tensors), "bytes": sum(t.nbytes for t in tensors.values()),
            "dtypes": dtypes}


def convert(src: str, out: str, dtype: str, workers: int, allow_nonfinite: bool, no_verify: bool,
            checksum: str, trust_remote_code: bool) -> None:
    """Convert, verify, print the verification table, log to MLflow."""
    if trust_remote_code:
        activate(src, trust=True)  # else a checkpoint that needs its code is refused in one line

    kwargs: dict[str, Any] = dict(dtype=dtype, workers=workers, allow_nonfinite=allow_nonfinite,
                  verify=not no_verify, checksum=checksum, progress=lambda msg: console.print(f"  {msg}"))
    start = time.perf_counter()
    if workers > 1:
        with ray_session(None):
            result = convert_checkpoint(src, out, **kwargs)
    else:
        result = convert_checkpoint(src, out, **kwargs)
    result["seconds"] = round(time.perf_counter() - start, 3)
    if result["report"]:
        console.print(verification_table(result["report"]))
    log_to_mlflow(result)
    console.print(f"converted {result['family']} ({result['tensors']} tensors, {result['files']} files, "
                  f"{result['bytes'] / 1e6:.1f} MB) in {result['seconds']:.1f} s -> {result['output_dir']}")


def export(converted: str, to: str, out: str | None) -> None:
    """Write a converted checkpoint back in the family's HF layout."""
    if to != "hf":
        raise UserError(f"--to {to}: unknown target layout (supported: hf)")
    if not out:
        raise UserError("name the output directory: moeflow export CONVERTED --to hf OUT")
    result = export_hf(converted, out, progress=lambda msg: console.print(f"  {msg}"))
    console.print(f"exported {result['tensors']} tensors in {result['shards']} shards -> "
                  f"{result['output_dir']}")
