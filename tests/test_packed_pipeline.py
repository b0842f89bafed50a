"""The real pipeline over a quantised base kept as stored: the demo's pre-trained Qwen3-MoE
as an INT4 group-32 compressed-tensors release (routed experts INT4, attention as
trained), `convert.dtype: keep`, then plan, finetune (Ray Train, `finetune.merge`: the
adapter merged into the release's own format) and regress (the golden suite, base and
adapter) load it with the routed experts packed. (slow: four real stages through the CLI,
~2-3 min on 2 cores)"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import yaml

from tests.conftest import cli_env
from workflows.demo import DEMO_CONFIG, build_assets

pytestmark = [pytest.mark.slow, pytest.mark.integration]


def test_convert_keep_finetune_regress_on_an_int4_release(tmp_path):
    from moeflow_testing.releases import ct_release

    assets = build_assets(tmp_path / "demo")
    release = ct_release(assets["model"], tmp_path / "int4", "int4-group", experts_only=True)
    raw = yaml.safe_load(DEMO_CONFIG.read_text())
    raw["model"]["path"] = str(release)
    raw["convert"] = {"dtype": "keep"}
    raw["stages"] = {"enabled": ["convert", "plan", "finetune", "regress"]}
    raw["data"].update(train_file=str(assets["train"]), eval_file=str(assets["eval"]))
    raw["finetune"].update(max_steps=6, checkpoint_every=6, merge=True)
    raw["finetune"].pop("adapters")
    raw["regress"].pop("record_baseline")
    # no gate on the adapter vs its base (6 steps need not improve the suite) and no baseline in
    # this fresh store: regress evaluates both models and must pass, so exit 0 is required
    raw["regress"]["compare_base"] = False
    raw["workdir"] = str(tmp_path / "runs")
    raw["tracking"] = {"uri": f"sqlite:///{tmp_path}/mlflow.db"}
    cfg = tmp_path / "pipeline.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    out = subprocess.run([sys.executable, "-m", "workflows.cli", "run", str(cfg), "--no-cache"],
                         cwd=tmp_path, env=cli_env(tmp_path), capture_output=True, text=True,
                         timeout=900)
    log = out.stdout[-4000:] + out.stderr[-4000:]
    assert out.returncode == 0, log
    run_id = re.search(r"parent run (\w+)", out.stdout).group(1)  # type: ignore[union-attr]
    status = subprocess.run([sys.executable, "-m", "workflows.cli", "status", run_id, "--json",
                             "--tracking-uri", raw["tracking"]["uri"]], cwd=tmp_path,
                            env=cli_env(tmp_path), capture_output=True, text=True, timeout=300)
    stages = {s["name"]: s for s in json.loads(status.stdout)["stages"]}
    assert [stages[n]["state"] for n in ("convert", "plan", "finetune", "regress")] == ["done"] * 4, log
    converted = next((tmp_path / "runs").rglob("converted/manifest.json")).parent
    manifest = json.loads((converted / "manifest.json").read_text())
    assert list(manifest["kept_formats"]) == ["pack-quantized"] and not manifest["dequantized"]
    assert "quantization_config" in json.loads((converted / "config.json").read_text())
    # finetune trained a standard PEFT adapter over the packed base; regress evaluated base and it
    adapter = next((tmp_path / "runs").rglob("adapter_config.json"))
    assert json.loads(adapter.read_text())["peft_type"] == "LORA"
    results, = [p for p in (tmp_path / "runs").rglob("results.json") if "regress" in str(p.parent)]
    models = json.loads(results.read_text())["models"]
    # every task of the golden suite this model can run (lm_eval / image tasks are skipped, and
    # say why) scored for both, on the packed base
    scored = {label: {t: r for t, r in models[label]["tasks"].items() if "skipped" not in r}
              for label in ("base", "adapter")}
    assert scored["base"] and set(scored["adapter"]) == set(scored["base"]), log
    for label, tasks in scored.items():
        for task, result in tasks.items():
            values = [m["value"] for m in result["metrics"].values()]
            assert values and all(v == v for v in values), (label, task, result)
    # finetune.merge: the release again, adapter folded into attention, INT4 experts as stored
    merged = next((tmp_path / "runs").rglob("merged/manifest.json")).parent
    check = json.loads((merged / "verification.json").read_text())
    assert check["passed"] and check["functional"]["passed"], check
    ours = json.loads((merged / "manifest.json").read_text())
    changed = ours["merged_adapter"]["tensors"]
    assert changed and all(".self_attn." in n for n in changed) and not ours["merged_adapter"]["requantized"]
    packed = {n for n, e in manifest["tensors"].items() if ".experts." in n}
    assert packed and all(ours["tensors"][n] == manifest["tensors"][n] for n in packed)
