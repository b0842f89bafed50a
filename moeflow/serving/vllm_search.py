"""The serving search over vLLM engine settings (deploy.backend vllm).

The local search (moeflow.serving.tune.search) keeps every candidate up at once and drives
one at a time. A vLLM candidate is a Ray Serve LLM application whose engine reserves its
devices (and, on CPU, its KV space) for as long as it runs: two of them seldom fit where one
is deployed. So candidates are brought up one at a time through the vllm backend itself
(moeflow.serving.vllm_backend: the same Serve config deploy writes, with the candidate's
engine settings), measured on the same traffic with the same Driver as the local search
(its probe pooled with a longer run, then the rate search), and taken down before the
next starts. The winner is chosen as the local search chooses (tune.choose) and written to
serving.yaml, which deploy applies to the vllm backend's engine_kwargs.

Knobs: the ones vLLM has under the same name (render.VLLM_ENGINE_KNOBS), and the replicas
and ongoing requests of Serve. Not the parallel layout: serving.yaml holds deploy: knobs, and
deploy takes TP / PP / EP from the plan stage, so every candidate runs the plan's layout.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from moeflow.core.errors import UserError
from moeflow.serving import vllm_backend
from moeflow.serving.deployment import Deployment, engine_settings
from moeflow.serving.tune import (
    Budget,
    Candidate,
    Driver,
    Outcome,
    _rate_point,
    _rate_search,
    choose,
    keep_latencies,
    warm_up,
)
from moeflow.serving.tune_space import SERVE_KNOBS

log = logging.getLogger(__name__)


class VllmHarness:
    """One vLLM candidate application at a time on the connected Ray (Serve started on `port`).

    Args:
        cfg: pipeline config (deploy: the base of every candidate's settings).
        dep: the decided deployment (checkpoint, adapters, merge) deploy would serve.
        serving: the plan stage's serving record (its "vllm" sub-plan).
        out_dir: merged / exported adapters go here (reused by every candidate).
        device: "gpu" or "cpu" (vLLM's CPU build).
    """

    def __init__(self, cfg, dep: Deployment, serving: dict, out_dir: Path, device: str, *,
                 host: str = "127.0.0.1", port: int = 0, ready_timeout_s: float = 900.0):
        self.cfg, self.dep, self.serving, self.out_dir, self.device = cfg, dep, serving, out_dir, device
        self.host, self.port, self.ready_timeout_s = host, port, ready_timeout_s
        self.live: Candidate | None = None
        self.up_s: list[float] = []  # seconds each candidate took to come up

    def config(self, c: Candidate) -> dict:
        """The candidate's Serve config: deploy's, with its engine settings and route."""
        knobs = dict(engine_settings(self.cfg), **{k: v for k, v in c.knobs.items() if v is not None})
        plan = dict(self.serving["vllm"], num_replicas=int(c.knobs.get("num_replicas") or 1))
        d = self.cfg.deploy.model_copy(update={"lora_uri": self.dep.lora_uri,
                                               "max_ongoing_requests": int(c.knobs["max_ongoing_requests"])})
        cfg = self.cfg.model_copy(update={"deploy": d})
        built = vllm_backend.build(cfg, self.dep.checkpoint, dict(self.serving, vllm=plan), dict(self.dep.adapters),
                                   self.out_dir, dict(self.dep.merged_dirs), knobs=knobs, merge=self.dep.merge,
                                   device=self.device)
        apps = built["serve_config"]["applications"]
        for i, app in enumerate(apps):
            app["name"] = c.app if i == 0 else f"{c.app}-{i}"
            app["route_prefix"] = f"/{app['name']}"
        return built["serve_config"]

    def up(self, c: Candidate, index: int) -> None:
        """Deploy candidate `c` (the previous one is down); its URL once every app runs."""
        if self.live is not None:
            raise AssertionError(f"candidate {self.live.name} still up")
        c.app = f"moeflow-vllm-tune-{index}"
        config = self.config(c)
        start = time.monotonic()
        self.live = c
        url = vllm_backend.start(config, self.device, self.host, self.port, wait_s=self.ready_timeout_s,
                                 tight=bool(self.serving["vllm"].get("tight_cpu")))
        self.up_s.append(time.monotonic() - start)
        c.url = f"{url}/{c.app}"

    def down(self) -> None:
        """Delete the live candidate's applications and wait until they are gone."""
        # lazy: Ray Serve (seconds to import); only a search that deployed something tears down
        from ray import serve

        if self.live is None:
            return
        apps = [n for n in serve.status().applications if n == self.live.app or n.startswith(self.live.app + "-")]
        for name in apps:
            serve.delete(name, _blocking=True)
        self.live = None

    def served_models(self, c: Candidate, api_key: str | None) -> list[str]:
        # lazy: httpx: heavy, loaded only when this runs
        import httpx

        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        resp = httpx.get(f"{c.url}/v1/models", headers=headers, timeout=60)
        resp.raise_for_status()
        return [m["id"] for m in resp.json()["data"]]

    def __enter__(self) -> "VllmHarness":
        return self

    def __exit__(self, *exc) -> None:
        # lazy: Ray Serve (seconds to import); only a search that deployed something tears down
        from ray import serve

        try:
            self.down()
        finally:
            serve.shutdown()  # so deploy can start Serve on its own port


def search_one_at_a_time(make_driver, harness: VllmHarness, cands: list[Candidate], budget: Budget, *,
                         rate_step: float = 1.5, rate_points: int = 2, tie: float = 0.05,
                         min_run_s: float = 2.0) -> tuple[Outcome, Driver]:
    """Each candidate up, warmed, measured (probe + final at the profile's rate, then the rate
    search), and down before the next; the default and one other always run.

    Args:
        make_driver: f(models) -> Driver, called once the first candidate answers /v1/models.
    Returns:
        (the outcome, the driver).
    """
    driver: Driver | None = None
    unit = min_run_s
    for i, c in enumerate(cands):
        per = max(harness.up_s) if harness.up_s else 0.0
        if i >= 2 and budget.left() - 3.0 < per + (2 + rate_points) * unit:
            c.dropped = "not measured: bringing vLLM candidates up one at a time spent the budget"
            continue
        harness.up(c, i)
        try:
            if driver is None:
                driver = make_driver(harness.served_models(c, None))
            warm_up(driver, [c])
            if i == 0:  # the first start shows what one costs: every candidate gets the same share
                share = budget.left() / len(cands) - harness.up_s[0]
                unit = max(min_run_s, (share - (2 + rate_points) * (driver.tail_s + 0.5)) / (2 + rate_points))
            rate = driver.profile.arrivals.rate
            c.probe = driver.run(c, rate, unit, pool=True)
            c.final = driver.run(c, rate, unit, keep_samples=True, pool=True)  # with its probe
            c.rates.append(_rate_point(c.final))
            _rate_search(driver, c, rate, rate_step, rate_points, unit, c.final["tail_s"], budget)
        finally:
            harness.down()
    measured = [c for c in cands if c.final]
    if driver is None or not measured:
        raise UserError("serving: no vLLM candidate was measured")
    for c in measured:
        if not c.samples:
            keep_latencies(c, [r for rs, _ in c.runs for r in rs])
    chosen, met, message = choose(measured, cands[0], driver.profile, tie)
    message += f"; vLLM candidates measured one at a time ({', '.join(f'{s:.0f}' for s in harness.up_s)} s to start)"
    return Outcome(cands, chosen, cands[0], met, message, unit, budget.left() < 0), driver


def candidate_space(space: dict[str, list]) -> dict[str, list]:
    """The local search's space less the knobs vLLM lacks (render.VLLM_ENGINE_KNOBS)."""
    # lazy: render imports numpy / rich; the search imports it anyway
    from moeflow.serving.render import VLLM_ENGINE_KNOBS

    return {k: v for k, v in space.items() if k in VLLM_ENGINE_KNOBS or k in SERVE_KNOBS}
