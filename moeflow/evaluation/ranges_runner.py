"""`RangesRunner`: StreamedRunner's log-likelihoods and greedy generations over resident layer
ranges -- contiguous ranges of decoder layers, each held by a Ray actor on a device of its own,
the evaluating process holding the front (embeddings, final norm, head).

    runner = RangesRunner("converted/", ranges=[(0, 20), (20, 40)])   # Ray initialised
    runner.attach_adapter("adapter/")
    runner.loglikelihood_detail([("2 + 2 =", " 4")])
    runner.close()

For a model larger than a device where the cluster has the devices (tasks/regress.py chooses,
moeflow.parallel.stage_prices.regress_layout sizes the ranges). Each actor reads only its layers,
once (moeflow.quant.source), and keeps them; a pass runs the front here and sends each batch's
hidden states through the actors in layer order (moeflow.quant.streamed.run_layer, the streamed
forward's own step, with the masks and position embeddings the front recorded), so a pass costs
compute and the hidden states' hops, never a read of the checkpoint. Batches are sent one after
another without waiting: while range k runs batch b, range k - 1 runs batch b + 1 (a pipeline;
each batch's result is what the layer-streamed forward gives it).

Adapters: as StreamedRunner applies them (PEFT's injection on each layer under its full module
path), once, when the adapter is attached: each actor gets the adapter's tensors of its own layers;
the front gets those outside the layers. The adapter in force (or none: the base) travels with
every call; switching never re-reads a layer. Generation recomputes the sequence per new token as
StreamedRunner does (same logits).

Memory: each actor its layers in the compute dtype and a batch's hidden states; the evaluating
process the front and the batches' hidden states and logits (each actor's and the front's peak:
`memory()`, moeflow.core.memmeter).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from moeflow.core.errors import UserError
from moeflow.evaluation.streamed_runner import StreamedRunner, inject_adapter, skeleton, switch_adapters

if TYPE_CHECKING:
    import torch


def moved(obj: Any, device, memo: dict | None = None) -> Any:
    """`obj` with every tensor in it (nested in tuples, lists, dicts) on `device`; a tensor met
    twice (every layer's position embeddings and mask are the same ones) is moved once."""
    # lazy: torch: heavy, loaded only when this runs
    import torch

    memo = {} if memo is None else memo
    if isinstance(obj, torch.Tensor):
        if id(obj) not in memo:
            memo[id(obj)] = (obj, obj.to(device))  # the source kept: its id stays its own
        return memo[id(obj)][1]
    if isinstance(obj, (list, tuple)):
        return type(obj)(moved(x, device, memo) for x in obj)
    if isinstance(obj, dict):
        return {k: moved(v, device, memo) for k, v in obj.items()}
    return obj


class LayerRange:
    """Decoder layers [start, stop) of a checkpoint, resident (a Ray actor of RangesRunner).

    Args:
        model_dir: checkpoint directory.
        start, stop: the layers it holds.
        dtype: compute dtype name.
    """

    def __init__(self, model_dir: str, start: int, stop: int, dtype: str):
        # lazy: torch: heavy, loaded only in the actor
        import torch

        from moeflow.core.devices import local_device
        from moeflow.core.memmeter import PeakMemory
        from moeflow.quant.source import ModelSource

        self.device = local_device()
        if self.device.type == "cpu":
            torch.set_num_threads(1)  # one CPU per worker, as the evaluation's shards
        self.dtype = getattr(torch, dtype)
        self.meter = PeakMemory(self.device.type)
        self.source = ModelSource(model_dir)
        self.start, self.stop = start, stop
        self.meter.start()  # just before the first tensor is read
        self.layers = {i: self.source.build_layer(i, self.dtype).to(self.device) for i in range(start, stop)}
        self.built = {i: 1 for i in self.layers}  # reads of each layer: one, whatever runs later
        self.adapters: dict[str, list[int]] = {}  # adapter -> the layers it has tensors for
        self.active: str | None = None

    def attach(self, name: str, config, state: dict) -> list[int]:
        """Adapter `name` (its PeftConfig, its tensors of these layers) injected into the layers
        it has tensors for; returns those layers."""
        have = []
        for i, layer in self.layers.items():
            prefix = self.source.layer_prefix(i)
            part = {k: v for k, v in state.items() if k.startswith(prefix)}
            if part:
                inject_adapter(skeleton(self.source.layers_prefix, i, layer), name, config, part, self.dtype,
                               str(self.source.path))
                have.append(i)
        self.adapters[name] = have
        self.active = "?"  # switched on the next forward
        return have

    def forward(self, hidden: torch.Tensor, context: dict, active: str | None) -> torch.Tensor:
        """`hidden` [B, T, H] through the layers, in order, with adapter `active` (None: the
        base); `context`: the front's record of the batch ("calls": per layer (args, kwargs),
        "deltas": per layer None or what the model adds after it)."""
        # lazy: torch: heavy, loaded only in the actor
        from moeflow.quant.streamed import run_layer

        if active != self.active:
            for layer in self.layers.values():
                switch_adapters(layer, active)
            self.active = active
        hidden = hidden.to(self.device)
        memo: dict = {}
        for i, layer in self.layers.items():
            hidden = run_layer(layer, hidden, moved(context["calls"][i], self.device, memo),
                               moved(context["deltas"][i], self.device, memo))
        return hidden.cpu()

    def record(self) -> dict:
        """{"range": [start, stop], "built": {layer: reads}, "adapters": {name: layers},
        "memory": this process's peak above its level before the first tensor}."""
        return {"range": [self.start, self.stop], "built": dict(self.built), "adapters": dict(self.adapters),
                "memory": self.meter.record()}


def check_ranges(ranges, layers: int, where: str) -> list[tuple[int, int]]:
    """`ranges` as [(start, stop)], checked to cover layers 0..`layers` - 1 in order, each once."""
    out = [(int(a), int(b)) for a, b in ranges]
    edges = [a for a, _ in out] + [out[-1][1]] if out else []
    if not out or edges[0] != 0 or edges[-1] != layers or any(b != c for (_, b), (c, _) in zip(out, out[1:])) \
            or any(b <= a for a, b in out):
        raise UserError(f"{where}: layer ranges {out} do not cover its {layers} decoder layers in order, "
                        f"each once")
    return out


def _close(workers: list) -> None:
    # lazy: ray: heavy, loaded only when this runs
    import ray

    for w in workers:
        ray.kill(w)
    workers.clear()


class RangesRunner(StreamedRunner):
    """StreamedRunner's interface over resident layer ranges (see the module docstring).

    Args:
        model_dir: checkpoint directory.
        dtype: compute dtype name.
        batch_size: requests per batch.
        ranges: [start, stop) of each range, covering every decoder layer in order.
    """

    text_only = "the layer-range evaluation runs text tasks only"

    def __init__(self, model_dir: str | Path, dtype: str = "float32", batch_size: int = 16,
                 ranges: list[tuple[int, int]] | tuple = ()):
        # lazy: ray: heavy, loaded only when this runs
        import ray

        from moeflow.core.devices import gpus_per_worker

        if not ray.is_initialized():
            raise RuntimeError("RangesRunner needs Ray: call ray.init() first")
        super().__init__(model_dir, dtype, batch_size)
        self.ranges = check_ranges(ranges, self.streamed.num_layers, self.model_dir)
        gpus = gpus_per_worker()
        have = ray.cluster_resources().get("GPU", 0.0)
        if gpus and have < gpus * len(self.ranges):
            raise UserError(f"regress over {len(self.ranges)} layer ranges needs a GPU each; the Ray cluster "
                            f"has {have:g}: set regress.layout streamed, or add nodes")
        # a device each where there are GPUs; no CPU reserved: a range computes while the
        # evaluating process (which holds one) waits on it, as calibrate's expert-group actors
        actor = ray.remote(num_cpus=0, num_gpus=gpus)(LayerRange)
        self.workers: list = [actor.remote(self.model_dir, a, b, dtype) for a, b in self.ranges]  # handles
        self._finalizer = weakref.finalize(self, _close, self.workers)
        try:
            self.records()  # every range built (a bad checkpoint fails here, naming the layer)
        except ray.exceptions.RayError as exc:  # an actor that failed to build dies with its error
            self.close()
            said = [ln for ln in str(exc).splitlines() if "UserError: " in ln]
            if said:
                raise UserError(said[-1].split("UserError: ", 1)[1]) from None
            raise

    def attach_adapter(self, adapter_dir: str | Path) -> None:
        """StreamedRunner's attach (the front's part), then each range its layers' tensors."""
        # lazy: ray: heavy, loaded only when this runs
        import ray

        super().attach_adapter(adapter_dir)
        name = self.adapters[-1]
        config, state = self._loaded[name]
        parts = []
        for a, b in self.ranges:
            mine = tuple(self.streamed.layer_prefix(i) for i in range(a, b))
            parts.append({k: v for k, v in state.items() if k.startswith(mine)})
        ray.get([w.attach.remote(name, config, part) for w, part in zip(self.workers, parts)])

    def _hidden_states(self, inputs: list[dict]) -> list[torch.Tensor]:
        # lazy: ray: heavy, loaded only when this runs
        import ray

        runs = [self.streamed.front.run(b) for b in inputs]
        pending = []
        for run in runs:  # each batch sent on without waiting: the ranges pipeline the batches
            context = ray.put(moved({"calls": run["calls"], "deltas": run["deltas"]}, "cpu"))
            hidden = run["hidden"].cpu()
            for w in self.workers:
                hidden = w.forward.remote(hidden, context, self._active)
            pending.append(hidden)
        return [h.to(self.streamed.device) for h in ray.get(pending)]

    def records(self) -> list[dict]:
        """Each range's record (LayerRange.record)."""
        # lazy: ray: heavy, loaded only when this runs
        import ray

        return ray.get([w.record.remote() for w in self.workers])

    def memory(self) -> dict:
        """{"front": this process's peak, "ranges": each range's} (moeflow.core.memmeter)."""
        return {"front": self.meter.record(), "ranges": [r["memory"] for r in self.records()]}

    def close(self) -> None:
        """Stop the range actors (also when the runner is collected)."""
        self._finalizer()


@dataclass(frozen=True)
class Ranges:
    """A runner_cls for moeflow.evaluation.runners.evaluate: RangesRunner on these ranges."""

    ranges: tuple[tuple[int, int], ...]
    text_only: ClassVar[str] = RangesRunner.text_only

    def __call__(self, model_dir: str, dtype: str = "float32", batch_size: int = 16) -> RangesRunner:
        return RangesRunner(model_dir, dtype, batch_size, ranges=self.ranges)
