"""The engine core in its own process, one per replica (vLLM V1's split).

The Serve replica (service.py) keeps HTTP, tokenising, detokenising (with stop
strings) and the request metrics; the core process runs the `Engine`'s loop
(scheduling, forwards, sampling) over the model, which only it loads. The
replica's event loop, HTTP parsing and detokenising then no longer take turns
with the forwards under one GIL.

    client = EngineClient(settings, specs, tokenizer, metrics)   # starts the core, waits until ready
    client.submit(req_id, ids, params, sink, adapter, served)    # deltas arrive on sink (reader thread)

Transport: a Unix socket pair carrying pickled messages
(`multiprocessing.connection.Connection` framing). Why: both ends are this
code on one host, messages are small (a step's deltas: token ids, logprobs)
and already Python objects; no new dependency (pyzmq is not installed, and
ZMQ's queues would add nothing for one peer); a blocked `recv` releases the
GIL, so the replica's reader thread costs nothing while the core computes;
and either side closing -- exiting, crashing, SIGKILL -- is an EOF on the
other, which is how each notices the other died. The core sends one message
per engine step (every request's delta of the step), the replica one per
request (submit, abort) or adapter operation.

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

Metrics: the replica records the request metrics as deltas arrive (and
mirrors them to Ray in a Serve replica); the expert load is counted in the
core, whose closed windows go to the replica for Ray's mirror, and whose
counts the replica's `/metrics` and `/v1/expert_load` fetch when asked.
Not across the boundary: images (multimodal prompts need the model to lay
out their positions: image-text models need the in-process engine).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Callable

import torch

from moeflow.devices import local_device, model_device, resolve_dtype
from moeflow.errors import UserError
from moeflow.models import is_image_text, load_model
from moeflow.serving.adapters import AdapterRegistry, AdapterSpec, check_compatible
from moeflow.serving.detokenize import Detokenizer
from moeflow.serving.engine import Engine, check_request
from moeflow.serving.errors import STOPPED, EngineDead
from moeflow.serving.loadbook import placement_of
from moeflow.serving.metrics import ExpertLoad, ExpertRayMirror, ServingMetrics
from moeflow.serving.request import Delta, Sequence
from moeflow.serving.sampling import SamplingParams
from moeflow.serving.scheduler import EngineConfig, Scheduler
from moeflow.serving.settings import ServeSettings, on_this_node

log = logging.getLogger("moeflow.serving")

ADMITTED = "admitted"  # a core's event: the request left the queue (queue-time metric, queue limits)
STOP_TIMEOUT_S = 10.0
IMAGES_IN_PROCESS = "image inputs need the in-process engine (deploy.engine_process: false)"


def load_served(settings: ServeSettings, specs: dict[str, AdapterSpec]) -> Any:
    """The served model of a replica: the base on this replica's device, its experts kernel,
    the adapters checked against it, and in merged mode the merged adapter folded in.

    Raises:
        UserError: an adapter does not fit the base, or the merged one is not among them.
    """
    base = Path(on_this_node(settings.base_dir, settings.stored))
    device = local_device()  # the replica's GPU (num_gpus in the deployment), else CPU
    model = load_model(base, resolve_dtype(settings.dtype, device)).to(device)  # moeflow/models.py
    import moeflow.split_lora  # noqa: F401  registers SPLIT_IMPL with transformers (imports peft)
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


class _NoText:
    """The core's detokenizer: text is the replica's (EngineClient), the core sends token ids."""

    text = ""

    def add(self, token: int | None, final: bool) -> bool:
        return False

    def take(self, final: bool) -> str:
        return ""


class _Core:
    """The core process: an Engine whose deltas go to the replica, one message per step."""

    def __init__(self, conn: Connection, settings: ServeSettings, specs: dict[str, AdapterSpec]):
        self.conn = conn
        self.send_lock = threading.Lock()
        self.out_lock = threading.Lock()
        self.outbox: list[tuple[str, Any]] = []
        self.last_stats: Any = None
        self.dead_sent = False
        torch.set_num_threads(settings.torch_threads)  # tiny ops: more threads only add overhead
        model = load_served(settings, specs)
        registry = AdapterRegistry()
        if not settings.merge:
            for spec in specs.values():
                registry.add(spec)
        base = Path(on_this_node(settings.base_dir, settings.stored))
        self.experts = ExpertLoad(model, settings.expert_window_steps, settings.expert_balance_threshold,
                                  ep_size=settings.ep_size, placement=placement_of(base))
        self.engine = Engine(model, None, EngineConfig(**settings.engine), registry, None, self.experts)
        self.engine.outputs.detokenizer = lambda stops: _NoText()  # type: ignore[assignment,method-assign,return-value]
        self.engine.warm_up()  # deploy.compile: the decode graphs before the replica is told it is up
        admitted = self.engine._admitted

        def on_admit(seq: Sequence) -> None:
            admitted(seq)
            self._post(seq.req_id, ADMITTED)
        self.engine._admitted = on_admit  # type: ignore[method-assign]
        self.engine.after_step = self.flush
        self.experts.on_window = lambda counts: self.send(("experts", counts))  # the replica mirrors them to Ray

    def info(self) -> dict:
        e, x = self.engine, self.experts
        return {"max_model_len": e.max_model_len, "vocab_size": e.base.config.get_text_config().vocab_size,
                "config": dataclasses.asdict(e.config), "pid": os.getpid(), "image_text": is_image_text(e.base),
                "experts": {"layer_ids": x.layer_ids, "router_names": x.router_names, "labels": x.labels,
                            "num_experts": x.num_experts, "ep_size": x.ep_size, "perms": x.perms}}

    def send(self, msg: tuple) -> None:
        with self.send_lock:
            self.conn.send(msg)

    def _post(self, req_id: str, item: Any) -> None:
        with self.out_lock:
            self.outbox.append((req_id, item))

    def flush(self) -> None:
        """Send what the step produced (deltas, admissions, queue sizes) in one message."""
        e = self.engine
        running = [s for s in e.running if not s.finished]
        waiting = [s for s in e.waiting if not s.finished]
        run: dict[str, int] = {}
        wait: dict[str, int] = {}
        for s in running:
            run[s.model_name] = run.get(s.model_name, 0) + 1
        for s in waiting:
            wait[s.model_name] = wait.get(s.model_name, 0) + 1
        stats = (run, wait, sum(s.num_cached for s in running), len(e.slots.resident()))
        with self.out_lock:
            items, self.outbox = self.outbox, []
        if items or stats != self.last_stats:
            self.last_stats = stats
            self.send(("out", items, stats))
        if e.dead is not None and not self.dead_sent:
            self.dead_sent = True
            self.send(("dead", e.dead))

    def submit(self, req_id: str, ids: list[int], params: SamplingParams, adapter: str | None,
               model_name: str) -> None:
        try:
            self.engine.submit(req_id, ids, params, functools.partial(self._post, req_id),
                               adapter=adapter, model_name=model_name)
        except Exception as exc:  # refused here (engine dead, limits): the request ends with why
            self._post(req_id, Delta([], "", finish_reason="error", error=str(exc), prompt_tokens=len(ids)))
            self.flush()

    def call(self, call_id: int, op: str, args: tuple) -> None:
        """An operation the replica asked for; the answer goes back as ("reply", id, ok, value)."""
        def reply(fut: Future) -> None:
            exc = fut.exception()
            try:
                try:
                    self.send(("reply", call_id, exc is None, fut.result() if exc is None else exc))
                except (OSError, ValueError):
                    raise
                except Exception as bad:  # an answer that does not pickle: its text, so nobody waits
                    why = exc if exc is not None else bad
                    self.send(("reply", call_id, False, RuntimeError(f"{type(why).__name__}: {why}")))
            except (OSError, ValueError):  # the replica is gone (the reader exits)
                pass
        fut: Future = Future()
        fut.add_done_callback(reply)
        try:
            if op in Engine.OPS:  # adapter changes: on the engine thread, between steps
                self.engine.run(op, *args).add_done_callback(lambda f: _chain(f, fut))
                return
            if op == "add_adapter":
                self.engine.registry.add(args[0])
                fut.set_result(None)
            elif op == "expert_metrics":
                from prometheus_client import generate_latest  # heavy: only at a scrape

                fut.set_result(generate_latest(self.experts.registry))
            elif op == "expert_load":
                self.experts.flush()
                fut.set_result(self.experts.snapshot())
            elif op == "logical_totals":
                fut.set_result(self.experts.logical_totals())
            else:
                raise ValueError(f"unknown core operation {op!r}")
        except BaseException as exc:
            fut.set_exception(exc)

    def serve(self, parent: int) -> None:
        """Answer the replica and run the engine, on this one thread, until the replica says
        stop or goes away (then exit at once).

        One thread: between steps every message already on the socket is taken (a burst of
        submits joins the next step together), and when nothing is runnable the thread blocks
        on the socket. A reader thread beside the engine's would contend with the forwards
        for the GIL on every message.
        """
        self.send(("ready", self.info()))  # first: the step flushes follow it
        engine, conn = self.engine, self.conn
        while True:
            runnable = engine.dead is None and bool(engine.waiting or engine.running)
            try:
                if conn.poll(0 if runnable else 1.0):
                    while True:  # everything already sent, then one step
                        if self.handle(conn.recv()):
                            engine.stop()
                            return
                        if not conn.poll(0):
                            break
                elif not runnable:
                    if os.getppid() != parent:
                        return  # the replica died and we were re-parented
                    if engine.dead is None:
                        try:
                            engine.health()
                        except EngineDead as exc:
                            engine._die(str(exc))
                            self.flush()
                    continue
            except (EOFError, OSError):
                return  # the replica closed its end: it exited or was killed
            engine.iterate()

    def handle(self, msg: tuple) -> bool:
        """One message from the replica; True for stop."""
        kind = msg[0]
        if kind == "submit":
            self.submit(*msg[1:])
        elif kind == "abort":
            self.engine.abort(msg[1])
        elif kind == "call":
            self.call(msg[1], msg[2], msg[3])
        return kind == "stop"


def _chain(src: Future, dst: Future) -> None:
    exc = src.exception()
    if exc is None:
        dst.set_result(src.result())
    else:
        dst.set_exception(exc)


def main(argv: list[str]) -> None:
    """The core process: `python -m moeflow.serving.core FD PARENT_PID` (started by EngineClient)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s core %(levelname)s %(name)s: %(message)s")
    conn = Connection(int(argv[0]))
    parent = int(argv[1])
    try:
        _, settings_dict, specs = conn.recv()
        torch.set_grad_enabled(False)
        core = _Core(conn, ServeSettings(**settings_dict), specs)
    except (EOFError, OSError):
        os._exit(0)
    except BaseException as exc:  # the replica raises it as its own start-up failure
        log.exception("engine core failed to start")
        try:
            conn.send(("failed", str(exc) if isinstance(exc, UserError) else f"{type(exc).__name__}: {exc}"))
        finally:
            os._exit(1)
    try:
        core.serve(parent)
    finally:
        logging.shutdown()
        os._exit(0)  # never wait for threads: a forward in flight dies with the process


# ---------------------------------------------------------------------- the replica's side


@dataclasses.dataclass(eq=False)
class _Request:
    """A request in flight in the core, as the replica tracks it."""

    model_name: str
    num_prompt: int
    sink: Callable[[Delta], None]
    detok: Detokenizer
    arrival: float
    queued: bool = True
    generated: int = 0
    last_token_at: float | None = None


class RemoteExperts:
    """What `loadbook.Reporter` reads of an ExpertLoad, for one held by a core process; with
    `mirror`, each window the core closes goes to Ray's metrics from here (a Serve replica)."""

    def __init__(self, client: "EngineClient", meta: dict, mirror: bool, threshold: float):
        self.client = client
        self.layer_ids, self.router_names, self.labels = meta["layer_ids"], meta["router_names"], meta["labels"]
        self.num_experts, self.ep_size, self.perms = meta["num_experts"], meta["ep_size"], meta["perms"]
        self.mirror = ExpertRayMirror(self.labels, self.perms, self.num_experts, self.ep_size, threshold) \
            if mirror else None

    def logical_totals(self) -> list[list[int]]:
        return self.client.ask("logical_totals")


class EngineClient:
    """The replica's handle on its engine core process: the Engine's interface that Service uses
    (submit, reserve, abort, health, run, stop, max_model_len, config), over the socket.

    Args:
        settings: what to serve (the core loads the model itself).
        specs: the configured adapters, local paths (the replica downloaded any models:/ one).
        tokenizer: the replica's tokenizer (detokenising, stop strings).
        metrics: the replica's ServingMetrics (recorded here as deltas arrive).
        ray_metrics: mirror the core's expert windows to Ray's metrics (a Serve replica).
        timeout_s: how long an adapter or metrics question to the core may take.
    """

    def __init__(self, settings: ServeSettings, specs: dict[str, AdapterSpec], tokenizer: Any,
                 metrics: ServingMetrics | None = None, ray_metrics: bool = False, timeout_s: float = 120.0):
        self.tokenizer, self.metrics, self.timeout_s = tokenizer, metrics, timeout_s
        self.dead: str | None = None
        self._stopping = False
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()  # requests and calls in flight
        self._reqs: dict[str, _Request] = {}
        self._calls: dict[int, Future] = {}
        self._ids = itertools.count()
        self.resident = 0
        ours, theirs = socket.socketpair()
        try:
            # a fresh interpreter (spawn, not fork), in this process group: it dies with the replica
            self.proc = subprocess.Popen([sys.executable, "-m", "moeflow.serving.core", str(theirs.fileno()),
                                          str(os.getpid())], pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        finally:
            theirs.close()
        self.conn = Connection(ours.detach())
        try:
            self.conn.send(("start", settings.model_dump(), specs))
            info = self._wait_ready()
        except BaseException:
            self._kill()
            raise
        self.pid: int = info["pid"]
        self.max_model_len: int = info["max_model_len"]
        self.vocab_size: int = info["vocab_size"]
        self.config = EngineConfig(**info["config"])
        self.image_text: bool = info["image_text"]
        self.experts = RemoteExperts(self, info["experts"], ray_metrics, settings.expert_balance_threshold)
        self.limits = Scheduler(self.config)  # the queue limits, counted here (reserve is synchronous)
        self._reader = threading.Thread(target=self._read, name="moeflow-core-reader", daemon=True)
        self._reader.start()

    def _wait_ready(self) -> dict:
        while not self.conn.poll(1.0):
            if self.proc.poll() is not None:
                raise UserError(f"the engine core process exited with code {self.proc.returncode} while starting "
                                "(its log says why)")
        try:
            kind, payload = self.conn.recv()
        except (EOFError, OSError):
            raise UserError(f"the engine core process exited with code {self.proc.wait()} while starting") from None
        if kind == "failed":
            raise UserError(payload)
        return payload

    @property
    def running(self) -> list[_Request]:
        """Requests admitted in the core and not finished (as far as its messages said)."""
        with self._lock:
            return [r for r in self._reqs.values() if not r.queued]

    @property
    def waiting(self) -> list[_Request]:
        """Requests sent to the core and not admitted yet."""
        with self._lock:
            return [r for r in self._reqs.values() if r.queued]

    # ------------------------------------------------------------ the Engine's interface

    def submit(self, req_id: str, prompt_ids: list[int], params: SamplingParams,
               sink: Callable[[Delta], None], adapter: str | None = None, model_name: str = "base",
               image: Any = None) -> None:
        """Queue a request in the core; deltas (with their text) arrive on `sink` from the reader thread."""
        if image is not None:
            raise UserError(IMAGES_IN_PROCESS)
        check_request(prompt_ids, params, self.max_model_len, self.vocab_size)
        self.reserve([len(prompt_ids)])
        req = _Request(model_name, len(prompt_ids), sink, Detokenizer(self.tokenizer, params.stop),
                       time.monotonic())
        with self._lock:
            self._reqs[req_id] = req
        # stop strings are the replica's (it has the text); the core stops on EOS and lengths
        self._send(("submit", req_id, list(prompt_ids), dataclasses.replace(params, stop=[]), adapter, model_name))

    def reserve(self, lengths: list[int], dry_run: bool = False) -> None:
        if self.dead is not None:
            raise EngineDead(f"{STOPPED}: {self.dead}")
        self.limits.reserve(lengths, dry_run)

    def abort(self, req_id: str) -> None:
        """Stop a request; its last delta comes from the core (finish reason abort)."""
        if req_id in self._reqs:
            self._send(("abort", req_id), quiet=True)

    def health(self) -> None:
        if self.dead is not None:
            raise EngineDead(self.dead)
        if self.proc.poll() is not None:
            raise EngineDead(f"the engine core process exited with code {self.proc.returncode}")

    def run(self, op: str, *args: Any) -> Future:
        """An adapter operation (Engine.OPS) or a question (core ops) in the core; a Future of its answer."""
        fut: Future = Future()
        call_id = next(self._ids)
        with self._lock:
            if self.dead is not None:
                fut.set_exception(EngineDead(self.dead))
                return fut
            self._calls[call_id] = fut
        self._send(("call", call_id, op, args), quiet=True)
        return fut

    def ask(self, op: str, *args: Any) -> Any:
        """run() and wait for the answer (at most timeout_s)."""
        return self.run(op, *args).result(timeout=self.timeout_s)

    def stop(self) -> None:
        """Stop the core: ask, then SIGTERM, then SIGKILL; its requests end with an error."""
        self._stopping = True
        self._send(("stop",), quiet=True)
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

    # ------------------------------------------------------------ messages

    def _send(self, msg: tuple, quiet: bool = False) -> None:
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
                if msg[0] == "out":
                    for req_id, item in msg[1]:
                        try:
                            self._deliver(req_id, item)
                        except Exception as exc:  # this request's fault (its text, its sink): it alone ends
                            log.warning("request %s failed in the replica: %s", req_id, exc)
                            self._send(("abort", req_id), quiet=True)
                            with self._lock:
                                req = self._reqs.pop(req_id, None)
                            if req is not None:
                                self._finish(req, Delta([], "", finish_reason="error", error=f"output failed: {exc}",
                                                        prompt_tokens=req.num_prompt,
                                                        completion_tokens=req.generated))
                    run, wait, cached, self.resident = msg[2]
                    if self.metrics:
                        self.metrics.queue_counts(run, wait, cached)
                elif msg[0] == "reply":
                    with self._lock:
                        fut = self._calls.pop(msg[1], None)
                    if fut is not None:
                        fut.set_result(msg[3]) if msg[2] else fut.set_exception(msg[3])
                elif msg[0] == "experts":
                    if self.experts.mirror is not None:
                        self.experts.mirror.push(msg[1])
                elif msg[0] == "dead":
                    log.error("engine core unhealthy: %s", msg[1])
                    self.dead = msg[1]
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
        if self.dead is None:
            if not self._stopping:
                log.error("engine unhealthy: %s", reason)
            self.dead = reason
        with self._lock:
            reqs, self._reqs = self._reqs, {}
            calls, self._calls = self._calls, {}
        for fut in calls.values():
            fut.set_exception(EngineDead(reason))
        for req in reqs.values():
            self._finish(req, Delta([], "", finish_reason="error", error=f"{STOPPED}: {reason}",
                                    prompt_tokens=req.num_prompt, completion_tokens=req.generated))

    def _deliver(self, req_id: str, item: Any) -> None:
        """A core's event for one request: admitted, or a delta (text and stop strings added here)."""
        req = self._reqs.get(req_id)
        if req is None:
            return  # finished here already (a stop string), its abort's last delta
        now = time.monotonic()
        if item == ADMITTED:
            self._dequeue(req)
            if self.metrics:
                self.metrics.queue_time(req.model_name, now - req.arrival)
            return
        delta: Delta = item
        reason = delta.finish_reason
        if delta.token_ids:
            self._dequeue(req)
            if self.metrics:
                if req.last_token_at is None:
                    self.metrics.first_token(req.model_name, now - req.arrival)
                else:
                    self.metrics.inter_token(req.model_name, now - req.last_token_at)
            req.last_token_at = now
            ids = delta.token_ids
            for i, tok in enumerate(ids):  # as OutputProcessor.token: an EOS adds no text
                last = reason if i == len(ids) - 1 else None
                req.generated += 1
                if req.detok.add(None if last == "stop" else tok, final=last is not None):
                    if reason is None:
                        self._send(("abort", req_id), quiet=True)  # the core would go on
                    reason = "stop"  # a stop string
                    delta.token_ids, delta.logprobs = ids[:i + 1], delta.logprobs[:i + 1]
                    break
            delta.text = req.detok.take(final=reason is not None)
            delta.finish_reason, delta.completion_tokens = reason, req.generated
        if reason is None:
            req.sink(delta)
            return
        with self._lock:
            self._reqs.pop(req_id, None)
        self._finish(req, delta)

    def _dequeue(self, req: _Request) -> None:
        if req.queued:
            req.queued = False
            self.limits.release(req.num_prompt)

    def _finish(self, req: _Request, delta: Delta) -> None:
        self._dequeue(req)
        if self.metrics:
            self.metrics.finished(req.model_name, delta.finish_reason or "error", time.monotonic() - req.arrival,
                                  req.num_prompt, delta.completion_tokens)
        try:
            req.sink(delta)
        except Exception:  # a sink whose client went away must not stop the reader
            log.debug("sink failed", exc_info=True)


if __name__ == "__main__":
    main(sys.argv[1:])
