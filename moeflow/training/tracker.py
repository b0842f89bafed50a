"""Rank 0's MLflow logging of a finetune worker (moeflow.training.trainer): `Tracker`
writes into the stage's existing run by run id (MlflowClient, so the worker never changes
the run's status), buffered; `log_step` turns one training step's metrics and routing
statistics into metrics, and a loss spike into an event artifact."""

from __future__ import annotations

import time

from moeflow.model import routing as R


class Tracker:
    """Rank-0 MLflow logging into an existing run; a no-op without a run id."""

    def __init__(self, run_id: str | None, uri: str | None, enabled: bool):
        self.run_id = run_id if enabled else None
        self.buffer: list = []
        if self.run_id:
            # lazy: mlflow: heavy, loaded only when this runs
            from mlflow.tracking import MlflowClient

            self.client = MlflowClient(tracking_uri=uri)

    def metrics(self, values: dict[str, float], step: int) -> None:
        if self.run_id:
            # lazy: mlflow: heavy, loaded only when this runs
            from mlflow.entities import Metric

            now = int(time.time() * 1000)
            self.buffer += [Metric(k, float(v), now, step) for k, v in values.items()]
            if len(self.buffer) >= 5000:  # bounded memory on long runs between checkpoints
                self.flush()

    def flush(self) -> None:
        if self.run_id and self.buffer:
            for i in range(0, len(self.buffer), 1000):  # log_batch limit
                self.client.log_batch(self.run_id, metrics=self.buffer[i:i + 1000])
        self.buffer = []

    def dict(self, obj: dict, name: str) -> None:
        if self.run_id:
            self.client.log_dict(self.run_id, obj, name)

    def figure(self, fig, name: str) -> None:
        """Log a matplotlib figure, then close it (pyplot keeps every open figure alive)."""
        # lazy: matplotlib: heavy, loaded only when this runs
        import matplotlib.pyplot as plt

        try:
            if self.run_id:
                self.client.log_figure(self.run_id, fig, name)
        finally:
            plt.close(fig)


def log_step(tracker: Tracker, spikes: R.SpikeDetector, m: dict, counts, layer_ids: list[int],
             step: int, log_metrics: bool = True) -> dict | None:
    """Rank 0: step metrics + routing statistics; a loss spike becomes an event artifact.

    Returns:
        The spike record, or None.
    """
    flat = {f"train/{k}": v for k, v in m.items() if isinstance(v, (int, float))}
    flat["comm/allreduce_bytes_per_step"] = flat.pop("train/comm_bytes", 0)
    routing = R.step_metrics(counts, layer_ids) if counts is not None else {}
    if log_metrics:
        tracker.metrics({**flat, **routing}, step)
    spike = spikes.update(m["loss"])
    if spike:  # with the routing of that step: did routing fluctuation cause it?
        tracker.metrics({"train/loss_spike": 1.0}, step)
        tracker.dict({"step": step, **spike, "routing": routing,
                      "counts": counts.tolist() if counts is not None else None},
                     f"events/loss_spike_step{step:06d}.json")
    return spike
