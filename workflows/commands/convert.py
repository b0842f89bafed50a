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

from typing import Optional

import typer


def inspect(path: str = typer.Argument(..., help="checkpoint directory (HF layout, safetensors)"),
            as_json: bool = typer.Option(False, "--json", help="print the report as JSON")):
    """Parse a checkpoint's config, index and shard headers (no tensor data) and report;
    a PEFT adapter directory (adapter_config.json) is reported as an adapter."""
    options = dict(locals())  # the command's options, by name, before anything else is bound
    # lazy: the checkpoint readers; `moeflow --help` loads none of it (tests/test_printer.py)
    from workflows.actions import convert as action

    action.inspect(**options)


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
    options = dict(locals())  # the command's options, by name, before anything else is bound
    # lazy: conversion loads torch; `moeflow --help` loads none of it (tests/test_printer.py)
    from workflows.actions import convert as action

    action.convert(**options)


def export(converted: str = typer.Argument(..., help="a directory written by `moeflow convert`"),
           to: str = typer.Option("hf", "--to", help="target layout (hf: the family's original layout)"),
           out: Optional[str] = typer.Argument(None, help="output directory")):
    """Write a converted checkpoint back in the family's original HF layout."""
    options = dict(locals())  # the command's options, by name, before anything else is bound
    # lazy: the exporter loads torch; `moeflow --help` loads none of it (tests/test_printer.py)
    from workflows.actions import convert as action

    action.export(**options)


def register(app: typer.Typer) -> None:
    app.command(name="inspect")(inspect)
    app.command(name="convert")(convert)
    app.command(name="export")(export)
