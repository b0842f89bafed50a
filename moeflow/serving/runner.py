"""The model side of the engine: adapters in PEFT, LoRA modes, forwards over per-sequence KV caches.

`ModelRunner` (held by `EngineCore`, engine_core.py, as vLLM's engine core holds its
model runner) owns the model (`base`, `peft`) and the batched-LoRA state, and runs
the forwards: every row's new tokens packed over the paged cache (`packed`, paged.py),
or, for models it cannot page, a decode step of a `KVBatch` (kv_cache.py: left-padded
rows, pads masked out), fresh whole prompts in one left-padded forward, both in one
forward (`mixed`), one chunk of one sequence's prompt. Nothing here changes a sequence
before its forward succeeded (a failed decode restores the batch's cache), so the
engine may re-run a failed batch row by row.

Axis legend: B rows, L cached tokens, C new tokens, V vocab, H kv heads, D head dim.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any, Hashable

import torch

from moeflow.core.devices import model_device, to_device
from moeflow.serving.adapter_tiers import HeldAdapter, into_peft
from moeflow.serving.adapters import BASE, AdapterSpec
from moeflow.serving.kv_cache import KVBatch, batchable
from moeflow.serving.lora_batch import BatchedLora, direct_weights, supported
from moeflow.serving.paged import Row, StepLayout
from moeflow.serving.request import Sequence
from moeflow.serving.sampling import topk

if TYPE_CHECKING:
    from peft import PeftModel

    from moeflow.serving.metrics import ExpertLoad
    from moeflow.serving.paged import PagedCache

log = logging.getLogger("moeflow.serving")


class ModelRunner:
    """Forward passes and adapter residency (the engine thread only).

    Args:
        model: a transformers causal LM (eval mode), shared by all adapters.
        experts: optional ExpertLoad tracker hooked into the model (pads are not counted).
    """

    # the paged forwards run in inference mode (`packed`); benchmarks/bench_inference_mode.py
    # turns it off on one engine to time both in one run
    inference_mode = True

    def __init__(self, model: Any, experts: "ExpertLoad | None" = None, compile: bool = False):
        self.base: Any = model.eval()  # a transformers model; the base again once the last adapter left
        # forwards of the base (no adapter resident) through torch.compile (deploy.compile): dynamic
        # shapes (rows, new tokens and cached width vary every step), compiled at the first call of
        # each kind (`run`'s compiled), which Engine.warm_up makes before serving; None: eager
        # cpp_wrapper: Inductor calls the kernels of a graph from generated C++, not Python
        # (the demo model's compiled decode step: 1.1 ms against 1.25 ms)
        self.compiled: Any = torch.compile(model, dynamic=True, options={"cpp_wrapper": True}) if compile else None
        if compile:
            _compilable_experts(model)
            # one graph per kind of forward: decode (one row / several; the 2-D mask until the
            # first padded step's check, then the 4-D one), fresh prompts (alone / together),
            # mixed. Dynamo's default limit (8 per function) would run the rest eagerly
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)
        self.device = model_device(model)  # inputs are built on CPU and moved here in `run`
        self.peft: "PeftModel | None" = None  # once an adapter is loaded
        self.experts = experts
        self._batched: BatchedLora | None = None  # while only module LoRA is resident
        # resident adapters PEFT does not hold (lora_batch.direct_weights): name -> (held, weights)
        self.direct: dict[str, tuple[HeldAdapter, dict]] = {}
        self._lora_dirty = True
        self.kv_batchable: bool | None = None  # can this model's cache be batched (learnt at first prefill)
        # does a decode step take its padding as a ready [B, 1, 1, W] mask (learnt: _decode_mask)
        self.mask4d: bool | None = None
        # may fresh prompts join a decode batch's forward (learnt at the first mixed step: mixed)
        self.mixes: bool | None = None

    # ------------------------------------------------------------ adapters

    def load_adapter(self, spec: AdapterSpec, held: HeldAdapter) -> None:
        """Make an adapter resident from its copy in host memory (adapter_tiers.py: read and
        checked against the base there, off the engine's step). A plain LoRA on Linear modules
        while PEFT holds nothing is only kept for `BatchedLora.over_base` (its weights copied into
        the slot stacks, no PEFT layers: PEFT's add_adapter walked the module tree for ~0.4 s per
        load on the demo model); anything else, and then every resident adapter, goes through PEFT."""
        from moeflow.model.split_lora import enable_split_lora  # imports peft: only with adapters

        self._release_batched()
        weights = direct_weights(held.config, held.tensors, self.base) if self.peft is None else None
        if weights is not None:
            self.direct[spec.name] = (held, weights)
            log.info("loaded adapter %s (from host memory)", spec.name)
            return
        # the adapter goes where the base is (PEFT's default would be cuda whenever torch sees a
        # GPU, which a CPU replica on a GPU host does: Ray does not hide the host's GPUs from it)
        for other, _ in list(self.direct.values()):  # PEFT takes over the adapters resident so far
            self.peft = into_peft(self.peft, self.base, other, str(self.device))
        self.direct.clear()
        self.peft = into_peft(self.peft, self.base, held, str(self.device))
        enable_split_lora(self.peft)  # expert LoRA computes split under SPLIT_IMPL
        self.peft.eval()
        log.info("loaded adapter %s (from host memory)", spec.name)

    def unload_adapter(self, name: str) -> None:
        self._release_batched()
        if self.direct.pop(name, None) is not None:
            log.info("evicted adapter %s", name)
            return
        peft = self._peft()
        if list(peft.peft_config) == [name]:
            # PEFT cannot hold zero adapters cleanly: strip the LoRA layers (no merge)
            self.base = peft.unload()
            self.peft = None
        else:
            peft.delete_adapter(name)
        log.info("evicted adapter %s", name)

    def _peft(self) -> "PeftModel":
        if self.peft is None:
            raise RuntimeError("no adapter is loaded")
        return self.peft

    def _release_batched(self) -> None:
        """Give LoRA layers back to PEFT before the adapter set changes."""
        if self._batched is not None:
            self._batched.close()
            self._batched = None
        self._lora_dirty = True

    def lora_mode(self) -> str:
        """none (no adapter), batched (per-row / per-token LoRA, lora_batch.py) or peft (per-adapter forwards)."""
        if self.peft is None:
            if not self.direct:
                return "none"
            if self._lora_dirty:
                self._batched = BatchedLora.over_base(self.base, {n: w for n, (_, w) in self.direct.items()})
                self._lora_dirty = False
            return "batched"
        if self._lora_dirty:
            mixable = all(not getattr(c, "target_parameters", None) for c in self.peft.peft_config.values())
            if mixable and supported(self.peft):
                self._batched = BatchedLora.over_peft(self.peft, list(self.peft.peft_config))
            self._lora_dirty = False
        return "batched" if self._batched is not None else "peft"

    def group_key(self, seq: Sequence) -> Hashable:
        """Rows with the same key may share a forward: all while LoRA is batched, else one adapter's."""
        return None if self.lora_mode() != "peft" else (seq.adapter or BASE)

    def run(self, adapters: list[str | None], compiled: bool = False, counts: list[int] | None = None,
            **inputs: Any) -> tuple[torch.Tensor, Any]:
        """Forward rows that may use different adapters; returns (logits [B, C, V], cache).
        `compiled`: a forward of a kind Engine.warm_up compiles (decode steps; whole fresh
        prompts of 2 tokens or more, alone, together or beside decodes), which takes the
        compiled model when there is one and no adapter is resident. `counts`: each row's
        tokens in a packed forward ([1, T]; batched LoRA gives each token its row's adapter)."""
        mode = self.lora_mode()
        inputs = to_device(inputs, self.device)
        if mode == "none" and compiled and self.compiled is not None:
            out = self._run_compiled(inputs)
        elif mode == "none":
            out = self.base(**inputs, use_cache=True)
        elif mode == "batched":
            batched = self._batched
            assert batched is not None  # lora_mode: batched
            batched.select([batched.slot[a] if a else 0 for a in adapters], counts, inputs.get("logits_to_keep"))
            # the transformers model (under PEFT's wrappers when PEFT holds the adapters)
            inner: Any = self.base if self.peft is None else self.peft.base_model.model
            try:
                out = inner(**inputs, use_cache=True)
            finally:
                batched.clear()
        else:  # expert LoRA resident: PEFT cannot mix, the caller groups rows by adapter
            names = {a or BASE for a in adapters}
            assert len(names) == 1, "per-adapter forwards take one adapter at a time"
            out = self._run_single(names.pop(), inputs)
        return out.logits, out.cache

    def _run_compiled(self, inputs: dict[str, Any]) -> Any:
        """A forward through the compiled model. If it fails, every forward runs eagerly from
        then on (a warning says why): a forward without a cache runs again eagerly at once;
        one over a cache raises (it may have appended to it: the caller restores the cache
        and the engine re-runs the rows)."""
        try:
            out = self.compiled(**inputs, use_cache=True)
        except Exception as exc:
            log.warning("compiled forward failed (%s: %s); forwards run eagerly from now on",
                        type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            self.compiled = None
            if self.experts is not None:
                self.experts.take_compiled(drop=True)
            if "cache" in inputs:
                raise
            return self.base(**inputs, use_cache=True)
        if self.experts is not None:
            self.experts.take_compiled()
        return out

    def _run_single(self, name: str, inputs: dict[str, Any]) -> Any:
        peft = self._peft()
        if name == BASE:
            with peft.disable_adapter():
                return peft(**inputs, use_cache=True)
        peft.set_adapter(name)
        return peft(**inputs, use_cache=True)

    # ------------------------------------------------------------ forwards

    def decode_batch(self, kv: KVBatch) -> torch.Tensor:
        """One decode token for every row of `kv`, appended to its cache in place.

        Returns:
            logits [B, V] (float32). On failure the cache is restored, so the rows can be re-run.
        """
        seqs = kv.seqs
        lengths = [s.num_cached for s in seqs]
        ids = torch.tensor([[s.tokens[s.num_cached]] for s in seqs])  # [B, 1]
        pos = torch.tensor(lengths)[:, None]  # [B, 1]
        deltas = [s.image.rope_delta if s.image is not None else 0 for s in seqs]
        if any(deltas):  # M-RoPE: generated tokens continue after the image's positions
            pos = (pos + torch.tensor(deltas)[:, None]).unsqueeze(0).expand(3, -1, -1)  # [3, B, 1]
        mask = kv.grow_mask(1)  # [B, W + 1]
        snap = kv.snapshot()
        adapters = [s.adapter for s in seqs]
        try:
            attn = self._decode_mask(kv, adapters, snap, input_ids=ids, attention_mask=mask, position_ids=pos)
            logits, cache = self.run(adapters, compiled=True, input_ids=ids, attention_mask=attn, position_ids=pos,
                                      cache=kv.cache)
        except BaseException:
            kv.restore(snap)
            raise
        kv.cache, kv.mask = cache, mask
        for seq in seqs:
            seq.num_cached += 1
        return logits[:, -1].float()  # [B, V]

    def _decode_mask(self, kv: KVBatch, adapters: list[str | None], snap: Any,
                     **inputs: Any) -> torch.Tensor:
        """The attention mask of a decode step: the [B, W + 1] padding mask, or the same as the
        [B, 1, 1, W + 1] boolean mask SDPA takes, which transformers then uses as it is.

        A one-token query sees every real cached column, so the padding alone is the whole
        mask: building it from the 2-D mask (transformers' mask functions, every step) is
        work a decode step need not do. Used only where nothing else shapes the mask -- SDPA,
        every cache layer a plain full-attention one (no sliding window, no chunked attention
        in the config) -- and after one padded step gave the same logits both ways (a model
        whose forward reads the 2-D mask for more than attention keeps it).
        """
        mask = inputs["attention_mask"]  # [B, W + 1]
        if self.mask4d is False or (self.mask4d is None and bool(mask.all())):
            return mask
        fast = mask.to(self.device, torch.bool)[:, None, None, :]  # [B, 1, 1, W + 1]
        if self.mask4d:
            return fast
        # lazy: transformers: heavy, loaded only when this runs
        from transformers.cache_utils import DynamicLayer

        text = self.base.config.get_text_config()
        if not (kv.mergeable and getattr(text, "_attn_implementation", None) == "sdpa"
                and all(type(layer) is DynamicLayer for layer in kv.cache.layers)
                and not getattr(text, "attention_chunk_size", None)):
            self.mask4d = False
            return mask
        # the same padded step both ways, the cache restored after each (a failure here leaves
        # the question open: the engine re-runs the rows, and a later step asks again)
        with self.experts.uncounted() if self.experts is not None else contextlib.nullcontext():
            want, _ = self.run(adapters, compiled=True, cache=kv.cache, **inputs)
            kv.restore(snap)
            got, _ = self.run(adapters, compiled=True, cache=kv.cache, **(inputs | {"attention_mask": fast}))
            kv.restore(snap)
        self.mask4d = bool(torch.allclose(got.float(), want.float(), rtol=1e-4, atol=1e-4))
        log.info("decode steps pass %s attention mask", "a ready 4-D" if self.mask4d else "the 2-D")
        return fast if self.mask4d else mask

    def can_mix(self, kv: KVBatch) -> bool:
        """Whether fresh prompts may join this decode batch's forward (`mixed`): plain full-attention
        layers only (a sliding window counts columns, and the joined rows add masked ones), no
        chunked attention, no M-RoPE rows (their positions are not a row's token count)."""
        if self.mixes is False or not kv.plain():
            return False
        return (not getattr(self.base.config.get_text_config(), "attention_chunk_size", None)
                and all(s.image is None for s in kv.seqs))

    def mixed(self, kv: KVBatch, fresh: list[Sequence]) -> torch.Tensor | None:
        """One decode token for every row of `kv` and the whole prompts of `fresh` in one forward
        (vLLM's chunked prefill beside decodes); the rows then decode as one batch.

        The forward is `[B, C]` wide, C the longest prompt: a decode row's token is its last
        column, a prompt is right-aligned in its row, the rest are masked pads (the decode rows
        keep C - 1 masked cache columns, the prompts' rows start with W). The first time, the
        same rows are also run apart and the logits must match (a model whose forward reads the
        2-D mask for more than attention must not mix); until then nothing is committed.

        Returns:
            last-position logits [B, V] of kv's rows then fresh's; None when this model's mixed
            forward differs (run them apart). On failure nothing changed: both can be re-run apart.
        """
        if self.mixes is None:
            self.mixes = self._mixed_matches(kv, fresh)
            log.info("fresh prompts %s decoding rows' forward", "join" if self.mixes else "do not join")
        if not self.mixes:
            return None
        logits, cache, mask = self._mixed_forward(kv, fresh)
        seqs = kv.seqs + fresh
        joined = KVBatch(cache, mask, seqs, mergeable=True)
        for seq in kv.seqs:
            seq.num_cached += 1
        for seq in fresh:
            seq.num_cached = seq.num_prompt
        for seq in seqs:
            seq.kv = joined
        return logits

    def _mixed_forward(self, kv: KVBatch, fresh: list[Sequence]) -> tuple[torch.Tensor, Any, torch.Tensor]:
        """The mixed forward (`mixed`), committing nothing: (logits [B, V], cache, mask [B, W + C])."""
        seqs, d = kv.seqs, len(kv)
        width = max(s.num_prompt for s in fresh)
        ids = torch.zeros(d + len(fresh), width, dtype=torch.long)  # [B, C]; pads are masked out
        new = torch.zeros(d + len(fresh), width, dtype=torch.long)  # [B, C]: 1 at real new tokens
        pos = torch.zeros(d + len(fresh), width, dtype=torch.long)  # [B, C]
        ids[:d, -1] = torch.tensor([s.tokens[s.num_cached] for s in seqs])
        pos[:d, -1] = torch.tensor([s.num_cached for s in seqs])
        new[:d, -1] = 1
        for j, seq in enumerate(fresh, start=d):
            n = seq.num_prompt
            ids[j, width - n:] = torch.tensor(seq.tokens[:n])
            pos[j, width - n:] = torch.arange(n)
            new[j, width - n:] = 1
        old = torch.cat([kv.mask, kv.mask.new_zeros(len(fresh), kv.width)])  # [B, W]
        mask = torch.cat([old, new.to(old.device)], dim=1)  # [B, W + C]
        if self.experts is not None:  # pads are not routed traffic
            self.experts.token_mask = new.reshape(-1).bool()  # type: ignore[assignment]
        try:
            logits, cache = self.run([s.adapter for s in seqs + fresh], compiled=width > 1, input_ids=ids,
                                      attention_mask=mask, position_ids=pos, cache=kv.with_empty_rows(len(fresh)),
                                      logits_to_keep=1)
        finally:
            if self.experts is not None:
                self.experts.token_mask = None
        return logits[:, -1].float(), cache, mask

    def _mixed_matches(self, kv: KVBatch, fresh: list[Sequence]) -> bool:
        """The mixed forward's logits against the same rows run apart (each prompt alone,
        unpadded); nothing committed, no expert load counted."""
        snap = kv.snapshot()
        seqs = kv.seqs
        with self.experts.uncounted() if self.experts is not None else contextlib.nullcontext():
            try:
                got, _, _ = self._mixed_forward(kv, fresh)
                ids = torch.tensor([[s.tokens[s.num_cached]] for s in seqs])  # [B, 1]
                pos = torch.tensor([[s.num_cached] for s in seqs])  # [B, 1]
                dec, _ = self.run([s.adapter for s in seqs], compiled=True, input_ids=ids,
                                  attention_mask=kv.grow_mask(1), position_ids=pos, cache=kv.cache)
                want = [dec[:, -1].float()]
                for seq in fresh:
                    n = seq.num_prompt
                    out, _ = self.run([seq.adapter], compiled=n > 1, input_ids=torch.tensor([seq.tokens[:n]]),
                                      attention_mask=torch.ones(1, n, dtype=torch.long),
                                      position_ids=torch.arange(n)[None], logits_to_keep=1)
                    want.append(out[:, -1].float())
            finally:
                kv.restore(snap)
        return bool(torch.allclose(got, torch.cat(want), rtol=1e-4, atol=1e-4))

    def prefill_group(self, seqs: list[Sequence]) -> torch.Tensor:
        """Whole prompts of several fresh sequences in one left-padded forward (as `generate`
        batches prompts); the rows then decode together. Returns last-position logits [B, V]."""
        lengths = [s.num_prompt for s in seqs]
        width = max(lengths)
        ids = torch.zeros(len(seqs), width, dtype=torch.long)  # [B, C]; pads are masked out
        mask = torch.zeros(len(seqs), width, dtype=torch.long)  # [B, C]
        for i, seq in enumerate(seqs):
            ids[i, width - lengths[i]:] = torch.tensor(seq.tokens[:seq.num_prompt])
            mask[i, width - lengths[i]:] = 1
        pos = (mask.cumsum(dim=1) - 1).clamp(min=0)  # [B, C]
        if self.experts is not None:
            # pads are not routed traffic (ExpertLoad declares token_mask with its None default only)
            self.experts.token_mask = mask.reshape(-1).bool()  # type: ignore[assignment]
        try:
            logits, cache = self.run([s.adapter for s in seqs], compiled=width > 1, input_ids=ids,
                                      attention_mask=mask, position_ids=pos, logits_to_keep=1)
        finally:
            if self.experts is not None:
                self.experts.token_mask = None
        kv = KVBatch(cache, mask.to(self.device), seqs, mergeable=True).compact()
        for seq in seqs:
            seq.kv, seq.num_cached = kv, seq.num_prompt
        return logits[:, -1].float()  # [B, V]

    def packed(self, rows: list[tuple[Sequence, int]], tables: list[list[int]], block_size: int,
               cache: "PagedCache") -> tuple[torch.Tensor, list[int | None]]:
        """One forward of every row's next `n` tokens packed side by side over the paged cache
        (paged.py: no padding between rows, decodes and prompt chunks together); mixed adapters
        while LoRA is batched, else one. Until the forward succeeded nothing of a sequence changes
        (its keys and values go to its own slots, which a re-run writes again); then its prompt
        logprobs are recorded.

        Args:
            rows: (sequence, new tokens) in pack order.
            tables: per row, its blocks (block_pool.py), enough for its new tokens.

        Returns:
            the kept logits [K, V] (float32) and, per row, the index there of its last new token's
            when that ends what it had to compute (a token is sampled), else None; prompt logprobs
            are recorded on the way. The logits are made in inference mode (below): read them, or
            copy them before changing them.
        """
        ids: list[int] = []
        pos: list[int] = []
        layout_rows: list[Row] = []
        keep: list[int] = []
        spans: list[tuple[int, int, bool]] = []
        slot = self._batched.slot if self.lora_mode() == "batched" and self._batched is not None else {}
        order = sorted(range(len(rows)), key=lambda i: slot.get(rows[i][0].adapter or "", 0))  # one LoRA run each
        rows, tables = [rows[i] for i in order], [tables[i] for i in order]
        for (seq, n), blocks in zip(rows, tables):
            c, t = seq.num_cached, len(ids)
            ids += seq.tokens[c:c + n]
            pos += range(c, c + n)
            layout_rows.append(Row(t, n, c, blocks, id(seq)))
            first, echo = len(keep), seq.params.prompt_logprobs is not None and c < seq.num_prompt
            if echo:
                keep += range(t, t + n)
            elif c + n == len(seq.tokens):
                keep.append(t + n - 1)
            spans.append((first, len(keep), echo))
        layout = StepLayout(layout_rows, block_size, cache.pad, self.device, cache.memo, cache.view,
                            cache.slot_bytes if cache.view is not None else 0, len(cache.keys))
        to_keep: Any = 0 if len(keep) == len(ids) else torch.tensor(keep) if keep else 1  # 0: all (no index)
        # inference mode, as vLLM's model runner: the forward's tensors carry no version counters
        # or autograd metadata (benchmarks/bench_inference_mode.py: a median 10% of the engine's CPU
        # per round on the demo model). Not where PEFT applies the adapters itself (it toggles
        # requires_grad as it switches them); the caller copies before changing the logits in
        # place (sampling.penalise), as inference tensors need.
        inference = self.inference_mode and self.lora_mode() != "peft"
        eager = torch.inference_mode() if inference else contextlib.nullcontext()
        with cache.step(self.base, layout), eager:
            logits, _ = self.run([s.adapter for s, _ in rows], counts=[n for _, n in rows],
                                 input_ids=torch.tensor([ids]), position_ids=torch.tensor([pos]),
                                 cache=cache, moeflow_cache=cache, logits_to_keep=to_keep)
        logits = logits[0].float()  # [K, V]
        out: list[int | None] = [None] * len(rows)
        for i, (seq, n), (a, b, echo) in zip(order, rows, spans):
            if b == a:
                continue
            if echo:  # prompt logprobs: every position of the chunk
                if seq.num_cached == 0:
                    seq.prompt_lp.clear()  # a preempted sequence computes its prompt again
                self._record_prompt_logprobs(seq, logits[a:b], seq.num_cached, n)
            out[i] = b - 1 if seq.num_cached + n == len(seq.tokens) else None
        return logits, out  # `out` in the caller's row order

    def prefill_chunk(self, seq: Sequence, n: int) -> torch.Tensor | None:
        """Prefill `n` more prompt tokens of one sequence; last-position logits [V] when done."""
        start = seq.num_cached
        ids = torch.tensor([seq.tokens[start:start + n]])  # [1, C]
        pos = torch.arange(start, start + n).unsqueeze(0)  # [1, C]
        kv = seq.kv
        mask = kv.grow_mask(n) if kv is not None else torch.ones(1, n, dtype=torch.long)  # [1, W + C]
        extra: dict[str, Any] = {}
        if seq.image is not None:  # pixels of the images in this chunk, M-RoPE positions
            extra = seq.image.inputs(start, start + n)
            if seq.image.positions is not None:
                pos = seq.image.positions[:, start:start + n].unsqueeze(1)  # [3, 1, C]
        if seq.params.prompt_logprobs is None:  # only the last position is sampled: lm_head on it alone
            extra["logits_to_keep"] = 1  # logits [1, 1, V] instead of [1, C, V]
        if kv is not None:
            extra["cache"] = kv.cache  # else the model builds its own kind of cache
        # a plain prompt's first chunk (no cache yet) is of a compiled kind; later chunks (a cache),
        # images, prompt logprobs are not
        first = kv is None and n > 1 and set(extra) == {"logits_to_keep"}
        logits, cache = self.run([seq.adapter], compiled=first, input_ids=ids, attention_mask=mask, position_ids=pos,
                                 **extra)
        mask = mask.to(self.device)
        if kv is None:
            self.kv_batchable = batchable(cache)  # learnt from the cache the model itself built
            seq.kv = KVBatch(cache, mask, [seq], mergeable=self.kv_batchable).compact()
        else:
            kv.cache, kv.mask = cache, mask
        seq.num_cached += n
        if seq.params.prompt_logprobs is not None:
            self._record_prompt_logprobs(seq, logits[0].float(), start, n)
        return logits[0, -1].float() if seq.num_cached == seq.num_prompt else None

    def _record_prompt_logprobs(self, seq: Sequence, logits: torch.Tensor, start: int, n: int) -> None:
        """Logprob of each prompt token given its prefix (echo=True); first token has none."""
        if start == 0:
            seq.prompt_lp.append((seq.tokens[0], None, []))
        lp = torch.log_softmax(logits, dim=-1)  # [C, V]
        k = seq.params.prompt_logprobs or 0
        for j in range(n):
            pos = start + j + 1  # logits at j predict token start+j+1
            if pos >= seq.num_prompt:
                break
            tok = seq.tokens[pos]
            seq.prompt_lp.append((tok, lp[j, tok].item(), topk(lp[j], k)))


def _compilable_experts(model: Any) -> None:
    """Compiled forwards (deploy.compile): experts that compute with transformers' `grouped_mm`
    compute with `SPLIT_IMPL` instead -- with no adapter active the same forward, but its grouped
    GEMM compiles on CPU in float32, where transformers' runs a Python loop per expert
    (moeflow/model/grouped_gemm.py). The switch holds for eager forwards too: with one expert adapter
    active they compute it split, which gives PEFT's results (tests/test_split_lora.py).
    Measured on the demo model's compiled round of 16 x 32 tokens: 34.5 ms against 38.4-39.4 ms."""
    from moeflow.model.split_lora import SPLIT_IMPL  # registers it with transformers (imports peft)

    text = model.config.get_text_config()
    if (getattr(text, "_experts_implementation", None) == "grouped_mm"
            and model._can_set_experts_implementation()):
        model.set_experts_implementation(SPLIT_IMPL)
