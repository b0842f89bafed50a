"""`moeflow demo`: a tiny pre-trained MoE checkpoint and a data set; run the pipeline.

Everything lands under the work dir (default ./demo-work): the model in the
real Hugging Face layout, the demo task's train/eval JSONL, and the stage
outputs; MLflow tracks the run in the default local store.

The model is the shipped demo base (assets/demo-base, a Qwen3-MoE pre-trained
on the demo language by `python -m moeflow_testing.demo_base`; see that module),
copied into the work dir. Other families (`--family`) are random debug models.

The builders (moeflow_testing/), the base (assets/) and the config (configs/) are in the
repository, not in the installed package: the demo runs from a checkout.
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from moeflow.core.config import apply_overrides, read_yaml, validate
from moeflow.core.errors import UserError
from moeflow.core.fsutil import staged_dir

REPO = Path(__file__).resolve().parents[1]
DEMO_CONFIG = REPO / "configs" / "demo.yaml"


def builders():
    """(demo_base, demo_data, tiny): the demo's builders, from the checkout this module runs
    in (moeflow_testing/, which `pip install .` leaves out and an editable install does not
    map: the checkout goes on sys.path)."""
    if not (REPO / "moeflow_testing" / "__init__.py").is_file() or not DEMO_CONFIG.is_file():
        raise UserError("`moeflow demo` runs from a checkout of the moeflow repository (its model and data "
                        "builders, assets/ and configs/ are not installed with the package): clone it and "
                        "run `make demo` there")
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    # lazy: found only once the checkout is on sys.path (above)
    from moeflow_testing import demo_base, demo_data, tiny

    return demo_base, demo_data, tiny


def build_assets(workdir: Path, family: str = "qwen3_moe", seed: int = 0) -> dict[str, Path]:
    """Write the model (a copy of the shipped pre-trained base for its family, else a
    random debug model) and the data set; returns their paths."""
    demo_base, demo_data, tiny = builders()
    workdir = workdir.resolve()
    if family == demo_base.RECIPE["family"]:
        model = copy_demo_base(workdir / "model")
    else:
        model = tiny.build_debug_model(family, workdir / "model", seed=seed)
    # the pre-trained base replays its language while fine-tuning (see make_dataset)
    train, eval_ = demo_data.make_dataset(workdir / "data", seed=seed,
                                          replay=0.5 if family == demo_base.RECIPE["family"] else 0.0)
    return {"model": model, "train": train, "eval": eval_,
            "train_reverse": train.with_name("train-reverse.jsonl"),
            "eval_reverse": eval_.with_name("eval-reverse.jsonl")}


def copy_demo_base(out: Path) -> Path:
    """Copy assets/demo-base to `out` (temp dir, then rename: never half-copied)."""
    asset = builders()[0].ASSET

    if not (asset / "model.safetensors.index.json").is_file():
        raise UserError(f"the shipped demo base is missing ({asset}); rebuild it with "
                        f"`python -m moeflow_testing.demo_base {asset}`")
    with staged_dir(out) as tmp:
        shutil.copytree(asset, tmp, dirs_exist_ok=True)
    return out


def run_demo(workdir: Path, *, family: str = "qwen3_moe", overrides: Sequence[str] = (),
             use_cache: bool = False, console=None, serve: bool = False):
    """Build the assets, then run configs/demo.yaml on them.

    With `serve`, the local Ray (and so the deployed endpoint) stays up after
    the pipeline until Ctrl-C; otherwise it goes when the pipeline ends.
    """
    # lazy: loads mlflow, ray, which importing this module does not
    from workflows.raylocal import ray_session
    from workflows.report import event_printer
    from workflows.runner import run_pipeline

    demo_base = builders()[0]
    if console:
        what = ("copying the pre-trained demo base" if family == demo_base.RECIPE["family"]
                else f"building a tiny random {family} checkpoint")
        console.print(f"{what} and the demo data under {workdir}/")
    assets = build_assets(Path(workdir), family)
    raw = read_yaml(DEMO_CONFIG)
    raw = apply_overrides(raw, [f"model.path={assets['model']}",
                                f"data.train_file={assets['train']}",
                                f"data.eval_file={assets['eval']}",
                                f"finetune.adapters.reverse.train_file={assets['train_reverse']}",
                                f"finetune.adapters.reverse.eval_file={assets['eval_reverse']}",
                                f"workdir={Path(workdir).resolve() / 'runs'}", *overrides])
    cfg = validate(raw, source=str(DEMO_CONFIG))
    # without --serve the pipeline starts its own Ray after it has priced itself (its host
    # probe then sees no Ray start-up beside it); --serve keeps Ray up past the pipeline
    with ray_session(cfg) if serve else contextlib.nullcontext():
        outcome = run_pipeline(cfg, use_cache=use_cache,
                               on_event=event_printer(console) if console else None)
        deployed = (outcome.stages.get("deploy") and outcome.stages["deploy"].result) or {}
        if serve and outcome.ok and deployed.get("url"):
            _serve_until_interrupted(deployed, console)
    return outcome


def _serve_until_interrupted(deployed: dict, console) -> None:
    if console:
        console.print(f"serving at {deployed['url']}/v1 (OpenAI-compatible; models: "
                      f"{', '.join(deployed.get('models', []))}); Ctrl-C stops it")
    try:
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        pass
