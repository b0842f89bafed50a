"""`moeflow demo`: build a tiny MoE checkpoint and a data set, run the pipeline.

Everything lands under the work dir (default ./demo-work): the debug model in
the real Hugging Face layout, the demo task's train/eval JSONL, and the stage
outputs; MLflow tracks the run in the default local store.
"""

from __future__ import annotations

from pathlib import Path

from moeflow.config import apply_overrides, read_yaml, validate
from moeflow.demo_data import make_dataset
from moeflow.tiny import build_debug_model

DEMO_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "demo.yaml"


def build_assets(workdir: Path, family: str = "qwen3_moe", seed: int = 0) -> dict[str, Path]:
    """Write the debug model and the data set; returns their paths."""
    workdir = workdir.resolve()
    model = build_debug_model(family, workdir / "model", seed=seed)
    train, eval_ = make_dataset(workdir / "data", seed=seed)
    return {"model": model, "train": train, "eval": eval_,
            "train_reverse": train.with_name("train-reverse.jsonl"),
            "eval_reverse": eval_.with_name("eval-reverse.jsonl")}


def run_demo(workdir: Path, *, family: str = "qwen3_moe", overrides: list[str] = (),
             use_cache: bool = False, console=None, serve: bool = False):
    """Build the assets, then run configs/demo.yaml on them.

    With `serve`, the local Ray (and so the deployed endpoint) stays up after
    the pipeline until Ctrl-C; otherwise it goes when the pipeline ends.
    """
    from workflows.raylocal import ray_session
    from workflows.report import event_printer
    from workflows.runner import run_pipeline

    if console:
        console.print(f"building a tiny {family} checkpoint and the demo data under {workdir}/")
    assets = build_assets(Path(workdir), family)
    raw = read_yaml(DEMO_CONFIG)
    raw = apply_overrides(raw, [f"model.path={assets['model']}",
                                f"data.train_file={assets['train']}",
                                f"data.eval_file={assets['eval']}",
                                f"finetune.adapters.reverse.train_file={assets['train_reverse']}",
                                f"finetune.adapters.reverse.eval_file={assets['eval_reverse']}",
                                f"workdir={Path(workdir).resolve() / 'runs'}", *overrides])
    cfg = validate(raw, source=str(DEMO_CONFIG))
    with ray_session(cfg):
        outcome = run_pipeline(cfg, use_cache=use_cache,
                               on_event=event_printer(console) if console else None)
        deployed = (outcome.stages.get("deploy") and outcome.stages["deploy"].result) or {}
        if serve and outcome.ok and deployed.get("url"):
            _serve_until_interrupted(deployed, console)
    return outcome


def _serve_until_interrupted(deployed: dict, console) -> None:
    import time

    if console:
        console.print(f"serving at {deployed['url']}/v1 (OpenAI-compatible; models: "
                      f"{', '.join(deployed.get('models', []))}); Ctrl-C stops it")
    try:
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        pass
