"""`moeflow rebalance`: re-place experts from the load a deployment actually serves.

1. Read the live load: tokens per (MoE layer, logical expert) over the last
   `window_s`, summed over the replicas (moeflow.serving.loadbook).
2. Score three placements for the plan's EP size on that load, per layer:
   the one served now, the operators stage's (placed on the golden prompts),
   and a new one (the operators stage's EPLB permutation, moeflow/operators/
   placement.py, computed on the live load). Balancedness = mean / max tokens
   per EP rank (vLLM's definition).
3. Write the placement for engines that replicate: SGLang's
   `--init-expert-location` file and vLLM's EPLB config (EPLB with the
   operators stage's redundant experts, on the live load), plus the live load
   as an `expert_load.json` the operators stage format.
4. Apply it: a permuted copy of the original checkpoint (same function,
   experts moved), rolled out on the running Serve app one replica at a time
   (with one extra replica during the rollout where Ray has room, so the
   serving capacity never drops).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from moeflow.core import storage
from moeflow.core.errors import UserError
from moeflow.operators import eplb
from moeflow.operators import placement as PL
from moeflow.operators.placement import plan_permutation, sglang_expert_location, vllm_eplb_args
from moeflow.serving.loadbook import find_load_book


def scores(counts: np.ndarray, ep: int, perms: dict[str, np.ndarray]) -> dict[str, list[float]]:
    """Per-layer balancedness of each placement ({name: [L][E] perm}) on `counts` [L, E]."""

    out = {}
    for name, perm in perms.items():
        placed = np.take_along_axis(counts, np.asarray(perm, dtype=np.int64), 1)  # [L, E]
        out[name] = [round(float(b), 6) for b in eplb.balancedness(eplb.rank_load_contiguous(placed, ep))]
    return out


def plan(counts, ep: int, groups: int, redundant: int, nodes: int, served: list[list[int]],
         operators: list[list[int]] | None) -> dict:
    """The re-placement of a live load and how it compares with the served and operators ones.

    Args:
        counts: [L][E] tokens per logical expert.
        served / operators: [L][E] perms (slot -> logical expert) of those placements.

    Returns:
        {"perms", "balancedness": {served, operators, replaced}, "hottest_layer", "eplb", "changed"}.
    """

    w = np.asarray(counts, dtype=np.float64)
    if w.ndim != 2 or w.sum() <= 0:
        raise UserError("rebalance: the deployment served no routed tokens in the window; send traffic "
                        "or widen --window")
    identity = np.tile(np.arange(w.shape[1]), (w.shape[0], 1))
    new = plan_permutation(w, ep, groups)
    perms = {"served": np.asarray(served), "operators": np.asarray(operators if operators else identity),
             "replaced": np.asarray(new["perms"])}
    bal = scores(w, ep, perms)
    # a layer keeps whichever of served / new is better on the live load (never worse than now)
    keep = [bal["served"][i] >= bal["replaced"][i] for i in range(w.shape[0])]
    final = [perms["served"][i].tolist() if k else new["perms"][i] for i, k in enumerate(keep)]
    bal["replaced"] = scores(w, ep, {"x": np.asarray(final)})["x"]
    hottest = int(np.argmax((w.max(1) / np.maximum(w.mean(1), 1e-9))))
    phy2log, _, logcnt = eplb.rebalance_experts(w, w.shape[1] + redundant, groups, nodes, ep)
    summary = eplb.summary(w, phy2log, logcnt, ep)
    return {"perms": final, "balancedness": bal, "hottest_layer": hottest, "eplb": summary,
            "phy2log": phy2log, "changed": final != perms["served"].tolist()}


def run_inputs(run_id: str, tracking_uri: str | None) -> dict:
    """What a pipeline run says about the placement: the original checkpoint, the operators
    stage's layout and permutation, the load it placed from."""
    # lazy: loads mlflow, which importing this module does not
    from moeflow.core import tracking as T

    client = T.client_for(T.existing_tracking_uri(tracking_uri))
    tags = T.get_pipeline_run(client, run_id).data.tags
    ops_run = tags.get(T.STAGE_RUN_PREFIX + "operators")
    if not ops_run or tags.get(T.STATE_PREFIX + "operators") not in ("done", "reused"):
        raise UserError(f"run {run_id}: no finished operators stage (its placement is what rebalance "
                        f"improves on); run it with `moeflow run CONFIG --stages operators`")
    record = T.read_result(client.get_run(ops_run))
    ops = json.loads(Path(_readable(record["operators_path"], run_id)).read_text())
    placement = ops["placement"]
    lay = placement["eplb"]["layout"]
    return {"model_dir": ops["model_dir"], "layout": lay, "operators_perms": placement["permutation"].get("perms"),
            "experiment_id": client.get_run(run_id).info.experiment_id, "tracking_uri": client.tracking_uri}


def _readable(location: str, run_id: str) -> str:
    """A run's file as a local path: a store URI fetched through the store layer (checked
    against its output's manifest) into this node's cache; a local path as is."""
    try:
        path = storage.localize(location)
    except UserError as exc:
        raise UserError(f"run {run_id}: {exc}") from None
    if not Path(path).exists():
        raise UserError(f"run {run_id}: {location} (the operators stage's output) is gone")
    return path


def original_dir(base_dir: str) -> str:
    """The unpermuted checkpoint a served (maybe permuted) one came from (a store URI when the
    served one is in a store: its convert output)."""
    try:
        manifest = Path(storage.localize(storage.join(base_dir, "manifest.json")))
    except UserError:  # a store output without one: not a permuted checkpoint
        return base_dir
    if manifest.is_file():
        placement = json.loads(manifest.read_text()).get("placement") or {}
        if placement.get("source_dir"):
            return placement["source_dir"]
    return base_dir


def write_outputs(out: Path, live: dict, result: dict, num_hidden_layers: int, redundant: int) -> dict:
    """rebalance.json, expert_load.json (live), SGLang and vLLM placement files."""

    out.mkdir(parents=True, exist_ok=True)
    meta = live["meta"]
    files = {"expert_load": out / "expert_load.json", "sglang": out / "sglang_expert_location.json",
             "vllm": out / "vllm_eplb.json", "report": out / "rebalance.json"}
    _write(files["expert_load"], {"counts": live["counts"], "layers": meta["layers"], "routers": meta["routers"],
                                  "source": f"live traffic, {len(live['replicas'])} replica(s), "
                                            f"{live['span_s']:.0f} s", "shape": np.shape(live["counts"])})
    _write(files["sglang"], sglang_expert_location(result["phy2log"], meta["layers"], num_hidden_layers))
    _write(files["vllm"], vllm_eplb_args(redundant))
    report = {k: v for k, v in result.items() if k not in ("phy2log",)}
    report.update(replicas=live["replicas"], window_s=live["span_s"], files={k: str(v) for k, v in files.items()})
    _write(files["report"], report)
    return report


def _write(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=lambda o: o.tolist() if hasattr(o, "tolist") else str(o)))
    tmp.replace(path)


def rollout(app_name: str, settings: dict, new_base: str, options: dict, *, timeout_s: float = 600,
            notify=print) -> dict:
    """Replace the app's replicas one at a time with ones serving `new_base`.

    With room for one more replica, the app first grows by one (old version), then Serve's
    rolling update swaps them, then it shrinks back: capacity never drops below the start.
    """
    # lazy: ray: heavy, loaded only when this runs; loads prometheus_client, torch, which importing this module does not
    import ray
    from ray import serve

    from moeflow.serving.app import ServeSettings, build_app

    replicas = int(options.get("num_replicas") or 1)
    cpus, gpus = float(options.get("num_cpus") or 1), float(options.get("num_gpus") or 0)
    free = ray.available_resources()
    surge = free.get("CPU", 0) >= cpus and free.get("GPU", 0) >= gpus
    old = ServeSettings(**settings)
    new = ServeSettings(**dict(settings, base_dir=new_base))
    ongoing = int(options.get("max_ongoing_requests") or 32)

    def app(settings: ServeSettings, num_replicas: int):
        return build_app(settings, num_replicas=num_replicas, max_ongoing_requests=ongoing,
                         num_cpus=cpus, num_gpus=gpus)

    t0 = time.monotonic()
    steps = []
    if surge:
        _deploy(serve, app(old, replicas + 1), app_name, timeout_s)
        steps.append(f"grew to {replicas + 1} replicas")
    _deploy(serve, app(new, replicas + (1 if surge else 0)), app_name, timeout_s)
    steps.append("rolled every replica to the re-placed checkpoint")
    if surge:
        _deploy(serve, app(new, replicas), app_name, timeout_s)
        steps.append(f"back to {replicas}")
    if not surge:
        notify("rebalance: no room for an extra replica; Serve replaces them in place")
    return {"surge": surge, "steps": steps, "seconds": round(time.monotonic() - t0, 2)}


def _deploy(serve, app, name: str, timeout_s: float) -> None:
    serve.run(app, name=name, route_prefix="/", blocking=False)
    deadline = time.monotonic() + timeout_s
    while True:
        status = serve.status().applications.get(name)
        if status is not None and str(status.status).endswith("RUNNING"):
            deps = status.deployments.values()
            if all(str(d.status).endswith("HEALTHY") for d in deps):
                return
        if status is not None and "FAIL" in str(status.status):
            raise UserError(f"rebalance: Serve failed to roll out: {status.message[:300]}")
        if time.monotonic() > deadline:
            raise UserError(f"rebalance: the rollout did not finish within {timeout_s:.0f} s")
        time.sleep(0.5)


def rebalance(run_id: str, *, tracking_uri: str | None, out: Path, window_s: float, app_name: str = "moeflow",
              apply: bool = True, ep_size: int | None = None, notify=print) -> dict:
    """The whole command (Ray initialised, connected to the deployment's cluster)."""
    # lazy: ray: heavy, loaded only when this runs
    import ray


    inputs = run_inputs(run_id, tracking_uri)
    book = find_load_book(app_name)
    if book is None:
        raise UserError(f"rebalance: no running deployment {app_name!r} reports expert load on this Ray "
                        f"cluster (deploy it with `moeflow deploy --run {run_id}`; --address names the cluster)")
    live = ray.get(book.window.remote(window_s))
    if live["counts"] is None or live["settings"] is None:
        raise UserError(f"rebalance: no replica reported expert load in the last {window_s:.0f} s")
    lay, meta = inputs["layout"], live["meta"]
    ep = ep_size or int(lay["ep"])
    served = meta["perms"]
    result = plan(live["counts"], ep, int(lay.get("groups") or 1), int(lay.get("redundant") or 0),
                  int(lay.get("nodes") or 1), served, inputs["operators_perms"])
    config = json.loads(Path(_readable(storage.join(inputs["model_dir"], "config.json"), run_id)).read_text())
    layers = int(PL.text_config(config).get("num_hidden_layers") or max(meta["layers"]) + 1)
    report = write_outputs(out, live, result, layers, int(lay.get("redundant") or 0))
    report.update(run_id=run_id, ep_size=ep, applied=False)
    if apply:
        settings = live["settings"]
        source = storage.localize(original_dir(settings["base_dir"]))  # what is permuted: all of it
        if not result["changed"]:
            report["reason"] = "no layer is better balanced re-placed than served"
        else:
            placed = PL.apply_permutation(source, out / "placed", meta["routers"], result["perms"],
                                          {"ep": ep, "load": str(out / "expert_load.json"), "by": "rebalance"})
            report["rollout"] = rollout(app_name, settings, placed["model_path"], live["options"],
                                        notify=notify)
            report.update(applied=True, model_path=placed["model_path"])
    _write(out / "rebalance.json", report)
    _track(inputs, report)
    return report


def _track(inputs: dict, report: dict) -> None:
    """An MLflow run in the pipeline's experiment, linked to it, with the numbers."""
    # lazy: mlflow: heavy, loaded only when this runs
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=inputs["tracking_uri"])
    run = client.create_run(inputs["experiment_id"], run_name=f"rebalance-{report['run_id'][:8]}",
                            tags={"moeflow.kind": "rebalance", "moeflow.pipeline_run": report["run_id"]})
    rid = run.info.run_id
    for name, values in report["balancedness"].items():
        client.log_metric(rid, f"balancedness_{name}", float(np.mean(values)))
        client.log_metric(rid, f"balancedness_{name}.hottest", values[report["hottest_layer"]])
    client.log_dict(rid, report, "rebalance.json")
    client.set_terminated(rid)
    report["mlflow_run"] = rid
