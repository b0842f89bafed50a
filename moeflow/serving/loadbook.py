"""Live expert load of a deployment, summed over its replicas and a time window.

Each replica of the Serve app reports its cumulative tokens per (MoE layer,
logical expert) every `REPORT_S` seconds to one named Ray actor per
deployment (`ExpertLoadBook`). Cumulative counts make a lost or late report
harmless: the load over a window is, per replica, its latest report minus its
last report before the window (zero for a replica that started inside it),
summed over replicas — replicas replaced by a rolling update still count for
what they served inside the window. Counts are by logical expert (the
checkpoint's original order), so reports of replicas serving different
placements add up.

The replicas also leave their ServeSettings here, so `moeflow rebalance` can
redeploy the same app with a re-placed checkpoint.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

log = logging.getLogger("moeflow.serving")
REPORT_S = 2.0
KEEP_S = 3600.0  # history kept per replica


class ExpertLoadBook:
    """Reports of every replica of one deployment (a detached named Ray actor)."""

    def __init__(self):
        self.reports: dict[str, list[tuple[float, list[list[int]]]]] = {}
        self.meta: dict = {}
        self.settings: dict | None = None
        self.options: dict = {}  # the deployment's replicas / CPUs / GPUs (set by the deploying driver)

    def set_options(self, options: dict) -> None:
        self.options = dict(options)

    def report(self, replica: str, counts: list[list[int]], meta: dict, settings: dict) -> None:
        now = time.time()
        rows = self.reports.setdefault(replica, [])
        rows.append((now, counts))
        while rows and rows[0][0] < now - KEEP_S and len(rows) > 1:
            rows.pop(0)
        self.meta, self.settings = meta, settings

    def window(self, seconds: float) -> dict:
        """{"counts": [L][E] summed over replicas for the last `seconds`, "replicas", "meta",
        "settings", "span_s"}."""
        now = time.time()
        start = now - seconds
        total, used, first = None, [], now
        for replica, rows in self.reports.items():
            inside = [r for r in rows if r[0] >= start]
            if not inside:
                continue
            before = [r for r in rows if r[0] < start]
            last = inside[-1][1]
            base = before[-1][1] if before else [[0] * len(row) for row in last]
            first = min(first, before[-1][0] if before else inside[0][0])
            delta = [[a - b for a, b in zip(ra, rb)] for ra, rb in zip(last, base)]
            total = delta if total is None else [[a + b for a, b in zip(ra, rb)]
                                                 for ra, rb in zip(total, delta)]
            used.append(replica)
        return {"counts": total, "replicas": used, "meta": self.meta, "settings": self.settings,
                "options": self.options,
                "span_s": round(now - first, 3)}


def book_name(app_name: str) -> str:
    return f"moeflow-expert-load-{app_name}"


def open_load_book(app_name: str):
    """The deployment's ExpertLoadBook (created by the first replica that reports)."""
    # lazy: ray: heavy, loaded only when this runs
    import ray

    cls = ray.remote(num_cpus=0)(ExpertLoadBook)
    return cls.options(name=book_name(app_name), namespace="moeflow", lifetime="detached",
                       get_if_exists=True).remote()


def find_load_book(app_name: str):
    """The running deployment's book; None when no replica has reported."""
    # lazy: ray: heavy, loaded only when this runs
    import ray

    try:
        return ray.get_actor(book_name(app_name), namespace="moeflow")
    except ValueError:
        return None


def reset_load_book(app_name: str) -> None:
    """A new deployment starts with no reports (driver side, before serve.run)."""
    # lazy: ray: heavy, loaded only when this runs
    import ray

    book = find_load_book(app_name)
    if book is None:
        return
    ray.kill(book)
    deadline = time.monotonic() + 30
    while find_load_book(app_name) is not None and time.monotonic() < deadline:
        time.sleep(0.1)  # the name is free once the actor is gone


def placement_of(base_dir: str | Path) -> dict[str, list[int]]:
    """{router: perm} of a permuted checkpoint (its manifest's `placement`); {} otherwise.
    perm[j] is the logical (original) expert that slot j holds."""
    path = Path(base_dir) / "manifest.json"
    if not path.is_file():
        return {}
    placement = json.loads(path.read_text()).get("placement") or {}
    return {router: [int(i) for i in perm] for router, perm in (placement.get("layers") or {}).items()}


class Reporter:
    """Replica side: a daemon thread pushing ExpertLoad.logical_totals() to the book.

    The book is looked up by name at every report: a redeploy that keeps this replica
    (unchanged settings) starts a new book, which this replica then reports to."""

    def __init__(self, app_name: str, replica: str, experts, settings: dict, every_s: float = REPORT_S):
        self.app_name, self.replica, self.experts, self.settings = app_name, replica, experts, settings
        self.every_s = every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="moeflow-load-report", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        meta = {"layers": self.experts.layer_ids, "routers": self.experts.router_names,
                "labels": self.experts.labels, "num_experts": self.experts.num_experts,
                "ep_size": self.experts.ep_size, "perms": self.experts.perms}
        while not self._stop.wait(self.every_s):
            try:  # fire and forget: cumulative counts make a lost report harmless
                book = open_load_book(self.app_name)
                book.report.remote(self.replica, self.experts.logical_totals(), meta, self.settings)
            except Exception as exc:  # noqa: BLE001 - the book gone (app deleted): stop quietly
                log.info("expert load report stopped: %s", exc)
                return

    def stop(self) -> None:
        self._stop.set()


def remember_options(app_name: str, **options) -> None:
    """Driver side: the deployment's options, which a rolling update must keep."""
    # lazy: ray: heavy, loaded only when this runs
    import ray

    ray.get(open_load_book(app_name).set_options.remote(options))
