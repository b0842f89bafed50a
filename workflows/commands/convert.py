"""`moeflow convert`, `moeflow inspect`, `moeflow export`: the convert stage alone.

    moeflow inspect demo-work/model
    moeflow convert demo-work/model demo-work/converted --dtype bf16 --workers 2
    moeflow export demo-work/converted --to hf demo-work/exported

`convert --workers 1` (the default) converts in this process (two files at a
time on threads when the host has two CPUs); `--workers N`
(N > 1) converts N output files at a time as Ray tasks, on the cluster at
$RAY_ADDRESS or else on a local Ray started for the command (own temp dir,
shut down at the end). Exit codes: 0 ok, 2 bad input (one line).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Optional

import typer

from moeflow.errors import UserError
from workflows.printer import make_console

console = make_console(width=160)


def inspect(path: str = typer.Argument(..., help="checkpoint directory (HF layout, safetensors)"),
            as_json: bool = typer.Option(False, "--json", help="print the report as JSON")):
    """Parse a checkpoint's config, index and shard headers (no tensor data) and report;
    a PEFT adapter directory (adapter_config.json) is reported as an adapter."""

    # lazy: `moeflow --help` loads none of what commands run (tests/test_printer.py)
    from moeflow.checkpoint.parse import read_checkpoint
    from moeflow.checkpoint.report import inspect_tables
    from moeflow.checkpoint.summary import summarize

    if (Path(path) / "adapter_config.json").is_file() and not (Path(path) / "config.json").is_file():
        info = adapter_summary(Path(path))
        if as_json:
            print(json.dumps(info, indent=2))
            return
        # lazy: `moeflow --help` loads none of what commands run (tests/test_printer.py)
        from rich.table import Table

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
    # lazy: `moeflow --help` loads none of what commands run (tests/test_printer.py)
    from moeflow.checkpoint.st_io import read_header

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


def convert(src: str = typer.Argument(..., help="source checkpoint directory"),
            out: str = typer.Argument(..., help="output directory (must not exist or be empty)"),
            dtype: str = typer.Option("bf16", help="bf16 | fp32 | keep | fp8 (fp8 keeps FP8 blocks + scales)"),
            workers: int = typer.Option(1, min=1, help="output files converted in parallel (Ray tasks if > 1)"),
            allow_nonfinite: bool = typer.Option(False, "--allow-nonfinite", help="accept NaN/Inf weights"),
            no_verify: bool = typer.Option(False, "--no-verify", help="skip tensor and logits verification"),
            checksum: str = typer.Option("xxh3_128", help="per-tensor checksum in the manifest: xxh3_128 "
                                         "(fast, detects corruption) | sha256 (cryptographic)"),
            trust_remote_code: bool = typer.Option(False, "--trust-remote-code",
                                                   help="run SRC's own modeling code (auto_map); "
                                                        "its sha256 is pinned in the manifest")):
    """Convert SRC to the runtime layout in OUT, verified tensor by tensor."""
    # lazy: `moeflow --help` loads none of what commands run (tests/test_printer.py)
    from moeflow.checkpoint.convert import convert_checkpoint
    from moeflow.checkpoint.report import log_to_mlflow, verification_table
    from moeflow.remote_code import activate

    if trust_remote_code:
        activate(src, trust=True)  # else a checkpoint that needs its code is refused in one line

    kwargs: dict[str, Any] = dict(dtype=dtype, workers=workers, allow_nonfinite=allow_nonfinite,
                  verify=not no_verify, checksum=checksum, progress=lambda msg: console.print(f"  {msg}"))
    start = time.perf_counter()
    if workers > 1:
        # lazy: `moeflow --help` loads none of what commands run (tests/test_printer.py)
        from workflows.raylocal import ray_session

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


def export(converted: str = typer.Argument(..., help="a directory written by `moeflow convert`"),
           to: str = typer.Option("hf", "--to", help="target layout (hf: the family's original layout)"),
           out: Optional[str] = typer.Argument(None, help="output directory")):
    """Write a converted checkpoint back in the family's original HF layout."""
    # lazy: `moeflow --help` loads none of what commands run (tests/test_printer.py)
    from moeflow.checkpoint.export import export_hf

    if to != "hf":
        raise UserError(f"--to {to}: unknown target layout (supported: hf)")
    if not out:
        raise UserError("name the output directory: moeflow export CONVERTED --to hf OUT")
    result = export_hf(converted, out, progress=lambda msg: console.print(f"  {msg}"))
    console.print(f"exported {result['tensors']} tensors in {result['shards']} shards -> "
                  f"{result['output_dir']}")


def register(app: typer.Typer) -> None:
    app.command(name="inspect")(inspect)
    app.command(name="convert")(convert)
    app.command(name="export")(export)
