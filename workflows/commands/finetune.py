"""`moeflow finetune CONFIG`: LoRA fine-tune the config's model on Ray Train.

    moeflow finetune configs/demo.yaml
    moeflow finetune configs/demo.yaml --set lora.target_modules='[attention,experts]' --set lora.dropout=0

`moeflow run CONFIG` with `finetune` as its target (workflows/commands/stage.py: the
upstream it needs, `convert` and `plan`, reused from MLflow when cached), then prints the adapter, its MLflow
model version and the held-out accuracy of base vs adapter.
Exit codes: 0 ok, 1 the stage failed, 2 bad input.
"""

from __future__ import annotations

import typer
from rich.console import Console
from rich.table import Table

from workflows.commands.stage import stage_command


def show(console: Console, record: dict) -> None:
    """The adapter, its MLflow model version, and held-out accuracy of base vs adapter."""
    m = record.get("metrics", {})
    table = Table(title="finetune")
    table.add_column("what")
    table.add_column("value")
    rows = [("adapter", record.get("adapter_dir")),
            ("MLflow model", f"{record.get('registered_model')} v{record.get('model_version')}"),
            ("trainable / total params",
             f"{m.get('trainable_params', 0):,.0f} / {m.get('total_params', 0):,.0f} "
             f"({m.get('trainable_pct', 0):.3f}%)"),
            ("all-reduced per step vs LoRA vs base bytes",
             f"{m.get('comm_bytes_per_step', 0):,.0f} / {m.get('lora_bytes', 0):,.0f} / "
             f"{m.get('base_bytes', 0):,.0f}"),
            ("train loss (last step)", f"{m.get('train_loss', float('nan')):.4f}"),
            ("eval loss", f"{m.get('eval_loss', float('nan')):.4f}"),
            ("exact match base -> adapter",
             f"{m.get('base_exact_match', float('nan')):.3f} -> "
             f"{m.get('adapter_exact_match', float('nan')):.3f}")]
    for key in sorted(k for k in m if k.startswith("adapter_exact_match/")):
        task = key.split("/", 1)[1]
        rows.append((f"  task {task}", f"{m.get(f'base_exact_match/{task}', float('nan')):.3f} -> "
                                       f"{m[key]:.3f}"))
    for k, v in rows:
        table.add_row(k, str(v))
    console.print(table)


finetune = stage_command("finetune", show,
                         "LoRA fine-tune (Ray Train) the config's model; the adapter lands in MLflow.",
                         "finetune.max_steps=50")


def register(app: typer.Typer) -> None:
    app.command(name="finetune")(finetune)
