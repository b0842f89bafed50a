"""`moeflow regress`: evaluate a model (+ adapter) or an endpoint on a suite; record
or compare baselines in MLflow.

    moeflow regress --model demo-work/model --record-baseline golden-v1
    moeflow regress --model demo-work/model --adapter ADAPTER_DIR --baseline golden-v1
    moeflow regress --endpoint http://127.0.0.1:8000 --served-model demo --baseline golden-v1

The candidate is compared with the baseline sample by sample (paired deltas)
and, by default, must reproduce its recorded outputs (greedy tokens, per-token
log-probs): `--agreement report` for a meant change (task metrics still gate).

Exit codes: 0 passed / recorded, 1 a metric regressed, 2 bad input.
"""

from __future__ import annotations

from typing import Optional

import typer


def regress(
    model: Optional[str] = typer.Option(None, help="base checkpoint dir (HF layout)"),
    adapter: Optional[str] = typer.Option(None, help="PEFT adapter dir applied to --model"),
    endpoint: Optional[str] = typer.Option(None, help="OpenAI-compatible server URL instead of --model"),
    served_model: Optional[str] = typer.Option(None, help="model name to request from --endpoint"),
    tokenizer: Optional[str] = typer.Option(None, help="with --endpoint: local HF tokenizer dir for lm-eval tasks"),
    suite: Optional[str] = typer.Option(None, help="suite YAML (default: the shipped golden suite)"),
    baseline: Optional[str] = typer.Option(None, help="compare against this recorded baseline"),
    record_baseline: Optional[str] = typer.Option(None, "--record-baseline",
                                                  help="record the results as baseline NAME"),
    tracking_uri: Optional[str] = typer.Option(None,
                                               help="MLflow tracking URI (default $MLFLOW_TRACKING_URI, else mlruns/)"),
    experiment: str = typer.Option("moeflow", help="MLflow experiment for the runs"),
    shards: int = typer.Option(1, min=1, help="Ray tasks to shard the eval set over (1: in-process)"),
    dtype: str = typer.Option("float32", help="compute dtype"),
    batch_size: int = typer.Option(16, min=1, help="requests per forward pass"),
    seed: int = typer.Option(0, help="torch seed"),
    agreement: str = typer.Option("gate", help="output agreement with --baseline's recorded outputs: "
                                  "gate (an unchanged model must reproduce them), report, off"),
    max_kl: float = typer.Option(1e-3, min=0, help="largest mean per-token KL vs the baseline (nats)"),
    min_token_agreement: float = typer.Option(0.95, min=0, max=1,
                                              help="smallest share of greedy / top-1 tokens equal to the baseline's"),
    tie_margin: float = typer.Option(0.05, min=0, help="a flip whose log-odds swing is at most "
                                     "this (nats) is a near tie, not a change"),
):
    """Evaluate on a fixed suite; record a baseline or fail on regression against one."""
    options = dict(locals())  # the command's options, by name, before anything else is bound
    # lazy: evaluation loads torch and transformers; `moeflow --help` loads none of it (tests/test_printer.py)
    from workflows.actions import regress as action

    action.run(**options)


def register(app: typer.Typer) -> None:
    """Add `moeflow regress` to the CLI."""
    app.command(name="regress")(regress)
