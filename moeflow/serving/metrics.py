"""Prometheus metrics of the serving engine, named like vLLM's with `moeflow_`.

vLLM exports `vllm:time_to_first_token_seconds`, `vllm:num_requests_running`,
...; dashboards built for it map one-to-one onto `moeflow_<same name>`. Every
request metric carries a `model_name` label: the served name, i.e. the base
model or the adapter the request selected.

Across replicas: `/metrics` answers for the replica that serves the scrape
(as each vLLM process does). Inside a Ray Serve replica every series is also
recorded through `ray.serve.metrics`, which Ray exports on each node's
Prometheus endpoint (`metrics_export_port`) as `ray_moeflow_...`, tagged with
deployment, replica and application: `sum by (model_name)` over those is the
deployment-wide view. Those Ray calls are made by a thread of their own every
`RAY_FLUSH_S` (counters summed, gauges at their last value, every histogram
point), not on the thread that delivers tokens: a Ray record per token per
request cost the replica about a seventh of its CPU on the demo model (issue 51).

MoE routing is tracked by `ExpertLoad`: forward hooks on each MoE layer's
router count the tokens sent to every expert. `GET /v1/expert_load` returns
the cumulative [layers, experts] counts; `moeflow_expert_balancedness{layer}`
is mean/max tokens per expert over the last window (1.0 = perfectly even), and
a warning is logged and `moeflow_expert_imbalance_total{layer}` counts when it
falls below a threshold — hot experts precede slowdowns under expert
parallelism.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

from moeflow.model.routing import find_routers, routed_experts

log = logging.getLogger("moeflow.serving")

# vLLM's buckets (seconds), so the same dashboards' quantiles mean the same thing
_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
_ITL = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_E2E = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0)
# a cold adapter read from its source into host memory: LoRAX reports 0.5-1 s per cold load
_LOAD = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


RAY_FLUSH_S = 0.5  # how often the Ray mirror's calls are made; Prometheus scrapes every 10-15 s


class _Deferred:
    """A Ray metric whose calls wait in the mirror's queue for its flusher (same signatures)."""

    __slots__ = ("metric", "pending")

    def __init__(self, metric, pending: deque) -> None:
        self.metric, self.pending = metric, pending

    def observe(self, value: float, tags: dict[str, str] | None = None) -> None:
        self.pending.append((self.metric, "observe", value, tags))

    def inc(self, value: float = 1.0, tags: dict[str, str] | None = None) -> None:
        self.pending.append((self.metric, "inc", value, tags))

    def set(self, value: float, tags: dict[str, str] | None = None) -> None:
        self.pending.append((self.metric, "set", value, tags))


def flush_pending(pending: deque) -> int:
    """Make the queued calls: each histogram point, one `inc` per counter and tag set (their sum),
    one `set` per gauge and tag set (the last value). Returns the calls made."""
    merged: dict[tuple, list] = {}
    points = []
    while pending:
        try:
            metric, kind, value, tags = pending.popleft()
        except IndexError:  # emptied by another flush
            break
        if kind == "observe":
            points.append((metric, value, tags))
            continue
        key = (id(metric), kind, tuple(sorted((tags or {}).items())))
        if kind == "inc" and key in merged:
            merged[key][1] += value
        else:
            merged[key] = [metric, value, tags, kind]
    for metric, value, tags in points:
        metric.observe(value, tags=tags)
    for metric, value, tags, kind in merged.values():
        getattr(metric, kind)(value, tags=tags)
    return len(points) + len(merged)


class _RayMirror:
    """The same series through `ray.serve.metrics` (tagged per replica by Serve), recorded by a
    thread of its own every RAY_FLUSH_S (module docstring): the callers only queue."""

    def __init__(self) -> None:
        self.pending: deque = deque()
        self._make()
        for name, metric in list(vars(self).items()):
            if name != "pending":
                setattr(self, name, _Deferred(metric, self.pending))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="moeflow-ray-metrics", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        failed = False
        while not self._stop.wait(RAY_FLUSH_S):
            try:
                flush_pending(self.pending)
            except Exception as exc:  # Ray's exporter went away: /metrics still answers
                if not failed:
                    log.warning("recording metrics through Ray failed: %s", exc)
                failed = True

    def close(self) -> None:
        """Stop the flusher after one last flush."""
        self._stop.set()
        self._thread.join(timeout=5)
        with contextlib.suppress(Exception):  # Ray may be stopping too
            flush_pending(self.pending)

    def _make(self) -> None:
        # lazy: ray: heavy, loaded only when this runs
        from ray.serve import metrics as rm

        tags = ("model_name",)
        self.ttft = rm.Histogram("moeflow_time_to_first_token_seconds", "Time to first token.",
                                 boundaries=list(_TTFT), tag_keys=tags)
        self.itl = rm.Histogram("moeflow_inter_token_latency_seconds", "Time between output tokens.",
                                boundaries=list(_ITL), tag_keys=tags)
        self.e2e = rm.Histogram("moeflow_e2e_request_latency_seconds", "Request latency, arrival to finish.",
                                boundaries=list(_E2E), tag_keys=tags)
        self.queue = rm.Histogram("moeflow_request_queue_time_seconds", "Time waiting before scheduling.",
                                  boundaries=list(_TTFT), tag_keys=tags)
        self.running = rm.Gauge("moeflow_num_requests_running", "Requests in the running batch.", tag_keys=tags)
        self.waiting = rm.Gauge("moeflow_num_requests_waiting", "Requests waiting to be scheduled.",
                                tag_keys=tags)
        self.prompt_tokens = rm.Counter("moeflow_prompt_tokens", "Prefill tokens processed.", tag_keys=tags)
        self.generation_tokens = rm.Counter("moeflow_generation_tokens", "Tokens generated.", tag_keys=tags)
        self.success = rm.Counter("moeflow_request_success", "Finished requests by finish reason.",
                                  # ray types tag_keys as a 1-tuple; it takes any tuple of names
                                  tag_keys=tags + ("finished_reason",))  # type: ignore[arg-type]
        self.prefix_queries = rm.Counter("moeflow_prefix_cache_queries", "Prompt tokens looked up in the "
                                         "prefix cache.")
        self.prefix_hits = rm.Counter("moeflow_prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.lora_evictions = rm.Counter("moeflow_lora_evictions", "LoRA adapters evicted, by tier.",
                                         tag_keys=("tier",))
        self.lora_host_hits = rm.Counter("moeflow_lora_host_hits", "Adapters made resident from host memory.")
        self.lora_cold_load = rm.Histogram("moeflow_lora_cold_load_seconds", "Reading a cold adapter from "
                                           "its source into host memory.", boundaries=list(_LOAD))


class ServingMetrics:
    """Request metrics; one private registry per engine (no global state).

    Args:
        ray_mirror: also record through `ray.serve.metrics` (in a Serve replica).
    """

    def __init__(self, ray_mirror: bool = False) -> None:
        self.ray = _RayMirror() if ray_mirror else None
        self.registry = CollectorRegistry()
        r, lbl = self.registry, ["model_name"]
        self.ttft = Histogram("moeflow_time_to_first_token_seconds", "Time to first token.",
                              lbl, buckets=_TTFT, registry=r)
        self.itl = Histogram("moeflow_inter_token_latency_seconds", "Time between output tokens.",
                             lbl, buckets=_ITL, registry=r)
        self.e2e = Histogram("moeflow_e2e_request_latency_seconds", "Request latency, arrival to finish.",
                             lbl, buckets=_E2E, registry=r)
        self.queue = Histogram("moeflow_request_queue_time_seconds", "Time waiting before scheduling.",
                               lbl, buckets=_TTFT, registry=r)
        self.running = Gauge("moeflow_num_requests_running", "Requests in the running batch.", lbl, registry=r)
        self.waiting = Gauge("moeflow_num_requests_waiting", "Requests waiting to be scheduled.", lbl, registry=r)
        self.prompt_tokens = Counter("moeflow_prompt_tokens", "Prefill tokens processed.", lbl, registry=r)
        self.generation_tokens = Counter("moeflow_generation_tokens", "Tokens generated.", lbl, registry=r)
        self.success = Counter("moeflow_request_success", "Finished requests by finish reason.",
                               lbl + ["finished_reason"], registry=r)
        # vLLM's prefix_cache_queries / prefix_cache_hits (tokens): hits / queries is the hit rate
        self.prefix_queries = Counter("moeflow_prefix_cache_queries", "Prompt tokens looked up in the "
                                      "prefix cache.", registry=r)
        self.prefix_hits = Counter("moeflow_prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                                   registry=r)
        self._prefix_seen = (0, 0)
        # vLLM's kv_cache_usage_perc: blocks used / blocks of the paged cache (the core's
        # CoreStats.kv_usage); a model on the padded path: tokens cached / max_num_seqs x max_model_len
        self.kv_usage = Gauge("moeflow_kv_cache_usage_perc", "KV-cache usage, 0..1 (paged cache: blocks used / "
                              "blocks; padded batches: tokens cached / max_num_seqs x max_model_len).", registry=r)
        self.lora_resident = Gauge("moeflow_lora_adapters_resident", "LoRA adapters resident in the model.",
                                   registry=r)
        self.lora_max = Gauge("moeflow_lora_adapters_max", "LoRA adapter slots (max_loras).", registry=r)
        # the adapter tiers (adapter_tiers.py): device slots, host memory, the source
        self.lora_held = Gauge("moeflow_lora_adapters_host", "LoRA adapters held in host memory "
                               "(max_cpu_loras).", registry=r)
        self.lora_evictions = Counter("moeflow_lora_evictions", "LoRA adapters evicted, by tier (device: "
                                      "from max_loras slots; host: from host memory).", ["tier"], registry=r)
        self.lora_host_hits = Counter("moeflow_lora_host_hits", "Adapters made resident from host memory "
                                      "(no read from their source).", registry=r)
        self.lora_cold_load = Histogram("moeflow_lora_cold_load_seconds", "Reading a cold adapter from its "
                                        "source (disk, registry, object store) into host memory.",
                                        buckets=_LOAD, registry=r)
        self._tiers_seen = (0, 0, 0)  # device evictions, host evictions, host hits counted so far
        self.kv_capacity = 0  # tokens; set by the owner once the engine knows its limits
        self._seen: set[str] = set()
        self._counts: dict[str, tuple[int, int]] = {}  # the running and waiting gauges' last values per model
        self._lock = threading.Lock()
        # the per-output series' children and Ray tags per model: `labels()` looks its arguments up
        # and checks them under a lock on every call, about 4% of a replica's CPU in steady decoding
        # (16 streams: 16 outputs a step; issue 51). No child is ever removed, so none goes stale.
        self._hot: dict[str, tuple] = {}

    def close(self) -> None:
        """The Ray mirror's last calls made and its thread stopped (nothing else holds resources)."""
        if self.ray is not None:
            self.ray.close()

    def _of(self, model: str) -> tuple:
        """(queue, ttft, itl children, Ray tags) of `model`."""
        hot = self._hot.get(model)
        if hot is None:
            hot = self._hot[model] = (self.queue.labels(model), self.ttft.labels(model), self.itl.labels(model),
                                      {"model_name": model})
        return hot

    def queue_time(self, model: str, seconds: float) -> None:
        queue, _, _, tags = self._of(model)
        queue.observe(seconds)
        if self.ray:
            self.ray.queue.observe(seconds, tags=dict(tags))  # a copy: Serve's observe adds to the dict

    def first_token(self, model: str, seconds: float) -> None:
        _, ttft, _, tags = self._of(model)
        ttft.observe(seconds)
        if self.ray:
            self.ray.ttft.observe(seconds, tags=dict(tags))

    def inter_token(self, model: str, seconds: float) -> None:
        _, _, itl, tags = self._of(model)
        itl.observe(seconds)
        if self.ray:
            self.ray.itl.observe(seconds, tags=dict(tags))

    def finished(self, model: str, reason: str, e2e: float, prompt: int, generated: int) -> None:
        self.e2e.labels(model).observe(e2e)
        self.prompt_tokens.labels(model).inc(prompt)
        self.generation_tokens.labels(model).inc(generated)
        self.success.labels(model, reason).inc()
        if self.ray:
            tags = {"model_name": model}
            self.ray.e2e.observe(e2e, tags=tags)
            if prompt:
                self.ray.prompt_tokens.inc(prompt, tags=tags)
            if generated:
                self.ray.generation_tokens.inc(generated, tags=tags)
            self.ray.success.inc(1, tags={"model_name": model, "finished_reason": reason})

    def queue_counts(self, run: dict[str, int], wait: dict[str, int], cached: int) -> None:
        """Requests running and waiting per model, tokens cached (from the core's CoreStats)."""
        if self.kv_capacity:
            self.kv_usage.set(min(1.0, cached / self.kv_capacity))
        with self._lock:
            self._seen |= set(run) | set(wait)
            for name in self._seen:
                counts = (run.get(name, 0), wait.get(name, 0))
                if self._counts.get(name) == counts:
                    continue  # most steps of a steady batch: the gauges hold these already
                self._counts[name] = counts
                self.running.labels(name).set(counts[0])
                self.waiting.labels(name).set(counts[1])
                if self.ray:
                    self.ray.running.set(counts[0], tags={"model_name": name})
                    self.ray.waiting.set(counts[1], tags={"model_name": name})

    def prefix_cache(self, queries: int, hits: int) -> None:
        """The core's cumulative prefix-cache token counts (counted up by what is new)."""
        with self._lock:
            dq, dh = queries - self._prefix_seen[0], hits - self._prefix_seen[1]
            self._prefix_seen = (queries, hits)
        if dq > 0:
            self.prefix_queries.inc(dq)
            if self.ray:
                self.ray.prefix_queries.inc(dq)
        if dh > 0:
            self.prefix_hits.inc(dh)
            if self.ray:
                self.ray.prefix_hits.inc(dh)

    def lora_slots(self, resident: int, slots: int) -> None:
        self.lora_resident.set(resident)
        self.lora_max.set(slots)

    def lora_tiers(self, stats) -> None:
        """The core's adapter-tier counters (adapter_tiers.TierStats: cumulative counts, counted
        up by what is new; the read times not reported before)."""
        with self._lock:
            seen = self._tiers_seen
            now = (stats.device_evictions, stats.host_evictions, stats.host_hits)
            self._tiers_seen = now
        self.lora_held.set(stats.held)
        for tier, new in (("device", now[0] - seen[0]), ("host", now[1] - seen[1])):
            if new > 0:
                self.lora_evictions.labels(tier).inc(new)
                if self.ray:
                    self.ray.lora_evictions.inc(new, tags={"tier": tier})
        if now[2] > seen[2]:
            self.lora_host_hits.inc(now[2] - seen[2])
            if self.ray:
                self.ray.lora_host_hits.inc(now[2] - seen[2])
        for seconds in stats.load_times:
            self.lora_cold_load.observe(seconds)
            if self.ray:
                self.ray.lora_cold_load.observe(seconds)

    def render(self, extra: CollectorRegistry | None = None) -> bytes:
        """Prometheus text format of these metrics (and `extra`'s)."""
        out = generate_latest(self.registry)
        return out + generate_latest(extra) if extra is not None else out


def _labels(names: list[str]) -> list[str]:
    """Prometheus `layer` label per router: the decoder layer number, plus the
    router's branch where one layer has several (ERNIE-VL: text_moe / vision_moe)."""
    nums = [m.group(1) if (m := re.search(r"layers\.(\d+)\.", n)) else str(i) for i, n in enumerate(names)]
    out = []
    for num, name in zip(nums, names):
        if nums.count(num) > 1:
            branch = name.split(f"layers.{num}.", 1)[-1].rsplit(".", 1)[0].removeprefix("mlp.")
            out.append(f"{num}.{branch}")
        else:
            out.append(num)
    return out


class ExpertLoad:
    """Token counts per (layer, expert), cumulative and over a sliding window.

    Args:
        model: the base model (hooks stay valid when PEFT wraps it).
        window_steps: balancedness is computed over this many engine steps.
        threshold: warn when a layer's mean/max falls below this.
        registry: prometheus registry for the balancedness gauge.
        ray_mirror: also record balancedness, imbalance and tokens per expert through\n            `ray.serve.metrics`.
    """

    def __init__(self, model, window_steps: int = 32, threshold: float = 0.3,
                 registry: CollectorRegistry | None = None, ray_mirror: bool = False,
                 ep_size: int = 1, placement: dict[str, list[int]] | None = None):
        routers = find_routers(model)
        self.num_layers = len(routers)
        # decoder layer numbers (dense layers, e.g. DeepSeek's first ones, have no router)
        self.layer_ids = [int(m.group(1)) if (m := re.search(r"layers\.(\d+)\.", name)) else i
                          for i, (name, _, _) in enumerate(routers)]
        self.router_names = [name for name, _, _ in routers]
        self.labels = _labels(self.router_names)
        self.num_experts = max((e for _, _, e in routers), default=0)
        self._total = torch.zeros(self.num_layers, self.num_experts, dtype=torch.long)  # [layers, E]
        self.window = torch.zeros_like(self._total)  # [layers, E]
        # (layer, expert ids) the hooks saw and nobody counted yet: counted in one go when read
        # (_fold), so a forward adds no op per layer beyond keeping the ids, and on a GPU no
        # copy to the host (a wait for the GPU) per layer
        self._seen: list[tuple[int, torch.Tensor]] = []
        self._paused = False  # inside `uncounted`
        self.window_steps, self.threshold = window_steps, threshold
        self._steps = 0
        self._lock = threading.Lock()
        # [T] bool while a forward runs padded rows (the engine's batched prefill): only real tokens count
        self.token_mask = None
        self.registry = registry or CollectorRegistry()
        self.balance = Gauge("moeflow_expert_balancedness", "Mean/max tokens per expert over the window.",
                             ["layer"], registry=self.registry)
        self.imbalance = Counter("moeflow_expert_imbalance", "Windows whose balancedness fell below threshold.",
                                 ["layer"], registry=self.registry)
        self.last_balance: list[float] = [1.0] * self.num_layers
        # served slot j of a layer holds logical expert perm[j] (a permuted checkpoint's manifest
        # says so); counts are reported by logical expert, so they compare across placements
        placement = placement or {}
        self.perms = [list(placement.get(n) or range(self.num_experts)) for n in self.router_names]
        self.ep_size = ep_size if ep_size >= 1 and self.num_experts % ep_size == 0 else 1
        self.registry.register(_ExpertTokens(self))
        self.ray: ExpertRayMirror | None = None
        if ray_mirror:
            self.ray = ExpertRayMirror(self.labels, self.perms, self.num_experts, self.ep_size, threshold)
        # called with each closed window's counts [layers][E] (an engine core process sends them
        # to its replica, which mirrors them to Ray: core.py)
        self.on_window: Callable[[list[list[int]]], None] | None = None
        # [layers]: routing a compiled forward's hooks stored (take_compiled); None: nothing
        self._pending: list[torch.Tensor | None] = [None] * len(routers)
        for layer, (_, module, experts) in enumerate(routers):
            module.register_forward_hook(self._hook(layer, experts))

    def _hook(self, layer: int, num_experts: int):

        def count(module, _inputs, output):
            if torch.compiler.is_compiling():  # a compiled decode (deploy.compile): `take_compiled`
                # traced into the graph: only a store, no read of this object's state (each read
                # would be a guard, and _seen's length changes every step: a recompile each time)
                self._pending[layer] = routed_experts(output, module.top_k, num_experts)
                return
            if self._paused:
                return
            indices = routed_experts(output, module.top_k, num_experts)  # [T, top_k]
            if indices is None:
                return
            mask = self.token_mask
            if mask is not None and mask.shape[0] == indices.shape[0]:
                indices = indices[mask.to(indices.device)]  # [T_real, top_k]
            self._seen.append((layer, indices))  # list.append: atomic, never torn by a reader's _fold
        return count

    def take_compiled(self, drop: bool = False) -> None:
        """Count what a compiled forward's hooks stored, as `count` would have (its pads left
        out by token_mask); `drop`: the forward failed, forget it."""
        mask = self.token_mask
        for layer, indices in enumerate(self._pending):
            if indices is None:
                continue
            self._pending[layer] = None
            if drop or self._paused:
                continue
            if mask is not None and mask.shape[0] == indices.shape[0]:
                indices = indices[mask.to(indices.device)]  # [T_real, top_k]
            self._seen.append((layer, indices))

    def _fold(self) -> None:
        """Count what the hooks saw into the window and the totals (the caller holds the lock)."""
        n = len(self._seen)
        if not n:
            return
        seen = self._seen[:n]
        del self._seen[:n]  # what a hook appends meanwhile stays for the next fold
        # one bincount over every layer's ids, each layer's offset by layer * E
        ids = torch.cat([idx.reshape(-1) + layer * self.num_experts for layer, idx in seen])
        hist = torch.bincount(ids, minlength=self.num_layers * self.num_experts).cpu()
        hist = hist.view(self.num_layers, self.num_experts)  # [layers, E], where the counters live
        self.window += hist
        self._total += hist

    @contextlib.contextmanager
    def uncounted(self) -> Iterator[None]:
        """Forwards inside are not traffic (the engine's own checks, its warm-up): what they route
        is dropped. Nests (a check inside the warm-up)."""
        paused, self._paused = self._paused, True
        try:
            yield
        finally:
            self._paused = paused

    @property
    def total(self) -> torch.Tensor:
        """Cumulative tokens per (MoE layer, served expert slot) [layers, E], up to now (a copy:
        the engine thread goes on counting into the original)."""
        with self._lock:
            self._fold()
            return self._total.clone()

    def step_done(self) -> None:
        """Close the window every `window_steps` engine steps and update the gauges."""
        self._steps += 1
        if self._steps % self.window_steps == 0:
            self.flush()
        elif len(self._seen) > 64 * max(1, self.num_layers):  # bounded between windows
            with self._lock:
                self._fold()

    def flush(self) -> None:
        with self._lock:
            self._fold()
            window = self.window.clone()
            self.window.zero_()
        if self.ray or self.on_window:
            counts = window.tolist()
            if self.ray:
                self.ray.push(counts)
            if self.on_window:
                self.on_window(counts)
        for layer in range(self.num_layers):
            peak = int(window[layer].max()) if self.num_experts else 0
            if peak == 0:
                continue
            value = float(window[layer].float().mean()) / peak
            self.last_balance[layer] = value
            label = self.labels[layer]
            self.balance.labels(label).set(value)
            if value < self.threshold:
                self.imbalance.labels(label).inc()
                log.warning("expert load imbalance: layer %s balancedness %.2f < %.2f (hot expert %d)",
                            label, value, self.threshold, int(window[layer].argmax()))

    def logical_totals(self) -> list[list[int]]:
        """Cumulative tokens per (MoE layer, logical expert), whatever placement is served."""
        served = self.total.tolist()
        out = []
        for row, perm in zip(served, self.perms):
            logical = [0] * self.num_experts
            for slot, count in enumerate(row):
                logical[perm[slot]] += count
            out.append(logical)
        return out

    def snapshot(self) -> dict:
        """Cumulative counts, shape [MoE layers, experts] (`layers`: their decoder layer
        numbers), for `GET /v1/expert_load`."""
        counts = self.total.tolist()
        return {"num_layers": self.num_layers, "num_experts": self.num_experts, "layers": self.layer_ids,
                "routers": self.router_names, "counts": counts, "balancedness": self.last_balance,
                "logical_counts": self.logical_totals(), "ep_size": self.ep_size}


class ExpertRayMirror:
    """The expert series through `ray.serve.metrics` (in a Serve replica), from each closed
    window's counts: balancedness and imbalance per layer, tokens per expert. Ray's counter
    updates (one per (layer, expert) each window: thousands on a large model) run on a thread of
    their own, never on the engine's.

    Args:
        labels: the MoE layers' labels; perms: served slot -> logical expert, per layer.
        num_experts: experts per layer; ep_size: expert-parallel ranks (`ep_rank` label).
        threshold: balancedness below which a window counts as imbalanced.
    """

    def __init__(self, labels: list[str], perms: list[list[int]], num_experts: int, ep_size: int,
                 threshold: float):
        # lazy: ray: heavy, loaded only when this runs
        from ray.serve import metrics as rm

        self.labels, self.perms, self.num_experts, self.ep_size = labels, perms, num_experts, ep_size
        self.threshold = threshold
        self.balance = rm.Gauge("moeflow_expert_balancedness", "Mean/max tokens per expert over the window.",
                                tag_keys=("layer",))
        self.imbalance = rm.Counter("moeflow_expert_imbalance", "Windows whose balancedness fell below threshold.",
                                    tag_keys=("layer",))
        self.tokens = rm.Counter("moeflow_expert_tokens", "Tokens routed to each expert.",  # tag_keys: as above
                                 tag_keys=("layer", "expert", "ep_rank"))  # type: ignore[arg-type]
        self._pusher = ThreadPoolExecutor(1, thread_name_prefix="moeflow-expert-tokens")

    def push(self, window: list[list[int]]) -> None:
        self._pusher.submit(self._push, window)

    def _push(self, window: list[list[int]]) -> None:
        per_rank = max(1, self.num_experts // self.ep_size)
        for label, row, perm in zip(self.labels, window, self.perms):
            peak = max(row, default=0)
            if peak == 0:
                continue
            value = sum(row) / len(row) / peak
            self.balance.set(value, tags={"layer": label})
            if value < self.threshold:
                self.imbalance.inc(1, tags={"layer": label})
            for slot, count in enumerate(row):
                if count:
                    self.tokens.inc(count, tags={"layer": label, "expert": str(perm[slot]),
                                                 "ep_rank": str(slot // per_rank)})


class _ExpertTokens:
    """`moeflow_expert_tokens_total{layer,expert,ep_rank}`, read from ExpertLoad's cumulative
    counts at scrape time (nothing on the forward path). `expert` is the logical expert id;
    `ep_rank` the expert-parallel rank holding it in the served placement (contiguous shards
    of the served order, as engines shard experts), so per-rank skew is
    `sum by (layer, ep_rank)` of the rate."""

    def __init__(self, load: "ExpertLoad"):
        self.load = load

    def describe(self):
        return [CounterMetricFamily("moeflow_expert_tokens", "Tokens routed to each expert.",
                                    labels=["layer", "expert", "ep_rank"])]

    def collect(self):
        load = self.load
        fam = CounterMetricFamily("moeflow_expert_tokens", "Tokens routed to each expert.",
                                  labels=["layer", "expert", "ep_rank"])
        served = load.total.tolist()
        per_rank = max(1, load.num_experts // load.ep_size)
        for label, row, perm in zip(load.labels, served, load.perms):
            for slot, count in enumerate(row):
                fam.add_metric([label, str(perm[slot]), str(slot // per_rank)], count)
        yield fam
