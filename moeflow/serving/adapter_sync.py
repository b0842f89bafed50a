"""Runtime adapter changes across one replica's requests and across a deployment's replicas.

- `AdapterGate`: per adapter name, a replica's requests and its load/unload calls take
  turns in arrival order, so a request never finds its adapter gone half way;
- `AdapterBook`: the runtime-loaded adapters of one deployment, a named detached Ray actor
  every replica syncs from (at most every `SYNC_S` seconds), with the driver's
  `reset_book` and the replicas' `open_book`.

Which adapters may be served and which are resident: adapters.py.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncContextManager, AsyncIterator


class AdapterGate:
    """Per adapter name, requests and load/unload calls take turns in arrival order.

    A request holds its adapter's gate (shared with other requests) from resolving the name
    until its sequences are queued on the engine; a load or unload holds it alone. So an unload
    either comes first (the request then gets the 404 of an unknown model) or after the request
    is queued (the engine refuses it with 409 while the request runs): a request never finds
    its adapter gone half way, and two unloads never both pass the registry check. A waiting
    load/unload stops new requests from entering, so it is not starved by a steady stream.
    """

    def __init__(self):
        self._waiting: dict[str, list[tuple[str, object]]] = {}  # name -> tickets in arrival order
        self._inside: dict[str, int] = {}  # name -> requests inside; -1 while a change is inside
        self._cond = asyncio.Condition()

    @staticmethod
    def key(model: str) -> str:
        """The gate of a `model` field: its adapter part (`base:adapter` or `adapter`)."""
        return model.rpartition(":")[2] if isinstance(model, str) else ""

    def use(self, name: str) -> AsyncContextManager[None]:
        """Shared: one request resolving `name` and queueing its sequences."""
        return self._hold(name, change=False)

    def change(self, name: str) -> AsyncContextManager[None]:
        """Exclusive: one load or unload of `name`."""
        return self._hold(name, change=True)

    @contextlib.asynccontextmanager
    async def _hold(self, name: str, change: bool) -> AsyncIterator[None]:
        await self._enter(name, change)
        try:
            yield
        finally:
            await self._leave(name, change)

    async def _enter(self, name: str, change: bool) -> None:
        ticket = ("change" if change else "use", object())
        async with self._cond:
            queue = self._waiting.setdefault(name, [])
            queue.append(ticket)

            def may() -> bool:
                inside = self._inside.get(name, 0)
                if change:  # first in line, nobody inside
                    return queue[0] is ticket and inside == 0
                ahead = queue[:queue.index(ticket)]
                return inside >= 0 and not any(kind == "change" for kind, _ in ahead)
            try:
                await self._cond.wait_for(may)
            finally:
                queue.remove(ticket)
                if not queue:
                    del self._waiting[name]
                self._cond.notify_all()  # a cancelled waiter may unblock those behind it
            self._inside[name] = -1 if change else self._inside.get(name, 0) + 1

    async def _leave(self, name: str, change: bool) -> None:
        async with self._cond:
            left = 0 if change else self._inside[name] - 1
            if left:
                self._inside[name] = left
            else:
                del self._inside[name]
            self._cond.notify_all()


class AdapterBook:
    """Runtime-loaded adapters of one deployment, shared by its replicas (a named Ray actor).

    A replica that loads or unloads an adapter at run time writes it here; every
    replica syncs from it (at start, on a request for a model it does not know,
    and at most every `SYNC_S` seconds otherwise), so a runtime load reaches the
    replicas running now and the ones Serve starts later.
    """

    def __init__(self):
        self.version = 0
        self.entries: dict[str, str] = {}  # name -> lora_path as the caller gave it

    def put(self, name: str, source: str) -> int:
        self.entries[name] = source
        self.version += 1
        return self.version

    def remove(self, name: str) -> int:
        self.entries.pop(name, None)
        self.version += 1
        return self.version

    def snapshot(self) -> tuple[int, dict[str, str]]:
        return self.version, dict(self.entries)


SYNC_S = 1.0


def book_name(app_name: str) -> str:
    return f"moeflow-adapters-{app_name}"


def reset_book(app_name: str) -> None:
    """Forget a previous deployment's runtime adapters (driver side, before serve.run)."""
    # lazy: ray: heavy, loaded only when this runs
    import ray

    try:
        ray.kill(ray.get_actor(book_name(app_name), namespace="moeflow"))
    except ValueError:  # none yet
        pass


def open_book(app_name: str):
    """The deployment's AdapterBook, created by the first replica that asks. Detached: it lives
    as long as the Serve app, not as long as whichever replica or driver created it."""
    return ray_remote_book().options(name=book_name(app_name), namespace="moeflow", lifetime="detached",
                                     get_if_exists=True).remote()


def ray_remote_book():
    # lazy: ray: heavy, loaded only when this runs
    import ray

    return ray.remote(num_cpus=0)(AdapterBook)
