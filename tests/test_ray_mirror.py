"""The Ray mirror of the serving metrics records off the token path (metrics.py): callers queue,
its own thread makes the Ray calls, counters summed, gauges at their last value, every histogram
point kept. Ray's own export of the series through a Serve deployment: tests/test_serve_replicas.py.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from moeflow.serving import metrics as m


class Recorder:
    """Stands where a `ray.serve.metrics` object does: it records each call and its thread."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, float, dict | None, str]] = []

    def _add(self, kind: str, value: float, tags: dict | None) -> None:
        self.calls.append((kind, value, tags, threading.current_thread().name))

    def observe(self, value, tags=None):
        self._add("observe", value, tags)

    def inc(self, value=1.0, tags=None):
        self._add("inc", value, tags)

    def set(self, value, tags=None):
        self._add("set", value, tags)


def test_a_flush_keeps_every_point_sums_counters_and_keeps_the_last_gauge():
    pending: deque = deque()
    hist, count, gauge = Recorder(), Recorder(), Recorder()
    h, c, g = (m._Deferred(x, pending) for x in (hist, count, gauge))
    a, b = {"model_name": "a"}, {"model_name": "b"}
    for v in (0.01, 0.02, 0.03):
        h.observe(v, tags=a)
    c.inc(3, tags=a)
    c.inc(4, tags={"model_name": "a"})  # an equal tag set in another dict
    c.inc(1, tags=b)
    g.set(5, tags=a)
    g.set(2, tags=a)
    assert not (hist.calls or count.calls or gauge.calls)  # queued only
    assert m.flush_pending(pending) == 3 + 2 + 1
    assert [(k, v, t) for k, v, t, _ in hist.calls] == [("observe", 0.01, a), ("observe", 0.02, a),
                                                         ("observe", 0.03, a)]
    assert sorted((v, t["model_name"]) for _, v, t, _ in count.calls) == [(1, "b"), (7, "a")]
    assert [(k, v) for k, v, _, _ in gauge.calls] == [("set", 2)]
    assert not pending and m.flush_pending(pending) == 0


def test_points_queued_from_many_threads_are_each_recorded_once():
    pending: deque = deque()
    hist = Recorder()
    h = m._Deferred(hist, pending)

    def burst():
        for _ in range(2000):
            h.observe(0.5)
    threads = [threading.Thread(target=burst) for _ in range(4)]
    for t in threads:
        t.start()
    flushed = 0
    while any(t.is_alive() for t in threads):
        flushed += m.flush_pending(pending)  # flushing while they queue
    flushed += m.flush_pending(pending)
    assert flushed == len(hist.calls) == 8000


class _Mirror(m._RayMirror):
    def _make(self) -> None:  # Recorders where Ray's metrics would be
        self.itl, self.success, self.running = Recorder(), Recorder(), Recorder()


def test_the_mirror_makes_its_calls_on_its_own_thread_and_flushes_when_closed(monkeypatch):
    monkeypatch.setattr(m, "RAY_FLUSH_S", 0.05)
    mirror = _Mirror()
    itl, success = mirror.itl.metric, mirror.success.metric
    try:
        mirror.itl.observe(0.01, tags={"model_name": "x"})
        mirror.success.inc(1, tags={"model_name": "x", "finished_reason": "length"})
        deadline = time.time() + 10
        while (not itl.calls or not success.calls) and time.time() < deadline:
            time.sleep(0.01)
        assert [c[3] for c in itl.calls + success.calls] == ["moeflow-ray-metrics"] * 2
    finally:
        monkeypatch.setattr(m, "RAY_FLUSH_S", 60.0)  # the next wait outlasts the test: close() must flush
    time.sleep(0.2)
    mirror.running.set(3, tags={"model_name": "x"})
    mirror.close()
    assert [c[:2] for c in mirror.running.metric.calls] == [("set", 3)]
    assert not mirror._thread.is_alive()
