"""Where a served adapter's weights are: on the device, in host memory, or only at their source.

Three tiers, as S-LoRA and vLLM keep them:
- device: at most `max_loras` adapters resident in the model (`LoraSlots`, adapters.py),
  least recently used evicted, never one a running sequence uses, never a pinned one;
- host: at most `max_cpu_loras` adapters' tensors held in CPU memory (`HostTier`), least
  recently used evicted, never a pinned one. Making a held adapter resident is a copy
  from memory (no disk or network read);
- source: the adapter directory (local, a `models:/` download, or an object-store URI).
  A cold adapter is read from there by one loader thread, off the engine's step.

`AdapterTiers` ties them together for the engine core. A waiting sequence whose adapter
is not held yet is not admitted (`ensure` answers False) and its adapter is read in the
background; the sequences behind it are admitted meanwhile, so a burst of requests to
cold adapters does not stall those of resident ones. Before each step the waiting queue
is read ahead (`prefetch`): the adapters it names are read into host memory in queue
order, and into a free device slot once held.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import torch

from moeflow.core.errors import UserError
from moeflow.serving.adapters import AdapterSpec, LoraSlots, check_tensor, read_adapter_source

log = logging.getLogger("moeflow.serving")

Shapes = Mapping[str, "tuple[int, int] | None"]  # adapters.module_shapes: module -> (in, out) of a Linear


@dataclass
class HeldAdapter:
    """One adapter in host memory: its adapter_config and its tensors (CPU)."""

    spec: AdapterSpec
    config: dict
    tensors: dict[str, torch.Tensor]
    load_s: float  # how long reading it from its source took

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def read_held(spec: AdapterSpec, shapes: Shapes) -> HeldAdapter:
    """Read an adapter from its source into CPU memory and check it against the base.

    Raises:
        UserError: not a LoRA adapter, pickle weights, a tensor targeting a module the base
            lacks or of the wrong shape, NaN/inf weights.
    """
    t0 = time.perf_counter()
    config, tensors, where = read_adapter_source(spec.path)
    for key, tensor in tensors.items():
        check_tensor(where, key, list(tensor.shape), lambda t=tensor: t, shapes)
    return HeldAdapter(spec, config, tensors, time.perf_counter() - t0)


def into_peft(peft: Any, base: Any, held: HeldAdapter, device: str) -> Any:
    """Add a held adapter to the PEFT model (created over `base` for the first one) from
    memory: PEFT's own `load_adapter` minus its file read (the config from the held
    adapter_config, the weights assigned from the held tensors, which on a CPU device are
    used in place). Returns the PeftModel; on failure the model is left as it was.
    """
    # lazy: peft: heavy, loaded only when this runs
    from peft import LoraConfig, PeftModel, set_peft_model_state_dict

    name = held.spec.name
    raw = {k: v for k, v in held.config.items() if k != "runtime_config"}  # as PeftConfig.from_json_file
    config = LoraConfig.from_peft_type(**LoraConfig.check_kwargs(**raw))
    config.inference_mode = True
    first = peft is None
    if first:
        peft = PeftModel(base, config, adapter_name=name, low_cpu_mem_usage=True)
    else:
        peft.add_adapter(name, config, low_cpu_mem_usage=True)
    try:
        # PEFT's autocast_adapter_dtype: half-precision adapter weights computed in float32
        weights = {k: v.to(device, torch.float32 if v.dtype in (torch.float16, torch.bfloat16) else v.dtype)
                   for k, v in held.tensors.items()}
        result: Any = set_peft_model_state_dict(peft, weights, adapter_name=name, low_cpu_mem_usage=True)
        missing = [k for k in result.missing_keys if "lora_" in k and f".{name}." in k]
        if missing:
            raise UserError(f"adapter {name!r}: its weights lack {missing[0]} ({len(missing)} missing)")
    except BaseException:
        if first:
            peft.unload()  # strips the LoRA layers from `base` again
        else:
            peft.delete_adapter(name)
        raise
    return peft


class HostTier:
    """Adapters held in CPU memory (LRU, `capacity`, pinned never evicted), read from their
    source by one background thread.

    Args:
        capacity: at most this many held.
        shapes: the base model's modules (adapters.module_shapes), what adapters are checked against.
        on_ready: called (on the loader thread) after each read, done or failed: wakes the engine.
        pinned: names never evicted.
    """

    def __init__(self, capacity: int, shapes: Shapes, on_ready: Callable[[], None] = lambda: None,
                 pinned: Iterable[str] = ()):
        if capacity < 1:
            raise UserError(f"max_cpu_loras must be >= 1 (got {capacity})")
        self.capacity = capacity
        self.shapes = shapes
        self.pinned = set(pinned)
        self._on_ready = on_ready
        self._held: OrderedDict[str, HeldAdapter] = OrderedDict()
        self._queue: deque[AdapterSpec] = deque()
        self._queued: set[str] = set()
        self._failed: dict[str, str] = {}
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._closed = False
        self.evictions = 0
        self.cold_loads = 0  # reads from a source, since the start
        self._load_times: list[float] = []  # read times not yet reported (`drain_load_times`)

    def get(self, name: str) -> HeldAdapter | None:
        """The held adapter (now the most recently used), or None."""
        with self._lock:
            held = self._held.get(name)
            if held is not None:
                self._held.move_to_end(name)
            return held

    def held(self) -> list[str]:
        with self._lock:
            return list(self._held)

    def loading(self, name: str) -> bool:
        with self._lock:
            return name in self._queued

    def request(self, spec: AdapterSpec) -> bool:
        """Read `spec` in the background unless it is held, queued or its failure is unreported.
        True when a read was queued."""
        with self._lock:
            if spec.name in self._held or spec.name in self._queued or spec.name in self._failed:
                return False
            self._queue.append(spec)
            self._queued.add(spec.name)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="moeflow-adapter-loader", daemon=True)
                self._thread.start()
            self._wake.notify()
            return True

    def load_now(self, spec: AdapterSpec) -> HeldAdapter:
        """Read `spec` on the calling thread (pinned adapters at start, a runtime load's check)."""
        held = self.get(spec.name)
        if held is not None:
            return held
        held = read_held(spec, self.shapes)
        self._insert(held)
        return held

    def take_failures(self) -> dict[str, str]:
        """Reads that failed since the last call (name -> why); a later request reads again."""
        with self._lock:
            failed, self._failed = self._failed, {}
            return failed

    def drain_load_times(self) -> tuple[int, tuple[float, ...]]:
        """(reads since the start, the read times not reported before)."""
        with self._lock:
            times, self._load_times = tuple(self._load_times), []
            return self.cold_loads, times

    def forget(self, name: str) -> None:
        """Drop an adapter that is no longer served (its queued read is dropped too)."""
        with self._lock:
            self._held.pop(name, None)
            self._failed.pop(name, None)
            self.pinned.discard(name)
            if name in self._queued:
                self._queue = deque(s for s in self._queue if s.name != name)
                self._queued.discard(name)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._wake.notify_all()

    def _insert(self, held: HeldAdapter) -> None:
        with self._lock:
            self._held[held.spec.name] = held
            self._held.move_to_end(held.spec.name)
            self.cold_loads += 1
            self._load_times.append(held.load_s)
            while len(self._held) > self.capacity:
                victim = next((n for n in self._held if n not in self.pinned and n != held.spec.name), None)
                if victim is None:
                    break  # only pinned ones left: over capacity by the pinned count at most
                del self._held[victim]
                self.evictions += 1

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
                spec = self._queue[0]
            try:
                held = read_held(spec, self.shapes)
            except Exception as exc:  # a broken adapter fails its requests, not the engine
                why = str(exc) if isinstance(exc, UserError) else f"{type(exc).__name__}: {exc}"
                with self._lock:
                    if spec.name in self._queued:  # not forgotten meanwhile
                        self._failed[spec.name] = why
                log.warning("adapter %s could not be read: %s", spec.name, why)
            else:
                with self._lock:
                    current = spec.name in self._queued
                if current:
                    self._insert(held)
                    log.info("adapter %s read into host memory in %.3f s", spec.name, held.load_s)
            with self._lock:
                if self._queue and self._queue[0] is spec:
                    self._queue.popleft()
                self._queued.discard(spec.name)
            self._on_ready()


@dataclass
class TierStats:
    """Counters of the adapter tiers since the start (CoreStats carries them to the front end)."""

    device_evictions: int = 0
    host_evictions: int = 0
    host_hits: int = 0  # device loads that found the adapter in host memory (no source read)
    held: int = 0  # adapters in host memory now
    cold_loads: int = 0  # source reads since the start
    load_times: tuple[float, ...] = field(default_factory=tuple)  # read times since the last report


class AdapterTiers:
    """The engine core's adapters across device, host memory and source (the core's thread only,
    except the host tier's loader).

    Args:
        max_loras: device slots.
        max_cpu_loras: host-memory slots (None: 4 x max_loras).
        shapes: the base model's modules (adapters.module_shapes).
        load: callable(spec, held) that makes a held adapter resident in the model.
        unload: callable(name) that removes one from the model.
        on_ready: wakes the engine when a background read finished.
        pinned: adapters never evicted from either tier (loaded by `pin`).
    """

    def __init__(self, max_loras: int, max_cpu_loras: int | None, shapes: Shapes,
                 load: Callable[[AdapterSpec, HeldAdapter], None], unload: Callable[[str], None],
                 on_ready: Callable[[], None] = lambda: None, pinned: Iterable[str] = ()):
        pinned = list(dict.fromkeys(pinned))
        if len(pinned) > max_loras:
            raise UserError(f"pinned_adapters: {len(pinned)} adapters pinned but max_loras is {max_loras}")
        capacity = max_cpu_loras if max_cpu_loras is not None else 4 * max_loras
        if capacity < max_loras:
            raise UserError(f"max_cpu_loras ({capacity}) must be >= max_loras ({max_loras})")
        self.host = HostTier(capacity, shapes, on_ready, pinned)
        self.device = LoraSlots(max_loras, self._to_device, unload, pinned=pinned)
        self._load = load
        self._cold: set[str] = set()  # read from the source for a request: their device load is no hit
        self.host_hits = 0

    @property
    def pinned(self) -> set[str]:
        return self.device.pinned

    def pin(self, specs: Iterable[AdapterSpec]) -> None:
        """Read the pinned adapters and make them resident now (at start; errors are the caller's)."""
        for spec in specs:
            self.host.load_now(spec)
            self._cold.add(spec.name)
            if not self.device.acquire(spec, set()):
                raise UserError(f"pinned adapter {spec.name!r}: no device slot free")

    def ensure(self, spec: AdapterSpec, busy: set[str]) -> bool:
        """Make `spec` resident if it is held in host memory (a copy); else start reading it.

        Returns:
            True when resident; False when not ready (being read, or every device slot busy).

        Raises:
            UserError: every device slot holds a pinned adapter and this one is not pinned.
            Exception: the copy into the model failed (the adapter is broken).
        """
        if spec.name in self.device.resident():
            return self.device.acquire(spec, busy)  # touches its LRU entry
        if len(self.device.pinned) >= self.device.max_loras and spec.name not in self.device.pinned:
            raise UserError(f"every adapter slot (max_loras {self.device.max_loras}) holds a pinned adapter")
        if self.host.get(spec.name) is None:
            if self.host.request(spec):
                self._cold.add(spec.name)
            return False
        return self.device.acquire(spec, busy)

    def load_now(self, spec: AdapterSpec, busy: set[str]) -> bool:
        """A runtime load: read and check it now (errors raise to the caller), then make it
        resident if a slot is free or idle (True), else it waits in host memory (False)."""
        self.host.load_now(spec)
        self._cold.add(spec.name)
        return self.device.acquire(spec, busy)

    def prefetch(self, wanted: list[AdapterSpec], busy: set[str]) -> dict[str, str]:
        """Read ahead what the waiting queue names (in queue order, distinct), into host memory
        and into a free device slot (never evicting for it).

        Returns:
            adapters whose read failed since the last call (name -> why): the caller fails the
            waiting requests that named them.
        """
        failed = self.host.take_failures()
        room = self.host.capacity - len(self.host.pinned)
        seen: set[str] = set()
        resident = set(self.device.resident())
        for spec in wanted:
            if spec.name in seen or spec.name in failed or spec.name in resident:
                continue
            seen.add(spec.name)
            if len(seen) > room:  # more would evict what the queue wants sooner
                break
            if self.host.get(spec.name) is None:
                if self.host.request(spec):
                    self._cold.add(spec.name)
            elif len(resident) < self.device.max_loras:
                try:
                    if self.device.acquire(spec, busy):
                        resident.add(spec.name)
                except Exception as exc:  # its requests fail at admission (ensure raises again)
                    log.warning("adapter %s: prefetch into a device slot failed: %s", spec.name, exc)
        return failed

    def forget(self, name: str) -> None:
        """An adapter no longer served leaves every tier."""
        self.device.drop(name)
        self.device.pinned.discard(name)
        self.host.forget(name)
        self._cold.discard(name)

    def stats(self) -> TierStats:
        loads, times = self.host.drain_load_times()
        return TierStats(self.device.evictions, self.host.evictions, self.host_hits, len(self.host.held()),
                         loads, times)

    def close(self) -> None:
        self.host.close()

    def _to_device(self, spec: AdapterSpec) -> None:
        held = self.host.get(spec.name)
        if held is None:  # evicted from host memory between the check and the copy: read again
            held = self.host.load_now(spec)
            self._cold.add(spec.name)
        self._load(spec, held)
        if spec.name in self._cold:
            self._cold.discard(spec.name)
        else:
            self.host_hits += 1
