"""The engine core in its own process, one per replica (vLLM V1's split).

The Serve replica (service.py) keeps HTTP, tokenising and the front end
(client.py: queue limits, and the output processor's detokenising, stop
strings and request metrics); the core process runs an `EngineCore`
(engine_core.py: scheduling, forwards, sampling) over the model, which only it
loads, and answers with token ids -- the same `StepOutputs` the in-process
engine's core hands its front end. The replica's event loop, HTTP parsing and
detokenising then no longer take turns with the forwards under one GIL.

    client = CoreClient(settings, specs, tokenizer, metrics)     # starts the core, waits until ready
    client.submit(req_id, ids, params, sink, adapter, served)    # deltas arrive on sink (reader thread)

Transport: a Unix socket pair carrying the typed messages of protocol.py,
pickled (`multiprocessing.connection.Connection` framing). Why: both ends are this
code on one host, messages are small (a step's deltas: token ids, logprobs)
and already Python objects; no new dependency (pyzmq is not installed, and
ZMQ's queues would add nothing for one peer); a blocked `recv` releases the
GIL, so the replica's reader thread costs nothing while the core computes;
and either side closing -- exiting, crashing, SIGKILL -- is an EOF on the
other, which is how each notices the other died. The core sends one message
per loop iteration (every request's output of the step), the replica one per
request (add, abort) or adapter operation.

Process: started with spawn semantics -- a fresh interpreter (`python -m
moeflow.serving.core FD`, the socket inherited as FD), never a fork of a
replica holding Ray's threads -- in the replica's process group. It dies with
the replica: its one thread reads the socket between engine steps, sees EOF
when the replica's end closes (any exit, SIGKILL included) and exits at once
(`os._exit`), at the latest one step later; a send to a closed end ends it
too; it also watches its parent pid. `stop()` asks it to stop, then SIGTERM, then SIGKILL.

Fault isolation: a core that dies fails its in-flight requests with the error
the in-process engine gives a dead engine (`the engine stopped serving: ...`),
its pending adapter operations with EngineDead, and `health()` raises, so Ray
Serve replaces the replica. An engine that turns dead inside a live core says
so (`dead`), and the same follows. Nothing waits without a timeout on a core
that may be gone: the reader thread blocks in `recv`, which returns EOF.

Metrics: the replica's output processor records the request metrics as
outputs arrive (and mirrors them to Ray in a Serve replica); the expert load is counted in the
core, whose closed windows go to the replica for Ray's mirror, and whose
counts the replica's `/metrics` and `/v1/expert_load` fetch when asked.
Not across the boundary: images (multimodal prompts need the model to lay
out their positions: image-text models need the in-process engine).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from concurrent.futures import Future
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from moeflow.core.devices import local_device, model_device, resolve_dtype
from moeflow.core.errors import UserError
from moeflow.model.models import is_image_text, load_model
from moeflow.serving.adapters import AdapterRegistry, AdapterSpec, check_compatible
from moeflow.serving.client import EngineClient
from moeflow.serving.engine_core import EngineCore
from moeflow.serving.errors import STOPPED, EngineDead
from moeflow.serving.loadbook import placement_of
from moeflow.serving.metrics import ExpertLoad, ExpertRayMirror, ServingMetrics
from moeflow.serving.protocol import (
    Abort,
    AddRequest,
    Call,
    CoreInfo,
    ExpertWindow,
    Failed,
    Ready,
    Reply,
    Shutdown,
    Start,
    StepOutputs,
)
from moeflow.serving.sampling import SamplingParams
from moeflow.serving.scheduler import EngineConfig
from moeflow.serving.settings import ServeSettings, on_this_node

log = logging.getLogger("moeflow.serving")

STOP_TIMEOUT_S = 10.0


def load_served(settings: ServeSettings, specs: dict[str, AdapterSpec]) -> Any:
    """The served model of a replica: the base on this replica's device, its experts kernel,
    the adapters checked against it, and in merged mode the merged adapter folded in.

    Raises:
        UserError: an adapter does not fit the base, or the merged one is not among them.
    """
    base = Path(on_this_node(settings.base_dir, settings.stored))
    device = local_device()  # the replica's GPU (num_gpus in the deployment), else CPU
    model = load_model(base, resolve_dtype(settings.dtype, device)).to(device)  # moeflow/model/models.py
    import moeflow.model.split_lora  # noqa: F401  registers SPLIT_IMPL with transformers (imports peft)
    if settings.experts_implementation and model._can_set_experts_implementation():
        model.set_experts_implementation(settings.experts_implementation)
    for spec in specs.values():
        check_compatible(spec.path, model)  # fail at start, not on a user's first request
    if settings.merge:
        from peft import PeftModel  # heavy: only in merged mode

        if settings.merge not in specs:
            raise UserError(f"deploy merge: adapter {settings.merge!r} is not among "
                            f"{sorted(specs) or 'the adapters'}")
        dev = str(model_device(model))  # PEFT's default would be cuda whenever torch sees one
        model = PeftModel.from_pretrained(model, specs[settings.merge].path, torch_device=dev).merge_and_unload()
    return model


# ---------------------------------------------------------------------- the core process


class _Core:
    """The core process: an EngineCore whose step outputs go to the replica, one message per step."""

    def __init__(self, conn: Connection, settings: ServeSettings, specs: dict[str, AdapterSpec]):
        self.conn = conn
        self.send_lock = threading.Lock()
        torch.set_num_threads(settings.torch_threads)  # tiny ops: more threads only add overhead
        model = load_served(settings, specs)
        registry = AdapterRegistry()
        if not settings.merge:
            for spec in specs.values():
                registry.add(spec)
        base = Path(on_this_node(settings.base_dir, settings.stored))
        self.experts = ExpertLoad(model, settings.expert_window_steps, settings.expert_balance_threshold,
                                  ep_size=settings.ep_size, placement=placement_of(base))
        self.engine = EngineCore(model, EngineConfig(**settings.engine), registry, self.experts, emit=self.send)
        self.engine.warm_up()  # deploy.compile: the decode graphs before the replica is told it is up
        self.experts.on_window = lambda counts: self.send(ExpertWindow(counts))  # the replica mirrors them to Ray

    def info(self) -> CoreInfo:
        e, x = self.engine, self.experts
        return CoreInfo(os.getpid(), e.max_model_len, e.vocab_size, dataclasses.asdict(e.config),
                        is_image_text(e.base),
                        {"layer_ids": x.layer_ids, "router_names": x.router_names, "labels": x.labels,
                         "num_experts": x.num_experts, "ep_size": x.ep_size, "perms": x.perms})

    def send(self, msg: Any) -> None:
        with self.send_lock:
            self.conn.send(msg)

    def call(self, msg: Call) -> None:
        """An operation the replica asked for; the answer goes back as a Reply."""
        def reply(fut: Future) -> None:
            exc = fut.exception()
            try:
                try:
                    self.send(Reply(msg.call_id, exc is None, fut.result() if exc is None else exc))
                except (OSError, ValueError):
                    raise
                except Exception as bad:  # an answer that does not pickle: its text, so nobody waits
                    why = exc if exc is not None else bad
                    self.send(Reply(msg.call_id, False, RuntimeError(f"{type(why).__name__}: {why}")))
            except (OSError, ValueError):  # the replica is gone (the reader exits)
                pass
        try:
            fut = self.engine.run(msg.op, *msg.args)  # adapter changes run between steps
        except BaseException as exc:
            fut = Future()
            fut.set_exception(exc)
        fut.add_done_callback(reply)

    def serve(self, parent: int) -> None:
        """Answer the replica and run the engine, on this one thread, until the replica says
        stop or goes away (then exit at once).

        One thread: between steps every message already on the socket is taken (a burst of
        submits joins the next step together), and when nothing is runnable the thread blocks
        on the socket. A reader thread beside the engine's would contend with the forwards
        for the GIL on every message.
        """
        self.send(Ready(self.info()))  # first: the step outputs follow it
        engine, conn = self.engine, self.conn
        ran = True
        while True:
            runnable = engine.dead is None and bool(engine.waiting or engine.running)
            try:
                # runnable but the last pass ran nothing: requests wait for adapters being read
                # off the step (adapter_tiers.py), so poll briefly instead of spinning
                if conn.poll((0 if ran else 0.01) if runnable else 1.0):
                    while True:  # everything already sent, then one step
                        if self.handle(conn.recv()):
                            engine.stop()
                            return
                        if not conn.poll(0):
                            break
                elif not runnable:
                    if os.getppid() != parent:
                        return  # the replica died and we were re-parented
                    continue
            except (EOFError, OSError):
                return  # the replica closed its end: it exited or was killed
            ran = engine.iterate()

    def handle(self, msg: Any) -> bool:
        """One message from the replica; True for stop."""
        if isinstance(msg, AddRequest):
            self.engine.add_request(msg.req_id, msg.prompt_ids, msg.params, msg.adapter, msg.model_name)
        elif isinstance(msg, Abort):
            self.engine.abort(msg.req_id)
        elif isinstance(msg, Call):
            self.call(msg)
        return isinstance(msg, Shutdown)


def main(argv: list[str]) -> None:
    """The core process: `python -m moeflow.serving.core FD PARENT_PID` (started by CoreClient)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s core %(levelname)s %(name)s: %(message)s")
    conn = Connection(int(argv[0]))
    parent = int(argv[1])
    try:
        start: Start = conn.recv()
        torch.set_grad_enabled(False)
        core = _Core(conn, ServeSettings(**start.settings), start.specs)
    except (EOFError, OSError):
        os._exit(0)
    except BaseException as exc:  # the replica raises it as its own start-up failure
        log.exception("engine core failed to start")
        try:
            conn.send(Failed(str(exc) if isinstance(exc, UserError) else f"{type(exc).__name__}: {exc}"))
        finally:
            os._exit(1)
    try:
        core.serve(parent)
    finally:
        logging.shutdown()
        os._exit(0)  # never wait for threads: a forward in flight dies with the process


# ---------------------------------------------------------------------- the replica's side


class RemoteExperts:
    """What `loadbook.Reporter` reads of an ExpertLoad, for one held by a core process; with
    `mirror`, each window the core closes goes to Ray's metrics from here (a Serve replica)."""

    def __init__(self, client: "CoreClient", meta: dict, mirror: bool, threshold: float):
        self.client = client
        self.layer_ids, self.router_names, self.labels = meta["layer_ids"], meta["router_names"], meta["labels"]
        self.num_experts, self.ep_size, self.perms = meta["num_experts"], meta["ep_size"], meta["perms"]
        self.mirror = ExpertRayMirror(self.labels, self.perms, self.num_experts, self.ep_size, threshold) \
            if mirror else None

    def logical_totals(self) -> list[list[int]]:
        return self.client.ask("logical_totals")


class CoreClient(EngineClient):
    """The replica's front end over its engine core process (client.py's interface).

    Args:
        settings: what to serve (the core loads the model itself).
        specs: the configured adapters, local paths (the replica downloaded any models:/ one).
        tokenizer: the replica's tokenizer (text, stop strings).
        metrics: the replica's ServingMetrics (recorded as the core's outputs arrive).
        ray_metrics: mirror the core's expert windows to Ray's metrics (a Serve replica).
    """

    def __init__(self, settings: ServeSettings, specs: dict[str, AdapterSpec], tokenizer: Any,
                 metrics: ServingMetrics | None = None, ray_metrics: bool = False):
        self._dead: str | None = None
        self._stopping = False
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()  # calls in flight
        self._calls: dict[int, Future] = {}
        self._ids = itertools.count()
        ours, theirs = socket.socketpair()
        try:
            # a fresh interpreter (spawn, not fork), in this process group: it dies with the replica
            self.proc = subprocess.Popen([sys.executable, "-m", "moeflow.serving.core", str(theirs.fileno()),
                                          str(os.getpid())], pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        finally:
            theirs.close()
        self.conn = Connection(ours.detach())
        try:
            self.conn.send(Start(settings.model_dump(), specs))
            info = self._wait_ready()
        except BaseException:
            self._kill()
            raise
        super().__init__(tokenizer, EngineConfig(**info.config), metrics)
        self.pid, self.max_model_len, self.vocab_size = info.pid, info.max_model_len, info.vocab_size
        self.image_text = info.image_text
        self.experts = RemoteExperts(self, info.experts, ray_metrics, settings.expert_balance_threshold)
        self._reader = threading.Thread(target=self._read, name="moeflow-core-reader", daemon=True)
        self._reader.start()

    def _wait_ready(self) -> CoreInfo:
        while not self.conn.poll(1.0):
            if self.proc.poll() is not None:
                raise UserError(f"the engine core process exited with code {self.proc.returncode} while starting "
                                "(its log says why)")
        try:
            msg = self.conn.recv()
        except (EOFError, OSError):
            raise UserError(f"the engine core process exited with code {self.proc.wait()} while starting") from None
        if isinstance(msg, Failed):
            raise UserError(msg.reason)
        return msg.info

    @property
    def dead(self) -> str | None:
        return self._dead

    # ------------------------------------------------------------ the transport

    def _add(self, req_id: str, prompt_ids: list[int], params: SamplingParams, adapter: str | None,
             model_name: str, image: Any) -> None:
        self._send(AddRequest(req_id, prompt_ids, params, adapter, model_name))

    def _abort(self, req_id: str) -> None:
        self._send(Abort(req_id), quiet=True)

    def health(self) -> None:
        if self._dead is not None:
            raise EngineDead(self._dead)
        if self.proc.poll() is not None:
            raise EngineDead(f"the engine core process exited with code {self.proc.returncode}")

    def run(self, op: str, *args: Any) -> Future:
        fut: Future = Future()
        call_id = next(self._ids)
        with self._lock:
            if self._dead is not None:
                fut.set_exception(EngineDead(self._dead))
                return fut
            self._calls[call_id] = fut
        self._send(Call(call_id, op, args), quiet=True)
        return fut

    def stop(self) -> None:
        """Stop the core: ask, then SIGTERM, then SIGKILL; its requests end with an error."""
        self._stopping = True
        self._send(Shutdown(), quiet=True)
        try:
            self.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._kill()
        self._reader.join(timeout=5)
        self.conn.close()

    def _kill(self) -> None:
        for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            if self.proc.poll() is not None:
                return
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                continue

    def _send(self, msg: Any, quiet: bool = False) -> None:
        try:
            with self._send_lock:
                self.conn.send(msg)
        except (OSError, ValueError) as exc:  # the core is gone: the reader fails what is in flight
            if not quiet:
                raise EngineDead(f"{STOPPED}: the engine core process is gone ({exc})") from None

    def _read(self) -> None:
        try:
            while True:
                try:
                    msg = self.conn.recv()
                except (EOFError, OSError):
                    break
                if isinstance(msg, StepOutputs):
                    if msg.dead is not None:
                        self._dead = msg.dead
                    self._on_step(msg)
                elif isinstance(msg, Reply):
                    with self._lock:
                        fut = self._calls.pop(msg.call_id, None)
                    if fut is not None:
                        fut.set_result(msg.value) if msg.ok else fut.set_exception(msg.value)
                elif isinstance(msg, ExpertWindow) and self.experts.mirror is not None:
                    self.experts.mirror.push(msg.counts)
        finally:
            self._core_gone()

    def _core_gone(self) -> None:
        """The core closed its end: fail what is in flight, as the in-process engine does when it dies."""
        try:
            code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        reason = "the engine core process stopped" if self._stopping else \
            f"the engine core process exited with code {code}"
        if self._dead is None:
            if not self._stopping:
                log.error("engine unhealthy: %s", reason)
            self._dead = reason
        with self._lock:
            calls, self._calls = self._calls, {}
        for fut in calls.values():
            fut.set_exception(EngineDead(reason))
        self.outputs.fail_all(f"{STOPPED}: {reason}")


if __name__ == "__main__":
    main(sys.argv[1:])
