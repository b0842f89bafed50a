"""One replica of the server: the model, its engine thread and the answers the API needs.

`ServeSettings` says what to serve (base dir, adapters, merged or shared mode,
engine knobs, API key); `Service` is what one replica holds (model, engine
thread, metrics, runtime adapters) and what the HTTP layer (api.py) calls.
It knows nothing of HTTP: a request it refuses raises a library error
(errors.py), which api_errors.py maps to a status code.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import torch

from moeflow.core import storage
from moeflow.core.errors import UserError
from moeflow.core.storage.store import NotPublished
from moeflow.evaluation.verdict import parse_uri, resolve_verdict, why_refused
from moeflow.model.models import is_image_text, read_config
from moeflow.model.multimodal import ImagePrompt, decode_image, load_processor, prepare
from moeflow.serving.adapter_sync import SYNC_S, AdapterGate
from moeflow.serving.adapters import AdapterRegistry, AdapterSpec, check_name, make_spec
from moeflow.serving.client import IMAGES_IN_PROCESS, EngineClient
from moeflow.serving.core import CoreClient, RemoteExperts, load_served
from moeflow.serving.delivery import Chunker, Mailbox, join_deltas
from moeflow.serving.engine import Engine
from moeflow.serving.errors import AdapterInUse, EngineDead, ModelNotFound, RequestError, VerdictFailed, VerdictPending
from moeflow.serving.loadbook import placement_of
from moeflow.serving.metrics import ExpertLoad, ServingMetrics
from moeflow.serving.request import Delta
from moeflow.serving.sampling import SamplingParams
from moeflow.serving.scheduler import EngineConfig
from moeflow.serving.settings import ServeSettings, on_this_node

__all__ = ["ServeSettings", "Service", "on_this_node"]

log = logging.getLogger("moeflow.serving")


class Service:
    """One replica: loads the model, runs the engine thread, answers the API."""

    def __init__(self, settings: ServeSettings, ray_metrics: bool = False, book=None):
        from transformers import AutoTokenizer  # heavy: only once a replica starts

        torch.set_num_threads(settings.torch_threads)  # tiny ops: more threads only add overhead
        self.settings = settings
        self.api_key = settings.api_key
        self.base_name = settings.name()
        base = Path(on_this_node(settings.base_dir, settings.stored))
        if not (base / "config.json").is_file():
            raise UserError(f"{base}: not a model directory (no config.json)")
        self.tokenizer: Any = AutoTokenizer.from_pretrained(str(base))  # the model's tokenizer class
        # no token covers more characters than the longest vocabulary entry: a prompt longer than
        # max_model_len * that (x4 for normalisers) cannot fit, and is refused without tokenising it
        self.max_token_chars = 4 * max(len(t) for t in self.tokenizer.get_vocab())
        self.registry = AdapterRegistry(settings.adapter_root, settings.download_dir, settings.tracking_uri,
                                        temp_downloads=True)
        specs = {name: make_spec(name, self._local(src), src) for name, src in settings.adapters.items()}
        self.metrics = ServingMetrics(ray_mirror=ray_metrics)  # Serve replicas: also Ray's exporter
        # image-text models: the processor turns image_url parts into model inputs;
        # without a usable one, text requests still work and image requests get 400 + why
        self.processor, self.no_images = None, f"model {self.base_name} is served as a text model"
        self.model: Any = None  # the served model, when the engine runs in this process (images need it)
        self.engine: EngineClient = self._start_engine(settings, specs, base, ray_metrics)
        self.experts: ExpertLoad | RemoteExperts = self.engine.experts
        self.vocab_size = self.engine.vocab_size
        self.merged: str | None = settings.merge  # load_served folded it in (and checked it is one)
        if not self.merged:
            for spec in specs.values():
                self.registry.add(spec)
        self.metrics.kv_capacity = self.engine.config.max_num_seqs * self.engine.max_model_len
        # runtime adapters shared with the other replicas (AdapterBook actor; None: this replica only)
        self.book, self._book_seen = book, (-1, 0.0)
        self.runtime: dict[str, str] = {}  # runtime adapter -> lora_path as given
        self.gate = AdapterGate()
        self._sync_lock = asyncio.Lock()
        self._refresh: asyncio.Future | None = None  # a read of the book ahead of time (sync)
        if book is not None:
            import ray  # heavy: only on Ray Serve replicas (a book is a Ray actor)

            read_at = time.monotonic()
            version, entries = ray.get(book.snapshot.remote())
            self._apply_book(version, entries, read_at)

    def _start_engine(self, settings: ServeSettings, specs: dict[str, AdapterSpec], base: Path,
                      ray_metrics: bool) -> EngineClient:
        """The engine core in its own process (core.py; it loads the model) or on a thread here
        (deploy.engine_process; auto: in its own process unless the model takes images)."""
        auto = settings.engine_process == "auto"
        if settings.engine_process is True or (auto and not shows_vision(base)):
            client = CoreClient(settings, specs, self.tokenizer, self.metrics, ray_metrics)
            if not (client.image_text and auto):
                if client.image_text:
                    self.no_images = f"model {self.base_name}: {IMAGES_IN_PROCESS}"
                return client
            # a vision tower its config.json did not show: served in process after all
            log.info("%s takes images: its engine runs in the replica's process", self.base_name)
            client.stop()
        self.model = model = load_served(settings, specs)
        if is_image_text(model):
            try:
                self.processor = load_processor(base, self.tokenizer)
            except UserError as exc:
                self.no_images = str(exc)
                log.warning("images disabled: %s", exc)
        experts = ExpertLoad(model, settings.expert_window_steps, settings.expert_balance_threshold,
                             ray_mirror=ray_metrics, ep_size=settings.ep_size, placement=placement_of(base))
        registry = AdapterRegistry()  # the core's own, as a core process has: changes go through run()
        for spec in specs.values() if not settings.merge else ():
            registry.add(spec)
        engine = Engine(model, self.tokenizer, EngineConfig(**settings.engine), registry, self.metrics, experts)
        engine.warm_up()  # deploy.compile: the decode graphs before the first request
        engine.start()
        return engine

    def _local(self, source: str) -> str:
        if source.startswith("models:/"):
            return str(self.registry.download(source))
        if storage.is_uri(source):
            try:
                return storage.localize(source)  # a published output: fetched, checksums verified
            except NotPublished:  # a plain prefix (uploaded by hand): read from the store as it is
                return source
        return on_this_node(source, self.settings.stored)

    # ------------------------------------------------------------ names

    def model_cards(self) -> list[dict]:
        """/v1/models entries: the base (or merged model) and each adapter with its parent."""
        limit = self.engine.max_model_len
        if self.merged:
            return [{"id": self.merged, "object": "model", "owned_by": "moeflow", "root": self.base_name,
                     "parent": None, "max_model_len": limit, "merged": True}]
        cards = [{"id": self.base_name, "object": "model", "owned_by": "moeflow",
                  "root": self.settings.base_dir, "parent": None, "max_model_len": limit}]
        for name in self.registry.names():
            spec = self.registry.get(name)
            if spec is None:  # unloaded since names() was read
                continue
            cards.append({"id": name, "object": "model", "owned_by": "moeflow", "root": spec.source,
                          "parent": self.base_name, "max_model_len": limit})
        return cards

    def resolve_model(self, name: str) -> tuple[str, str | None]:
        """`model` field -> (served name, adapter or None); ModelNotFound listing what exists."""
        base, _, adapter = name.partition(":") if ":" in name else ("", "", name)
        if self.merged:
            if name == self.merged or base == self.base_name and adapter == self.merged:
                return self.merged, None
        elif name == self.base_name:
            return name, None
        elif (not base or base == self.base_name) and self.registry.get(adapter):
            return adapter, adapter
        available = ", ".join(c["id"] for c in self.model_cards())
        raise ModelNotFound(f"The model `{name}` does not exist. Available models: {available}", "model")

    # ------------------------------------------------------------ text

    def tokenize(self, text: str) -> list[int]:
        """Token ids of a prompt (run in a worker thread); RequestError when it cannot fit the context."""
        limit = self.engine.max_model_len
        if len(text) > limit * self.max_token_chars:
            raise RequestError(f"This model's maximum context length is {limit} tokens, but the prompt "
                               f"has {len(text)} characters (more than {limit} tokens)", "prompt")
        return self.tokenizer(text).input_ids

    def detokenize(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def check_ids(self, ids: list[int]) -> None:
        vocab = self.vocab_size
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise RequestError(f"prompt: token ids must be integers in [0, {vocab})", "prompt")

    def chat_prompt(self, messages: list[dict]) -> tuple[list[int], ImagePrompt | None]:
        """Apply the chat template; `image_url` parts go through the model's processor.

        Returns:
            (prompt token ids, the prompt's images or None).
        """
        rendered: list[dict] = []
        images: list[Any] = []
        for i, msg in enumerate(messages):
            content = msg.get("content")
            if isinstance(content, list):
                parts = []
                for j, part in enumerate(content):
                    kind, where = part.get("type"), f"messages[{i}].content[{j}]"
                    if kind == "text":
                        parts.append({"type": "text", "text": str(part.get("text", ""))})
                    elif kind == "image_url":
                        if self.processor is None:
                            raise RequestError(f"{where}: images are not supported: {self.no_images}",
                                               f"messages.{i}.content.{j}")
                        url: Any = part.get("image_url")
                        url = url.get("url") if isinstance(url, dict) else url
                        images.append(decode_image(url, f"{where}.image_url"))
                        parts.append({"type": "image"})
                    else:
                        raise RequestError(f"{where}: content part type {kind!r} is not supported "
                                               f"(text, image_url)", f"messages.{i}.content.{j}")
                # text-only prompts keep plain string content: every chat template renders that
                content = parts if any(p["type"] == "image" for p in parts) \
                    else "".join(p["text"] for p in parts)
            rendered.append({"role": msg["role"], "content": content or ""})
        if not self.tokenizer.chat_template:
            raise RequestError(f"model {self.base_name} has no chat template; use /v1/completions", "messages")
        try:
            text = self.tokenizer.apply_chat_template(rendered, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # jinja's TemplateError: the template refuses these messages (roles, order)
            raise RequestError(f"messages: the chat template refused them: {exc}", "messages") from None
        if len(text) > self.engine.max_model_len * self.max_token_chars:
            raise RequestError(f"This model's maximum context length is {self.engine.max_model_len} "
                               f"tokens; the messages are far longer", "messages")
        if images:
            assert self.model is not None  # a processor only with the in-process engine
            return prepare(self.processor, self.model, text, images)
        return self.tokenizer(text, add_special_tokens=False).input_ids, None

    # ------------------------------------------------------------ generation

    def generate_many(self, req_ids: list[str], prompts: list[list[int]], params: list[SamplingParams],
                      adapter: str | None, served: str, image: ImagePrompt | None = None,
                      stream: bool = True) -> list:
        """Submit every prompt of one request, or none (queue limits are checked for all first)."""
        self.engine.reserve([len(p) for p in prompts], dry_run=True)
        streams = []
        try:
            for rid, ids, p in zip(req_ids, prompts, params):
                streams.append(self.generate(rid, ids, p, adapter, served, image, stream))
        except BaseException:
            self.abort(req_ids[:len(streams)])
            raise
        return streams

    def abort(self, req_ids: list[str]) -> None:
        """Abort requests (finished ones are ignored): client gone, or a sibling prompt failed."""
        for rid in req_ids:
            self.engine.abort(rid)

    def generate(self, req_id: str, ids: list[int], params: SamplingParams, adapter: str | None,
                 served: str, image: ImagePrompt | None = None, stream: bool = True):
        """Submit now; return an async iterator of Deltas (ends after the finishing one)."""
        q: asyncio.Queue[Delta] = asyncio.Queue()
        box = Mailbox.of(asyncio.get_running_loop())
        interval = self.settings.stream_interval if stream else None
        self.engine.submit(req_id, ids, params, Chunker(lambda delta: box.post(q, delta), interval),
                           adapter=adapter, model_name=served, image=image)

        async def deltas():
            done = False
            try:
                while not done:
                    delta = await q.get()
                    # a slow reader gets fewer, bigger chunks: whatever is queued goes as one
                    while delta.finish_reason is None and not q.empty():
                        delta = join_deltas(delta, q.get_nowait())
                    done = delta.finish_reason is not None
                    yield delta
            finally:
                if not done:  # client went away: free the slot
                    self.engine.abort(req_id)
        return deltas()

    # ------------------------------------------------------------ adapters at run time

    async def load_adapter(self, name: str, path: str) -> None:
        """Load on this replica (validating it), then record it for every replica of the deployment."""
        if self.merged:
            raise RequestError("this deployment serves a merged model; runtime adapters are disabled")
        check_name(name)
        async with self.gate.change(name):  # one load/unload of a name at a time, requests wait
            await self._load_adapter(name, path)

    async def _load_adapter(self, name: str, path: str) -> None:
        await self.sync(force=True)
        if name == self.base_name or self.registry.get(name):
            raise RequestError(f"The lora adapter '{name}' has already been loaded.", "lora_name")
        source = await asyncio.to_thread(self._gated, path)  # MLflow calls
        spec = await asyncio.to_thread(lambda: make_spec(name, self.registry.resolve(source), path))  # file IO
        try:
            loaded = await asyncio.wrap_future(self.engine.run("load_or_check", spec))
        except EngineDead:
            raise
        except Exception as exc:  # PEFT refuses adapters of another base (shape/name mismatch)
            raise RequestError(f"lora_path {path!r}: cannot load into {self.base_name}: {exc}",
                               "lora_path") from None
        if not loaded:
            log.info("adapter %s registered; every slot busy, it loads on first use", name)
        self._register(spec)
        self.runtime[name] = path
        if self.book is not None:  # the version checked, so every replica serves that one
            self._book_seen = (await self.book.put.remote(name, source), time.monotonic())

    def _gated(self, path: str) -> str:
        """A runtime load's `lora_path` as the source to load: a registered version's gate
        verdict checked as `moeflow serve --adapter` checks it (an alias resolved once, so the
        version checked is the one loaded); any other path as is.

        Raises:
            VerdictFailed / VerdictPending: no PASS, and the server was not started with --force.
        """
        parsed = parse_uri(path)
        if parsed is None or not self.settings.tracking_uri:  # not a registry URI; or none resolves
            return path
        from mlflow.tracking import MlflowClient  # heavy: only when a registered version is loaded

        name = parsed[0]
        try:
            version, verdict, reason = resolve_verdict(MlflowClient(self.settings.tracking_uri), *parsed)
        except UserError as exc:  # no such version
            raise RequestError(str(exc), "lora_path") from None
        if verdict != "PASS":
            why = why_refused(verdict, reason)
            if not self.settings.allow_ungated:
                kind = VerdictFailed if verdict == "FAIL" else VerdictPending
                raise kind(f"lora_path {path}: refusing models:/{name}/{version}: {why}; a server "
                           "started with --force loads it", "lora_path")
            log.warning("loading models:/%s/%s at run time although %s (--force)", name, version, why)
        return f"models:/{name}/{version}"

    async def unload_adapter(self, name: str) -> None:
        """Unload on this replica and from the shared record (the others follow on their next sync)."""
        async with self.gate.change(name):
            await self._unload_adapter(name)

    async def _unload_adapter(self, name: str) -> None:
        await self.sync(force=True)
        missing = ModelNotFound(f"The lora adapter '{name}' cannot be found.", "lora_name")
        if not self.registry.get(name):
            raise missing
        try:
            await asyncio.wrap_future(self.engine.run("remove_adapter", name))
        except KeyError:  # gone meanwhile (another replica's unload, applied by a sync)
            raise missing from None
        except UserError as exc:
            raise AdapterInUse(str(exc), "lora_name") from None
        self._forget(name)
        self.runtime.pop(name, None)
        if self.book is not None:
            self._book_seen = (await self.book.remove.remote(name), time.monotonic())

    async def resolve(self, name: str) -> tuple[str, str | None]:
        """resolve_model, after syncing runtime adapters when stale or when `name` is unknown here."""
        await self.sync()
        try:
            return self.resolve_model(name)
        except ModelNotFound:
            if self.book is None:
                raise
            # retried whether or not this call changed anything: a concurrent request's sync may
            # have applied the same book version while this one waited for it
            await self.sync(force=True)
            return self.resolve_model(name)

    async def sync(self, force: bool = False) -> bool:
        """Apply the shared AdapterBook if it changed (at most every SYNC_S s unless forced).

        A request waits for the book only when this replica's copy is older than SYNC_S (or
        when forced). Past half of that, the first request starts a read in the background
        and goes on: under steady traffic no request waits for the book's actor, and the copy
        a request uses was still read less than SYNC_S before it (counted from when the read
        began).

        Returns:
            True when something changed here.
        """
        if self.book is None:
            return False
        age = time.monotonic() - self._book_seen[1]
        if not force and age < SYNC_S:
            if age >= SYNC_S / 2 and (self._refresh is None or self._refresh.done()):
                self._refresh = asyncio.ensure_future(self._refresh_book())
            return False
        return await self._read_book(force, SYNC_S)

    async def _refresh_book(self) -> None:
        try:
            await self._read_book(False, SYNC_S / 2)
        except Exception:  # a request that finds the copy stale reads the book itself, and fails then
            log.debug("background read of the adapter book failed", exc_info=True)

    async def _read_book(self, force: bool, max_age: float) -> bool:
        assert self.book is not None  # sync: only with a book
        async with self._sync_lock:  # one apply at a time: two would register the same adapter twice
            # a routine sync that waited for another one is answered by it: that one read the book
            # after this request arrived. Skipping without waiting would let this request use an
            # adapter another replica has just unloaded.
            if not force and time.monotonic() - self._book_seen[1] < max_age:
                return False
            read_at = time.monotonic()  # the copy's age counts from when the read began
            version, entries = await self.book.snapshot.remote()
            if version == self._book_seen[0]:
                self._book_seen = (version, read_at)
                return False
            return await asyncio.to_thread(self._apply_book, version, entries, read_at)

    def _apply_book(self, version: int, entries: dict[str, str], read_at: float) -> bool:
        """Register adapters the book has and this replica lacks; drop runtime ones it no longer has."""
        changed, settled = False, True
        for name, source in entries.items():
            if self.registry.get(name) is None:
                try:
                    self._register(make_spec(name, self.registry.resolve(source), source))
                    self.runtime[name], changed = source, True
                except UserError as exc:  # e.g. a models:/ download failing here: retried next sync
                    log.warning("runtime adapter %s not available on this replica: %s", name, exc)
                    settled = False
        for name in [n for n in self.runtime if n not in entries]:
            try:
                self.engine.run("remove_adapter", name).result(timeout=30)
                self._forget(name)
                del self.runtime[name]
                changed = True
            except Exception as exc:  # busy: requests still use it; retried next sync
                log.info("runtime adapter %s stays until its requests finish: %s", name, exc)
                settled = False
        self._book_seen = (version if settled else -1, read_at)
        return changed

    # ------------------------------------------------------------ observability

    def _register(self, spec: AdapterSpec) -> None:
        """A runtime adapter becomes servable here and in the engine core (which has its own registry)."""
        self.registry.add(spec)
        self.engine.run("add_adapter", spec)  # before any request naming it: one ordered channel

    def _forget(self, name: str) -> None:
        """After the engine core removed an adapter: this replica's registry forgets it too."""
        if self.registry.get(name) is not None:
            self.registry.remove(name)

    def render_metrics(self) -> bytes:
        self.metrics.lora_slots(self.engine.resident_loras, self.engine.config.max_loras)
        try:
            experts = self.engine.ask("expert_metrics")
        except Exception as exc:  # a core gone or stuck: the replica's own series still answer
            log.warning("expert metrics unavailable: %s", exc)
            experts = b""
        return self.metrics.render() + experts

    def expert_load(self) -> dict:
        return dict(self.engine.ask("expert_load"), model=self.base_name)

    def close(self) -> None:
        self.engine.stop()
        self.metrics.close()
        self.registry.close()


def shows_vision(model_dir: Path) -> bool:
    """Whether a checkpoint's config.json has a vision part (a `*vision*` sub-config, as
    transformers' image-text configs nest theirs), read without loading the model."""
    raw = read_config(model_dir)
    return any("vision" in key and isinstance(value, dict) for key, value in raw.items())
