"""Serving-configuration search: replay a traffic profile against real deployments.

    from moeflow.serving.tune import Harness, search
    from moeflow.serving.tune_space import Limits, make_candidates
    cands = make_candidates(space, default, limits, n=6)
    with Harness(settings, num_cpus=0.25) as h:
        outcome = search(h, cands, profile, vocab=..., budget=Budget(60))

Every candidate is a real Ray Serve application (its own app name and route
on the Serve proxy, built by `moeflow.serving.app.build_app`, as deploy builds
it), driven by the same requests drawn from the profile. The time budget is
spent by successive halving: a short probe of every candidate, the clearly
worse dropped, the survivors (and the default, the baseline) measured longer
(a second run, pooled with the probe),
then each finalist's highest request rate within the SLOs found by stepping
the rate up (or down) from the profile's — vLLM's auto_tune criterion.
Candidates are bounded by the plan's memory: the KV cache of max_num_seqs
sequences at the full context, beside the weights, must fit one device
(moeflow.serving.tune_space: the knobs, the limits and the candidates).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from moeflow.core.errors import UserError
from moeflow.core.ports import free_port
from moeflow.serving.loadgen import replay, summarize
from moeflow.serving.traffic import Request, TrafficProfile, generate
from moeflow.serving.tune_space import ENGINE_KNOBS, engine_fields

log = logging.getLogger("moeflow.serving")


# ------------------------------------------------------------------ deployments


@dataclass
class Candidate:
    name: str  # "default", "c1", ...
    knobs: dict
    app: str = ""
    url: str = ""
    probe: dict | None = None  # short run, profile rate
    final: dict | None = None  # longer run, profile rate (finalists)
    rates: list[dict] = field(default_factory=list)  # [{rate, goodput, attainment, met}]
    max_rate: float | None = None  # highest rate within the SLOs (None: none measured met)
    dropped: str | None = None  # why it left the search
    samples: dict = field(default_factory=dict)  # final run: {"ttft": [ms], "tpot": [ms]}
    runs: list = field(default_factory=list)  # [(results, wall s)] at the profile's rate, pooled

    def best_run(self) -> dict | None:
        return self.final or self.probe

    def measured(self) -> dict:
        """The probe run (read only for candidates that ran it)."""
        if self.probe is None:
            raise ValueError(f"candidate {self.name} was not probed")
        return self.probe

    def final_run(self) -> dict:
        """The final run (read only for finalists)."""
        if self.final is None:
            raise ValueError(f"candidate {self.name} has no final run")
        return self.final

    def as_dict(self) -> dict:
        run = self.best_run() or {}
        return {"name": self.name, "config": self.knobs, "goodput_rps": run.get("request_goodput"),
                "slo_attainment": run.get("slo_attainment"), "p99_ttft_ms": run.get("p99_ttft_ms"),
                "p99_tpot_ms": run.get("p99_tpot_ms"), "p99_e2el_ms": run.get("p99_e2el_ms"),
                "max_rate_rps": self.max_rate, "rates": self.rates, "dropped": self.dropped,
                "probe": _brief(self.probe), "final": _brief(self.final)}


def _brief(run: dict | None) -> dict | None:
    keys = ("num_prompts", "completed", "failed", "duration", "request_throughput", "request_goodput",
            "slo_attainment", "output_throughput", "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms",
            "p99_tpot_ms", "p99_itl_ms", "p99_e2el_ms", "rate", "final_skipped")
    return {k: run[k] for k in keys if k in run} if run else None


class Harness:
    """Candidate apps on one Serve proxy; starts Serve (on a free port) only if none runs.

    Args:
        settings: ServeSettings of what deploy would serve (engine knobs replaced per candidate).
        num_cpus: Ray CPUs reserved per replica (all candidates are up at once; only one is driven).
        num_gpus: Ray GPUs per replica (0: CPU replicas), as deploy would place them.
        host: bind address when this harness starts Serve.
    """

    def __init__(self, settings, *, num_cpus: float = 0.25, num_gpus: float = 0.0, host: str = "127.0.0.1",
                 ready_timeout_s: float = 300.0):
        self.settings, self.num_cpus, self.num_gpus, self.host = settings, num_cpus, num_gpus, host
        self.ready_timeout_s = ready_timeout_s
        self.apps: list[str] = []
        self.started = False
        self.base_url = ""
        self.tag = uuid.uuid4().hex[:6]

    def __enter__(self) -> "Harness":
        # lazy: ray: heavy, loaded only when this runs;
        # loads prometheus_client, torch, which importing this module does not
        from ray.serve.context import _get_global_client

        client = _get_global_client(raise_if_no_controller_running=False)
        if client is None:
            port = _start_serve(self.host, free_port)
            self.started, host = True, self.host
        else:  # a running Serve (a cluster's, or deploy's): its proxy serves our routes too
            host, port = client.http_config.host, client.http_config.port
        host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        self.base_url = f"http://{host}:{port}"
        return self

    def __exit__(self, *exc) -> None:
        # lazy: ray: heavy, loaded only when this runs
        from ray import serve

        for app in self.apps:
            try:
                serve.delete(app, _blocking=False)
            except Exception:  # noqa: BLE001 - teardown must reach every app
                log.warning("could not delete serve app %s", app, exc_info=True)
        if self.started:
            serve.shutdown()  # so deploy can start Serve on its own port

    def deploy(self, cands: list[Candidate]) -> None:
        """Deploy every candidate (concurrently), wait until each answers /v1/models."""
        # lazy: ray: heavy, loaded only when this runs;
        # loads prometheus_client, torch, which importing this module does not
        from ray import serve

        from moeflow.serving.app import build_app

        targets = []
        for i, c in enumerate(cands):
            c.app = f"moeflow-tune-{self.tag}-{i}"
            engine = dict(self.settings.engine)
            engine.update({k: v for k, v in c.knobs.items() if k in ENGINE_KNOBS and k in engine_fields()})
            settings = self.settings.model_copy(update={"engine": engine})
            app = build_app(settings, num_replicas=c.knobs["num_replicas"],
                            max_ongoing_requests=c.knobs["max_ongoing_requests"], num_cpus=self.num_cpus,
                            num_gpus=self.num_gpus)
            targets.append(serve.RunTarget(app, name=c.app, route_prefix=f"/{c.app}"))
            self.apps.append(c.app)
            c.url = f"{self.base_url}/{c.app}"
        # all at once: serve.run waits for each app before the next starts its replicas
        serve.run_many(targets, wait_for_ingress_deployment_creation=False,
                       wait_for_applications_running=False)
        self._wait(cands)

    def _wait(self, cands: list[Candidate]) -> None:
        # lazy: ray: heavy, loaded only when this runs
        from ray import serve

        deadline = time.monotonic() + self.ready_timeout_s
        pending = {c.app for c in cands}
        while pending:
            apps = serve.status().applications
            for app in list(pending):
                st = apps.get(app)
                if st is not None and str(st.status).endswith("RUNNING"):
                    pending.discard(app)
                elif st is not None and "FAILED" in str(st.status):
                    raise UserError(f"serving: candidate app {app} failed to deploy: {st.message[:300]}")
            if pending and time.monotonic() > deadline:
                raise UserError(f"serving: candidate apps {sorted(pending)} not running after "
                                f"{self.ready_timeout_s:.0f} s")
            if pending:
                time.sleep(0.3)

    def delete(self, c: Candidate) -> None:
        """Stop a dropped candidate's replicas (frees their memory for the survivors)."""
        # lazy: ray: heavy, loaded only when this runs
        from ray import serve

        serve.delete(c.app, _blocking=False)
        self.apps.remove(c.app)

    def served_models(self, c: Candidate) -> list[str]:
        # lazy: httpx: heavy, loaded only when this runs
        import httpx

        headers = {"Authorization": f"Bearer {self.settings.api_key}"} if self.settings.api_key else {}
        resp = httpx.get(f"{c.url}/v1/models", headers=headers, timeout=60)
        resp.raise_for_status()
        return [m["id"] for m in resp.json()["data"]]


def _start_serve(host: str, free_port) -> int:
    """serve.start on a free port; once more when Serve kills its own ingress actor while
    starting (seen on a heavily loaded host), then a one-line UserError. Returns the port."""
    # lazy: ray: heavy, loaded only when this runs
    from ray import serve
    from ray.exceptions import RayActorError

    for attempt in (1, 2):
        port = free_port()
        try:
            serve.start(http_options={"host": host, "port": port})
            return port
        except RayActorError as exc:
            serve.shutdown()
            if attempt == 2:
                first = str(exc).strip().splitlines()[0]
                raise UserError(f"serving: Ray Serve could not start its ingress twice ({first}); "
                                "the host may be overloaded, or set deploy.ingress: proxy") from None
    raise AssertionError("unreachable")


# ------------------------------------------------------------------ the search


@dataclass
class Budget:
    """Wall-clock budget of the whole search, counted from `start` (time.monotonic)."""

    seconds: float
    start: float = field(default_factory=time.monotonic)

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.start)


@dataclass
class Outcome:
    candidates: list[Candidate]
    chosen: Candidate
    default: Candidate
    slo_met: bool
    message: str  # one line: what was chosen and why
    unit_s: float  # probe length actually used
    over_budget: bool


class Driver:
    """Runs one candidate on one request list and keeps vllm-named metrics."""

    def __init__(self, profile: TrafficProfile, *, models: list[str], base: str, vocab: int,
                 max_model_len: int | None, api_key: str | None, drain_s: float = 4.0):
        self.profile, self.api_key, self.drain_s = profile, api_key, drain_s
        self.kw: dict[str, Any] = dict(models=models, base=base, vocab=vocab, max_model_len=max_model_len)
        self.limits = profile.slo.limits()
        self.target = profile.slo.percentile / 100
        # the longest wait after a run's last arrival (budget estimates)
        self.tail_s = min(drain_s, self.bound_s(generate(profile, num_requests=64, **self.kw)))

    def requests(self, rate: float, seconds: float):
        """The profile's first requests spanning about `seconds` at `rate` (whole bursts)."""
        group = self.profile.arrivals.group()
        n = max(8, round(rate * seconds))
        n = min(n, max(8, self.profile.total_requests()))
        n = group * max(1, math.ceil(n / group))
        return generate(self.profile, rate=rate, num_requests=n, **self.kw)

    def bound_s(self, reqs) -> float:
        """How long after the last arrival a run waits: a request still running then cannot
        meet the SLOs any more (TTFT + TPOT x (tokens - 1), or E2EL), so it counts as missed."""
        lim = self.limits
        if "e2el" in lim:
            return lim["e2el"] / 1000 + 0.3
        if "ttft" in lim and "tpot" in lim:
            longest = max(r.max_tokens for r in reqs)
            return (lim["ttft"] + lim["tpot"] * (longest - 1)) / 1000 + 0.3
        return self.drain_s

    def run(self, c: Candidate, rate: float, seconds: float, keep_samples: bool = False,
            pool: bool = False) -> dict:
        """Replay about `seconds` of the profile at `rate` against `c`; vllm-named metrics.

        pool: add this run to the candidate's earlier pooled runs and measure them together
            (the survivors' probe and final: more requests, one load spike weighs less).
        """
        reqs = self.requests(rate, seconds)
        # not capped by drain_s: cutting a request that could still meet the SLOs would count
        # a slow-but-good candidate as failing
        limit = reqs[-1].arrival_s + self.bound_s(reqs)
        start = time.monotonic()
        results, wall = asyncio.run(replay(c.url, reqs, api_key=self.api_key, time_limit_s=limit))
        if pool:
            c.runs.append((results, wall))
            results = [r for rs, _ in c.runs for r in rs]
            wall = sum(w for _, w in c.runs)
        pct = self.profile.slo.percentile
        m = summarize(results, wall, goodput=self.limits, percentiles=tuple(sorted({50.0, 90.0, 99.0, pct})))
        m["rate"] = rate
        m["met"] = m["slo_attainment"] >= self.target
        m["wall_s"] = time.monotonic() - start  # what the run cost (budget estimates)
        m["tail_s"] = max(0.0, m["wall_s"] - reqs[-1].arrival_s)  # its drain after the last arrival
        if keep_samples:
            keep_latencies(c, results)
        time.sleep(0.2)  # let aborted stragglers leave the engine before the next run
        return m


def keep_latencies(c: Candidate, results) -> None:
    """The TTFT / TPOT samples of a candidate's measurement (the CDF plots)."""
    c.samples = {"ttft": [1000 * r.ttft for r in results if r.ok],
                 "tpot": [1000 * t for r in results if r.ok and (t := r.tpot) is not None]}


def warm_up(driver: Driver, cands: list[Candidate]) -> None:
    """One short request per served model on every candidate (loads each adapter once)."""

    reqs = [Request(0.0, m, [11, 12, 13, 14], 2, "warmup") for m in driver.kw["models"]]
    for c in cands:
        results, _ = asyncio.run(replay(c.url, reqs, api_key=driver.api_key, time_limit_s=120))
        bad = [r for r in results if not r.ok]
        if bad:
            raise UserError(f"serving: candidate {c.name} cannot serve {bad[0].req.model!r}: {bad[0].error}")


def _score(run: dict) -> tuple:
    return (run["request_goodput"], run["slo_attainment"], -run["mean_e2el_ms"])


def search(driver: Driver, harness: Harness, cands: list[Candidate], budget: Budget, *,
           eta: int = 2, rate_step: float = 1.5, rate_points: int = 2, drop_margin: float = 0.1,
           tie: float = 0.05, min_run_s: float = 1.0) -> Outcome:
    """Successive halving at the profile's rate, then a rate search for the finalists.

    Args:
        eta: keep 1/eta of the candidates after the probe (the default always stays).
        rate_step: factor between tried request rates.
        rate_points: rates tried per finalist beyond the profile's.
        drop_margin: a candidate within this fraction of the best probe goodput is kept.
        tie: goodputs within this fraction count as equal (then the higher max rate wins).
    """
    rate = driver.profile.arrivals.rate
    default = cands[0]
    n_keep = max(1, math.ceil((len(cands) - 1) / eta))  # besides the default
    n_final = min(len(cands), n_keep + 1)
    runs = len(cands) + n_final * (1 + rate_points)
    units = len(cands) + n_final * (2 + rate_points)
    unit = max(min_run_s, (budget.left() - 3.0 - runs * (driver.tail_s / 2 + 0.3)) / units)
    for i, c in enumerate(cands):
        spent = [x.measured()["wall_s"] for x in cands[:i]]
        if i >= 2 and budget.left() - 3.0 < max(spent):  # the default and one candidate always run
            c.dropped = "not probed: deploying the candidates spent the budget"
            harness.delete(c)
            continue
        c.probe = driver.run(c, rate, unit, pool=True)
    probed = [c for c in cands if c.probe]
    log.info("probed %d candidates, %.1f s each", len(probed), unit)
    best = max(_score(c.measured()) for c in probed)[0]
    ranked = sorted(probed[1:], key=lambda c: _score(c.measured()), reverse=True)
    keep = [c for c in ranked if c.measured()["request_goodput"] >= best * (1 - drop_margin)]
    keep = keep[:n_keep] or ranked[:1]
    finalists = [default] + keep  # the default always stays: it is the baseline
    for c in probed:
        if c not in finalists:
            c.dropped = (f"probe goodput {c.measured()['request_goodput']:.2f} req/s vs best {best:.2f}")
            harness.delete(c)
    # the probes showed what a run's drain really costs (a burst's is seconds): the finals
    # take what the budget has left, shared with the rate points
    tail = max(c.measured()["tail_s"] for c in probed)
    share = (budget.left() - 3.0) / (len(finalists) * (1 + rate_points))
    final_s = max(unit, share - tail)
    # no room for even one more run each (deploying took the budget): the probes are the finals
    skip = budget.left() - 3.0 < len(finalists) * max(c.measured()["wall_s"] for c in finalists)
    for c in finalists:
        if skip:
            c.final = dict(c.measured(), final_skipped="budget")
            keep_latencies(c, [r for rs, _ in c.runs for r in rs])
        else:
            c.final = driver.run(c, rate, final_s, keep_samples=True, pool=True)  # with its probe
        c.rates.append(_rate_point(c.final))
    if skip:
        log.info("budget spent: the finalists' probes stand as their final measurement")
    for c in finalists:  # (nothing left for it when the finals were skipped)
        _rate_search(driver, c, rate, rate_step, 0 if skip else rate_points, unit, tail, budget)
    chosen, met, message = choose(finalists, default, driver.profile, tie)
    if skip:
        message += "; deploying left no budget for second runs: finalists measured on their probes"
    return Outcome(cands, chosen, default, met, message, unit, budget.left() < 0)


def _rate_point(run: dict) -> dict:
    return {"rate": run["rate"], "goodput": run["request_goodput"],
            "attainment": run["slo_attainment"], "met": run["met"]}


def _rate_search(driver: Driver, c: Candidate, rate: float, step: float, points: int,
                 unit: float, tail: float, budget: Budget) -> None:
    """Step the rate up from the profile's while the SLOs hold (down while they do not);
    a run is tried only while the budget still holds it (its arrivals, then a drain of
    `tail` s as the probes had) and the teardown."""
    up = c.final_run()["met"]
    r = rate
    group = driver.profile.arrivals.group()
    for _ in range(points):
        r_next = r * step if up else r / step
        # bursts: at least two, so the rate (the gap between them) matters
        seconds = max(unit, 2 * group / r_next) if group > 1 else unit
        span = driver.requests(r_next, seconds)[-1].arrival_s
        if budget.left() < span + tail + 3.0:
            break
        r = r_next
        point = _rate_point(driver.run(c, r, seconds))
        c.rates.append(point)
        if point["met"] != up:
            break  # crossed the boundary
    met = [p["rate"] for p in c.rates if p["met"]]
    c.max_rate = max(met) if met else None
    c.rates.sort(key=lambda p: p["rate"])


def choose(finalists: list[Candidate], default: Candidate, profile: TrafficProfile,
           tie: float) -> tuple[Candidate, bool, str]:
    """The best finalist and one line saying why."""
    slo = ", ".join(f"{k} <= {v:g} ms" for k, v in profile.slo.limits().items())
    rate = profile.arrivals.rate
    meeting = [c for c in finalists if c.final_run()["met"]]
    if not meeting:
        chosen = max(finalists, key=lambda c: (c.final_run()["slo_attainment"], c.final_run()["request_goodput"]))
        return chosen, False, (
            f"no candidate meets the SLOs ({slo} for {profile.slo.percentile:g}% of requests) at "
            f"{rate:g} req/s; chose {chosen.name} with the best attainment "
            f"({100 * chosen.final_run()['slo_attainment']:.0f}%)")
    top = max(c.final_run()["request_goodput"] for c in meeting)
    near = [c for c in meeting if c.final_run()["request_goodput"] >= top * (1 - tie)]
    chosen = max(near, key=lambda c: (c.max_rate or 0.0, -c.knobs["num_replicas"], c is default))
    g_def = default.final_run()["request_goodput"]
    ratio = chosen.final_run()["request_goodput"] / g_def if g_def else float("inf")
    if chosen is default:
        why = (f"the default already wins: no candidate's goodput at {rate:g} req/s beat it by more "
               f"than {100 * tie:.0f}% or sustained a higher rate")
    else:
        why = (f"chose {chosen.name}: goodput {chosen.final_run()['request_goodput']:.2f} req/s at {rate:g} "
               f"req/s ({ratio:.2f}x the default's {g_def:.2f}), max rate within SLOs "
               f"{_fmt_rate(chosen.max_rate)} (default {_fmt_rate(default.max_rate)})")
        if default.final_run()["met"]:  # goodput cannot exceed the offered rate: say why the gain is small
            why += (f"; the default also meets the SLOs at {rate:g} req/s, so the gain is bounded "
                    "by the offered load (compare the max rates)")
    return chosen, True, why


def _fmt_rate(r: float | None) -> str:
    return f"{r:.1f} req/s" if r is not None else "none measured"
