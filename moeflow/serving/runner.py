"""The model side of the engine: adapters in PEFT, LoRA modes, forwards over per-sequence KV caches.

`ModelRunner` is a mixin of `Engine` (engine.py): it owns `base`, `peft` and
the batched-LoRA state, and runs decode batches (left-padded caches, pads
masked out) and prefill chunks. Nothing here changes a sequence before its
forward succeeded, so the engine may re-run a failed batch row by row.

Axis legend: B rows, L cached tokens, C new tokens, V vocab, H kv heads, D head dim.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from moeflow.devices import to_device
from moeflow.serving.adapters import BASE, AdapterSpec, check_compatible
from moeflow.serving.sampling import topk

log = logging.getLogger("moeflow.serving")


class ModelRunner:
    """Forward passes and adapter residency (mixed into Engine; the engine thread only)."""

    def _load_adapter(self, spec: AdapterSpec) -> None:
        from peft import PeftModel

        check_compatible(spec.path, self.base)
        self._release_batched()
        if self.peft is None:
            self.peft = PeftModel.from_pretrained(self.base, spec.path, adapter_name=spec.name)
        else:
            self.peft.load_adapter(spec.path, adapter_name=spec.name)
        self.peft.eval()
        log.info("loaded adapter %s from %s", spec.name, spec.path)

    def _unload_adapter(self, name: str) -> None:
        self._release_batched()
        if list(self.peft.peft_config) == [name]:
            # PEFT cannot hold zero adapters cleanly: strip the LoRA layers (no merge)
            self.base = self.peft.unload()
            self.peft = None
        else:
            self.peft.delete_adapter(name)
        log.info("evicted adapter %s", name)

    def _release_batched(self) -> None:
        """Give LoRA layers back to PEFT before the adapter set changes."""
        if self._batched is not None:
            self._batched.close(self.peft)
            self._batched = None
        self._lora_dirty = True

    def _lora_mode(self) -> str:
        """none (no PEFT), batched (per-row gather LoRA) or peft (per-adapter forwards)."""
        if self.peft is None:
            return "none"
        if self._lora_dirty:
            from moeflow.serving.lora_batch import BatchedLora, supported

            mixable = all(not getattr(c, "target_parameters", None) for c in self.peft.peft_config.values())
            if mixable and supported(self.peft):
                self._batched = BatchedLora(self.peft, list(self.peft.peft_config))
            self._lora_dirty = False
        return "batched" if self._batched is not None else "peft"

    def _run(self, adapters: list[str | None], **inputs) -> Any:
        """Forward rows that may use different adapters; returns (logits [B, C, V], cache)."""
        mode = self._lora_mode()
        inputs = to_device(inputs, self.device)
        if mode == "none":
            out = self.base(**inputs, use_cache=True)
        elif mode == "batched":
            self._batched.rows = torch.tensor([self._batched.slot[a] if a else 0 for a in adapters],
                                              device=self.device)  # [B]
            try:
                out = self.peft.base_model.model(**inputs, use_cache=True)
            finally:
                self._batched.rows = None
        else:  # expert LoRA resident: PEFT cannot mix, the caller groups rows by adapter
            names = {a or BASE for a in adapters}
            assert len(names) == 1, "per-adapter forwards take one adapter at a time"
            out = self._run_single(names.pop(), inputs)
        return out.logits, out.cache

    def _run_single(self, name: str, inputs: dict) -> Any:
        if name == BASE:
            with self.peft.disable_adapter():
                return self.peft(**inputs, use_cache=True)
        self.peft.set_adapter(name)
        return self.peft(**inputs, use_cache=True)

    def _decode_batch(self, seqs: list) -> torch.Tensor:
        lengths = [s.num_cached for s in seqs]
        width = max(lengths)
        layers = []
        for layer in range(len(seqs[0].kv)):
            ks, vs = [], []
            for seq in seqs:
                k, v = seq.kv[layer]  # [1, H, L, D]
                pad = width - k.shape[2]
                ks.append(torch.nn.functional.pad(k, (0, 0, pad, 0)))  # left pad: [1, H, W, D]
                vs.append(torch.nn.functional.pad(v, (0, 0, pad, 0)))
            layers.append((torch.cat(ks), torch.cat(vs)))  # [B, H, W, D]
        mask = torch.zeros(len(seqs), width + 1, dtype=torch.long)  # [B, W+1]
        for i, n in enumerate(lengths):
            mask[i, width - n:] = 1
        ids = torch.tensor([[s.tokens[s.num_cached]] for s in seqs])  # [B, 1]
        pos = torch.tensor([[n] for n in lengths])  # [B, 1]
        deltas = [s.image.rope_delta if s.image is not None else 0 for s in seqs]
        if any(deltas):  # M-RoPE: generated tokens continue after the image's positions
            pos = (pos + torch.tensor(deltas)[:, None]).unsqueeze(0).expand(3, -1, -1)  # [3, B, 1]
        cache = self._cache(layers)
        logits, cache = self._run([s.adapter for s in seqs], input_ids=ids, attention_mask=mask,
                                  position_ids=pos, cache=cache)
        new = [(layer.keys, layer.values) for layer in cache.layers]  # [B, H, W+1 or window, D]
        for i, seq in enumerate(seqs):
            # keep the row's own tokens; a sliding-window layer holds at most its window
            seq.kv = [(k[i:i + 1, :, -min(lengths[i] + 1, k.shape[2]):],
                       v[i:i + 1, :, -min(lengths[i] + 1, v.shape[2]):]) for k, v in new]
            seq.num_cached += 1
        return logits[:, -1].float()  # [B, V]

    def _cache(self, layers):
        from transformers import DynamicCache

        return DynamicCache(ddp_cache_data=layers, config=self.base.config)

    def _forward_prefill(self, seq, n: int) -> torch.Tensor | None:
        """Prefill `n` more prompt tokens of one sequence; last-position logits [V] when done."""
        start = seq.num_cached
        ids = torch.tensor([seq.tokens[start:start + n]])  # [1, C]
        pos = torch.arange(start, start + n).unsqueeze(0)  # [1, C]
        mask = torch.ones(1, start + n, dtype=torch.long)  # [1, L+C]
        cache = self._cache(seq.kv) if seq.kv else self._cache(None)
        extra = {}
        if seq.image is not None:  # pixels of the images in this chunk, M-RoPE positions
            extra = seq.image.inputs(start, start + n)
            if seq.image.positions is not None:
                pos = seq.image.positions[:, start:start + n].unsqueeze(1)  # [3, 1, C]
        if seq.params.prompt_logprobs is None:  # only the last position is sampled: lm_head on it alone
            extra["logits_to_keep"] = 1  # logits [1, 1, V] instead of [1, C, V]
        logits, cache = self._run([seq.adapter], input_ids=ids, attention_mask=mask,
                                  position_ids=pos, cache=cache, **extra)
        seq.kv = [(layer.keys, layer.values) for layer in cache.layers]  # [1, H, L+C, D]
        seq.num_cached += n
        if seq.params.prompt_logprobs is not None:
            self._record_prompt_logprobs(seq, logits[0].float(), start, n)
        return logits[0, -1].float() if seq.num_cached == seq.num_prompt else None

    def _record_prompt_logprobs(self, seq, logits: torch.Tensor, start: int, n: int) -> None:
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


def _length_buckets(idx: list[int], lengths: list[int]) -> list[list[int]]:
    """Split decode rows so no row is left-padded to more than ~2x its own cache.

    Without this one long-context sequence would pad every short one in the
    batch to its length (copies and attention over padding each step).
    """
    order = sorted(range(len(idx)), key=lambda j: -lengths[j])
    buckets: list[list[int]] = []
    top = None
    for j in order:
        if top is None or top > 2 * lengths[j] + 64:
            buckets.append([])
            top = lengths[j]
        buckets[-1].append(idx[j])
    return buckets
