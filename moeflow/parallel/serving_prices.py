"""The serving search and deploy priced on the backend that serves (deploy.backend, auto
resolved as the plan stage does: moeflow.parallel.vllm_plan.choose_backend).

  serving   moeflow's local engine: candidates deployed one after another within
            serving.budget_s (the default and one candidate always are, however long deploying
            takes); vLLM: candidates of the vLLM plan's layout (TP/PP/EP over the plan's devices)
            brought up one at a time, each a vLLM start + its weights loaded + its share of the
            measured traffic (serving.budget_s / serving.max_candidates), at least two of them
  deploy    replica start + weights per replica / R (+ a vLLM start) + smoke test (one request
            per model)

    python -c "from moeflow.parallel.serving_prices import serving"   # library
"""

from __future__ import annotations

import math

from moeflow.core.hardware import GB
from moeflow.parallel.pricing import (
    COMPILE_WARMUP_S,
    CORE_START_S,
    Inputs,
    Rates,
    StageEstimate,
    Term,
)


def replica(inp: Inputs, search: bool = False) -> tuple[int, int]:
    """(replicas, devices per replica) of deploy, or of one serving-search candidate."""
    s = inp.serve.get("search", {}) if search else inp.serve
    return int(s.get("replicas", 1)), int(s.get("devices_per_replica", 1))


def backend(inp: Inputs) -> str:
    """The backend that serves (workflows/dryrun.py resolved deploy.backend auto)."""
    return inp.serve.get("backend", inp.cfg.deploy.backend)


def replica_text(inp: Inputs, search: bool = False) -> str:
    """What one replica holds: a vLLM engine of the plan's layout, or the local engine's one device."""
    replicas, per = replica(inp, search)
    layout = (inp.serve.get("search", {}) if search else inp.serve).get("layout")
    return f"{replicas} replica(s) x {per} device(s)" + (f" ({layout})" if layout else "")


def served_bytes(inp: Inputs) -> float:
    """Bytes every replica reads from storage: the converted model, or the calibrated one
    (deploy.weights)."""
    return inp.quantised_bytes if inp.cfg.deploy.weights == "calibrated" else inp.converted_bytes


def core_process(inp: Inputs, engine: str | None = None) -> bool:
    """Whether deployed replicas start an engine core process: moeflow's engine with
    deploy.engine_process true, or auto on a model without a vision tower (auto serves an
    image-text model in the replica's own process, moeflow/serving/service.py)."""
    d = inp.cfg.deploy
    if (engine or backend(inp)) != "local" or d.engine_process is False:
        return False
    return d.engine_process is True or not inp.counts.vision


def compile_warmup(inp: Inputs, engine: str | None = None) -> float:
    """Seconds a replica compiles before serving (deploy.compile, moeflow's engine only)."""
    return COMPILE_WARMUP_S if (engine or backend(inp)) == "local" and inp.cfg.deploy.compile else 0.0


def _vllm_start(inp: Inputs, units: float) -> Term:
    s = inp.cfg.estimate.vllm_start_s
    return Term("vLLM engine start beyond its weights (compile, graphs, KV cache)", units * s,
                "assumed: estimate.vllm_start_s")


def serving(inp: Inputs, r: Rates) -> StageEstimate:
    """The search over the knobs of the backend that serves (module docstring)."""
    if backend(inp) == "vllm":
        return _serving_vllm(inp, r)
    sv = inp.cfg.serving
    replicas, per = replica(inp, search=True)
    core = (CORE_START_S if core_process(inp, "local") else 0.0) * r.host + compile_warmup(inp, "local") * r.host
    deploy_one = r.start + core + inp.converted_bytes * replicas / (r.read * GB * max(1, replicas * per
                                                                          // inp.hw.devices_per_node))
    searched = max(sv.budget_s, 2 * deploy_one)
    devices = replicas * per
    return StageEstimate(
        "serving", f"Ray Serve (local): {min(sv.max_candidates, 2)}+ candidates x "
        f"{replica_text(inp, search=True)}, one candidate at a time", devices=devices,
        nodes=max(1, math.ceil(devices / inp.hw.devices_per_node)),
        memory_per_device=inp.serve.get("search", {}).get("memory_bytes", 0.0),
        bytes_read=2 * replicas * inp.converted_bytes, bytes_written=0.0,
        terms=[Term("search within serving.budget_s (at least 2 deployments)", searched,
                    "assumed: serving.budget_s" if searched == sv.budget_s else r.read_basis),
               r.fixed("teardown and reports", "SERVING_TAIL_S")])


def _serving_vllm(inp: Inputs, r: Rates) -> StageEstimate:
    sv = inp.cfg.serving
    replicas, per = replica(inp, search=True)
    devices = replicas * per
    nodes = max(1, math.ceil(devices / inp.hw.devices_per_node))
    n = min(sv.max_candidates, 2)  # the default and one candidate always run
    share = sv.budget_s / sv.max_candidates  # the traffic each candidate is measured with
    weights = served_bytes(inp)
    return StageEstimate(
        "serving", f"Ray Serve LLM (vllm): {n}+ candidates x {replica_text(inp, search=True)}, "
        f"one candidate at a time over {nodes} node(s)", devices=devices, nodes=nodes,
        memory_per_device=inp.serve.get("search", {}).get("memory_bytes", 0.0),
        bytes_read=n * replicas * weights, bytes_written=0.0,
        terms=[r.fixed("stage task and its MLflow run", "STAGE_OVERHEAD_S"),
               r.started(f"{n} candidates' replicas start", n),
               _vllm_start(inp, n),
               r.reading(f"{n} candidates load the weights, every replica its share", n * replicas * weights,
                         nodes),
               Term(f"{n} candidates x the measured traffic (serving.budget_s / max_candidates)",
                    n * share, "assumed: serving.budget_s"),
               r.fixed("teardown and reports", "SERVING_TAIL_S")])


def deploy(inp: Inputs, r: Rates) -> StageEstimate:
    replicas, per = replica(inp)
    devices = replicas * per
    nodes = max(1, math.ceil(devices / inp.hw.devices_per_node))
    vllm = backend(inp) == "vllm"
    terms = [r.fixed("stage task and its MLflow run", "STAGE_OVERHEAD_S"),
             r.started("replica start"),
             r.fixed("each replica's engine core process starts beside it (deploy.engine_process)",
                     "CORE_START_S", 1 if core_process(inp) else 0),
             r.fixed("each replica compiles its forwards before serving (deploy.compile)",
                     "COMPILE_WARMUP_S", 1 if compile_warmup(inp) else 0)]
    if vllm:
        terms.append(_vllm_start(inp, 1))
    terms += [r.reading("every replica loads the weights", replicas * served_bytes(inp), nodes),
              r.fixed("smoke test, one request per model", "SMOKE_S", 1 + len(inp.data))]
    return StageEstimate(
        "deploy", f"Ray Serve ({backend(inp)}): {replica_text(inp)} over {nodes} node(s)",
        devices=devices, nodes=nodes, memory_per_device=inp.serve.get("memory_bytes", 0.0),
        bytes_read=replicas * served_bytes(inp), bytes_written=0.0, terms=terms)
