"""ServingMetrics (metrics.py) as the output processor drives it: per-model series through cached
children, and the running/waiting gauges set only when a model's counts change -- every change
still shows, in Prometheus' registry and through the Ray mirror."""

from __future__ import annotations

from moeflow.serving import metrics as m


def _sample(metrics: m.ServingMetrics, name: str, **labels) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, float, dict | None]] = []

    def observe(self, value, tags=None):
        self.calls.append(("observe", value, tags))

    def set(self, value, tags=None):
        self.calls.append(("set", value, tags))


def test_per_output_series_count_every_call_per_model():
    metrics = m.ServingMetrics()
    for model, n in (("a", 3), ("b", 2), ("a", 1)):
        for _ in range(n):
            metrics.inter_token(model, 0.002)
            metrics.first_token(model, 0.01)
            metrics.queue_time(model, 0.001)
    for series in ("moeflow_inter_token_latency_seconds", "moeflow_time_to_first_token_seconds",
                   "moeflow_request_queue_time_seconds"):
        assert _sample(metrics, f"{series}_count", model_name="a") == 4
        assert _sample(metrics, f"{series}_count", model_name="b") == 2


def test_gauges_follow_every_change_and_skip_repeats():
    metrics = m.ServingMetrics()
    running, waiting = Recorder(), Recorder()

    class Mirror:  # stands where the Ray mirror does
        pass
    metrics.ray = Mirror()  # type: ignore[assignment]
    metrics.ray.running, metrics.ray.waiting = running, waiting  # type: ignore[attr-defined]
    steps = [({"a": 2}, {"a": 1}), ({"a": 2}, {"a": 1}), ({"a": 3}, {}), ({"a": 3}, {}), ({}, {}),
             ({"a": 1, "b": 1}, {})]
    seen = []
    for run, wait in steps:
        metrics.queue_counts(run, wait, 0)
        seen.append((_sample(metrics, "moeflow_num_requests_running", model_name="a"),
                     _sample(metrics, "moeflow_num_requests_waiting", model_name="a")))
    assert seen == [(2, 1), (2, 1), (3, 0), (3, 0), (0, 0), (1, 0)]  # every step's counts, repeats too
    assert _sample(metrics, "moeflow_num_requests_running", model_name="b") == 1
    a = {"model_name": "a"}
    # the mirror: both of a model's gauges when its pair changed, nothing on a repeat
    assert [c[1] for c in running.calls if c[2] == a] == [2, 3, 0, 1]
    assert [c[1] for c in waiting.calls if c[2] == a] == [1, 0, 0, 0]
