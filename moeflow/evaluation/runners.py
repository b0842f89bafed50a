"""Runners: turn task records into raw model outputs (log-likelihoods, generations).

Two runners share one small interface (lm-eval's LM API, trimmed):
`loglikelihood(pairs)`, `generate(prompts, max_new_tokens, stop)`, and
`image_choice_logliks(record)` where `multimodal` is True.

- `HFRunner`: in process, a transformers checkpoint (+ PEFT adapters), loaded
  with moeflow.model.models' class rule, the one finetune used (so its adapter
  loads): image-text for Qwen3-VL-MoE / ERNIE-4.5-VL (multimodal tasks run,
  through the model's own processor), the text model for Llama-4 and text
  families (multimodal tasks are skipped, saying why). The
  suite is sharded over Ray tasks by `evaluate`: shard s takes records
  s, s+N, s+2N, ... of every task, loads the model once, evaluates the base
  and then each adapter, and returns raw outputs that the driver merges back
  into record order and scores.
- `EndpointRunner` (in `endpoint.py`): a deployed OpenAI-compatible server.

Which tasks a model runs is `runnable.py`'s; the result record (`assemble`, `flat_metrics`)
is `record.py`'s.

Determinism: eval mode, greedy decoding, fixed seeds, and batches formed in a
fixed order (by length, ties by index), so the same inputs and settings give
bit-identical metrics.
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Any, Iterator

from moeflow.core.devices import gpus_per_worker, local_device, to_device
from moeflow.core.errors import UserError
from moeflow.evaluation.record import TOPK, assemble
from moeflow.evaluation.runnable import processor_problem, runnable_tasks
from moeflow.evaluation.suite import Suite, Task
from moeflow.model.models import is_image_text, load_model, text_only_reason

_TOKEN_KEYS = ("token_logprobs", "top_ids", "top_logprobs")


class HFRunner:
    """A transformers checkpoint evaluated in this process.

    `text_only`: None (images reach an image-text model); a runner that runs no image
    task says why here.

    Args:
        model_dir: HF checkpoint dir (safetensors only; never trust_remote_code).
        dtype: compute dtype name ("float32" is the default for exact metrics).
        batch_size: requests per forward pass.
        experts_implementation: transformers experts kernel (eager | grouped_mm | batched_mm:
            the operators stage's serving choice); None keeps transformers' default. Families
            without the switch ignore it.
    """

    text_only: str | None = None

    def __init__(self, model_dir: str | Path, dtype: str = "float32", batch_size: int = 16,
                 experts_implementation: str | None = None):
        # lazy: torch, transformers: heavy, loaded only when this runs
        import torch
        import transformers


        self.model_dir = str(model_dir)
        self.batch_size = batch_size
        try:
            self.model = load_model(self.model_dir, getattr(torch, dtype)).eval()
            self.model.to(local_device())  # the GPU Ray gave this shard, else CPU
            import moeflow.model.split_lora  # noqa: F401  registers SPLIT_IMPL with transformers (imports peft)
            if experts_implementation and self.model._can_set_experts_implementation():
                self.model.set_experts_implementation(experts_implementation)
            self.tokenizer = transformers.AutoTokenizer.from_pretrained(self.model_dir)
        except (OSError, ValueError) as exc:
            raise UserError(f"cannot load model {self.model_dir}: "
                            f"{str(exc).splitlines()[0]}") from None
        self.multimodal = is_image_text(self.model)
        self._processor = None  # built on the first image: text tasks never need it
        self.adapters: list[str] = []

    # ------------------------------------------------------------ adapters

    def attach_adapter(self, adapter_dir: str | Path) -> None:
        """Load a PEFT adapter and make it the active one."""
        from peft import PeftModel

        from moeflow.model.split_lora import enable_split_lora  # imports peft: only with adapters

        adapter_dir = Path(adapter_dir)
        if not (adapter_dir / "adapter_config.json").is_file():
            raise UserError(f"not a PEFT adapter dir (no adapter_config.json): {adapter_dir}")
        name = f"eval{len(self.adapters)}"
        # onto the model's device: PEFT's default is "cuda" whenever torch sees a GPU, which
        # a Ray task without one does on a GPU host (Ray no longer hides GPUs from num_gpus=0)
        device = str(self.model.device)
        if not self.adapters:
            self.model = PeftModel.from_pretrained(self.model, str(adapter_dir),
                                                   adapter_name=name, torch_device=device).eval()
        else:
            self.model.load_adapter(str(adapter_dir), adapter_name=name, torch_device=device)
            self.model.set_adapter(name)
        enable_split_lora(self.model)  # expert LoRA computes split under SPLIT_IMPL
        self.adapters.append(name)

    def base_only(self):
        """Context in which the base model runs, with every loaded adapter disabled."""
        return self.model.disable_adapter() if self.adapters else nullcontext()

    # ------------------------------------------------------------ text

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Token ids of context and continuation, as the whole string tokenises.

        Why whole-then-split (lm-eval's way): a server tokenises the joined
        text, so splitting the joint encoding keeps both runners aligned; if
        the context's own encoding is not a prefix, fall back to separate ones.
        """
        tok = self.tokenizer
        cont_only = tok(continuation, add_special_tokens=False).input_ids
        if not context:
            prefix = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
            return [prefix], cont_only
        ctx = tok(context, add_special_tokens=False).input_ids
        whole = tok(context + continuation, add_special_tokens=False).input_ids
        if whole[:len(ctx)] == ctx and len(whole) > len(ctx):
            return ctx, whole[len(ctx):]
        return ctx, cont_only

    def loglikelihood(self, pairs: list[tuple[str, str]]) -> list[tuple[float, int]]:
        """Sum of log p(continuation | context) per pair, and its token count."""
        return [(d["loglik"], d["n_tokens"]) for d in self.loglikelihood_detail(pairs)]

    def loglikelihood_detail(self, pairs: list[tuple[str, str]], topk: int = TOPK) -> list[dict]:
        """Per pair: summed log-likelihood, token count, and per scored token its
        log-prob and the model's top-k (ids, log-probs): what output agreement compares.

        Returns:
            [{"loglik", "n_tokens", "token_logprobs": [C], "top_ids": [C][k],
              "top_logprobs": [C][k]}] in pair order.
        """
        # lazy: torch: heavy, loaded only when this runs
        import torch

        encoded = [self._encode_pair(c, x) for c, x in pairs]
        limit = self._max_positions()
        for (_ctx, cont), (_c_ids, x_ids) in zip(pairs, encoded):
            if len(x_ids) >= limit:  # no context left to condition on
                raise UserError(f"a scored text of {len(x_ids)} tokens exceeds the model's "
                                f"{limit} positions: {cont[:60]!r}")
        out: list[dict] = [{}] * len(pairs)
        order = sorted(range(len(pairs)), key=lambda i: (-sum(map(len, encoded[i])), i))
        batches = []
        for start in range(0, len(order), self.batch_size):
            idx = order[start:start + self.batch_size]
            seqs = [(encoded[i][0] + encoded[i][1])[-limit:] for i in idx]
            width = max(map(len, seqs))
            pad = self.tokenizer.pad_token_id or 0
            ids = torch.tensor([s + [pad] * (width - len(s)) for s in seqs])  # [B, T]
            mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])  # [B, T]
            batches.append((idx, seqs, ids, mask))
        every = self._batch_logits([(ids, mask) for _, _, ids, mask in batches])  # [B, T, V] each
        for (idx, seqs, ids, _mask), logits in zip(batches, every):
            for row, i in enumerate(idx):
                n_cont, n = len(encoded[i][1]), len(seqs[row])
                target = ids[row, n - n_cont:n]  # [C]
                logp = torch.log_softmax(logits[row, n - n_cont - 1:n - 1].float(), -1)  # [C, V]
                tok = logp.gather(-1, target[:, None])[:, 0]  # [C]
                top = logp.topk(min(topk, logp.shape[-1]), dim=-1)  # [C, k]
                out[i] = {"loglik": float(tok.sum()), "n_tokens": n_cont,
                          "token_logprobs": tok.tolist(), "top_ids": top.indices.tolist(),
                          "top_logprobs": top.values.tolist()}
        return out

    def generate(self, prompts: list[str], max_new_tokens: int, stop: list[str]) -> list[str]:
        """Greedy continuations (stop strings are applied by the scorer)."""
        return [d["output"] for d in self.generate_detail(prompts, max_new_tokens)]

    def generate_detail(self, prompts: list[str], max_new_tokens: int,
                        topk: int = TOPK) -> list[dict]:
        """Greedy continuations, their token ids (EOS and padding dropped), and per decoding
        step the chosen token (the stopping EOS included) and the model's top-k there: what
        the tie-aware agreement of moeflow.evaluation.paired compares.

        Returns:
            [{"output": str, "output_ids": [int], "step_ids": [S], "step_top_ids": [S][k],
              "step_top_logprobs": [S][k]}] in prompt order.
        """
        # lazy: torch: heavy, loaded only when this runs
        import torch

        tok = self.tokenizer
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        out: list[dict] = [{}] * len(prompts)
        encoded = [tok(p, add_special_tokens=False).input_ids for p in prompts]
        order = sorted(range(len(prompts)), key=lambda i: (-len(encoded[i]), i))
        batches = []
        for start in range(0, len(order), self.batch_size):
            idx = order[start:start + self.batch_size]
            width = max(len(encoded[i]) for i in idx)
            # left padding: every row's next token sits at the same position
            ids = torch.tensor([[pad] * (width - len(encoded[i])) + encoded[i] for i in idx])
            mask = torch.tensor([[0] * (width - len(encoded[i])) + [1] * len(encoded[i])
                                 for i in idx])  # [B, T]
            batches.append((idx, width, ids, mask))
        greedy = self._greedy([(ids, mask) for _, _, ids, mask in batches], max_new_tokens, pad)
        for (idx, width, _ids, _mask), (seqs, logits) in zip(batches, greedy):  # [B, T + S], [B, S, V]
            logp = torch.log_softmax(logits.float(), -1).cpu()  # [B, S, V]
            top = logp.topk(min(topk, logp.shape[-1]), dim=-1)  # [B, S, k]
            for row, i in enumerate(idx):
                steps = seqs[row, width:].tolist()
                new = steps
                if tok.eos_token_id in new:  # what follows EOS is padding
                    new = new[:new.index(tok.eos_token_id)]
                    steps = new + [tok.eos_token_id]
                n = len(steps)
                out[i] = {"output": tok.decode(seqs[row, width:], skip_special_tokens=True),
                          "output_ids": new, "step_ids": steps,
                          "step_top_ids": top.indices[row, :n].tolist(),
                          "step_top_logprobs": top.values[row, :n].tolist()}
        return out

    def _max_positions(self) -> int:
        return getattr(self.model.config.get_text_config(), "max_position_embeddings", None) or 1 << 30

    def _batch_logits(self, batches: list[tuple]) -> Iterator:
        """Logits [B, T, V] (on CPU) of each (input ids [B, T], attention mask [B, T]), yielded
        one batch at a time (a batch's logits are the largest tensor here)."""
        # lazy: torch: heavy, loaded only when this runs
        import torch

        for ids, mask in batches:
            with torch.no_grad():
                yield self.model(input_ids=ids.to(self.model.device),
                                 attention_mask=mask.to(self.model.device)).logits.cpu()

    def _greedy(self, batches: list[tuple], max_new_tokens: int, pad: int) -> Iterator:
        """Greedy decoding of each left-padded (ids, mask): (sequences [B, T + S], logits [B, S, V])."""
        # lazy: torch: heavy, loaded only when this runs
        import torch

        for ids, mask in batches:
            with torch.no_grad():
                gen = self.model.generate(
                    input_ids=ids.to(self.model.device), attention_mask=mask.to(self.model.device),
                    max_new_tokens=max_new_tokens,
                    do_sample=False, temperature=None, top_p=None, top_k=None,
                    pad_token_id=pad, eos_token_id=self.tokenizer.eos_token_id,
                    return_dict_in_generate=True, output_logits=True)
            yield gen.sequences, torch.stack(gen.logits, 1)

    # ------------------------------------------------------------ images

    @property
    def processor(self):
        """The model's own processor, images only (moeflow.model.multimodal.load_processor)."""
        if self._processor is None:
            # lazy: loads torch, which importing this module does not
            from moeflow.model.multimodal import load_processor

            self._processor = load_processor(self.model_dir, self.tokenizer)
        return self._processor

    def _image_prompt(self, image, question: str) -> dict:
        """Model inputs [1, T] for <image><question>, built by the model's processor.

        The prompt is the image placeholder the processor expands (Qwen-VL:
        vision_start, image pad, vision_end; ERNIE-VL: IMAGE_START,
        IMAGE_PLACEHOLDER, IMAGE_END) followed by the question, no chat
        template. The processor returns ids, pixels, grids and the per-token
        modality ids the model needs (`mm_token_type_ids` for M-RoPE, and
        ERNIE-VL's `moe_mm_token_type_ids`, which routes image tokens to its
        vision experts).
        """
        proc = self.processor
        start = getattr(proc, "vision_start_token", None) or getattr(proc, "image_start_token", "")
        end = getattr(proc, "vision_end_token", None) or getattr(proc, "image_end_token", "")
        enc = proc(text=[f"{start}{proc.image_token}{end}{question}"], images=[image],
                   return_tensors="pt")
        return dict(enc)

    def image_choice_logliks(self, record: dict) -> list[float]:
        """log p(choice | image, question) for every choice of a multimodal record."""
        # lazy: PIL, torch: heavy, loaded only when this runs
        import torch
        from PIL import Image


        try:
            with Image.open(record["image_path"]) as img:
                image = img.convert("RGB")
        except (OSError, ValueError) as exc:  # PIL.UnidentifiedImageError is an OSError
            raise UserError(f"image {record['image_path']}: cannot read it: "
                            f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") \
                from None
        if not self.multimodal:  # evaluate() skips these tasks; a direct call says why
            raise UserError(f"{self.model_dir}: multimodal task on a model loaded without "
                            f"a vision tower ({type(self.model).__name__})")
        prompt = self._image_prompt(image, record["question"])
        n = prompt["input_ids"].shape[1]  # T
        scores = []
        for choice in record["choices"]:
            cont = self.tokenizer(choice, add_special_tokens=False).input_ids
            inputs = dict(prompt)
            for key, value in prompt.items():  # per-token inputs [1, T] -> [1, T + C]
                if key in ("input_ids", "attention_mask") or key.endswith("token_type_ids"):
                    tail = (torch.tensor([cont]) if key == "input_ids" else
                            torch.full((1, len(cont)), int(key == "attention_mask")))
                    inputs[key] = torch.cat([value, tail.to(value.dtype)], 1)  # text: type 0
            with torch.no_grad():
                logits = self.model(**to_device(inputs, self.model.device)).logits[0, n - 1:-1].float().cpu()  # [C, V]
            target = torch.tensor(cont)[:, None]  # [C, 1]
            scores.append(float(torch.log_softmax(logits, -1).gather(-1, target).sum()))
        return scores


# ---------------------------------------------------------------- dispatch


def task_outputs(runner: Any, task: Task, records: list[dict]) -> list[dict]:
    """Raw outputs of `runner` for some records of `task` (scoring.py's input).

    A runner with `loglikelihood_detail` / `generate_detail` (HFRunner) also
    returns per-token outputs (top-k log-probs, greedy token ids), which the
    result records for output agreement; an endpoint runner returns scores only.
    """
    kind, spec = task.spec.type, task.spec
    detail = hasattr(runner, "loglikelihood_detail")
    if kind in ("multiple_choice", "multimodal") and not records:
        return []
    if kind == "multiple_choice":
        pairs = [(r["context"], c) for r in records for c in r["choices"]]
        if not detail:
            lls = iter(ll for ll, _ in runner.loglikelihood(pairs))
            return [{"logliks": [next(lls) for _ in r["choices"]]} for r in records]
        found = iter(runner.loglikelihood_detail(pairs))
        out = []
        for r in records:  # one sample's positions: every choice's tokens, in choice order
            per = [next(found) for _ in r["choices"]]
            out.append({"logliks": [d["loglik"] for d in per],
                        **{k: [x for d in per for x in d[k]] for k in _TOKEN_KEYS}})
        return out
    if kind == "multimodal":
        return [{"logliks": runner.image_choice_logliks(r)} for r in records]
    if kind == "generation":
        if detail:
            return runner.generate_detail([r["prompt"] for r in records], spec.max_new_tokens)
        outs = runner.generate([r["prompt"] for r in records], spec.max_new_tokens, spec.stop)
        return [{"output": o} for o in outs]
    pairs = [(r["prompt"], r["completion"]) for r in records]
    if detail:
        return runner.loglikelihood_detail(pairs)
    return [{"loglik": ll, "n_tokens": n} for ll, n in runner.loglikelihood(pairs)]


def eval_shard(model_dir: str, adapters: list[str | None], tasks: list[Task], shard: int,
               num_shards: int, dtype: str, batch_size: int, seed: int,
               experts_implementation: str | None = None, runner_cls: type | None = None) -> list[dict]:
    """Evaluate records shard, shard+N, ... of every task, for base then each adapter;
    `runner_cls`: another runner of HFRunner's interface (e.g. moeflow.evaluation.
    streamed_runner.StreamedRunner: the layer-streamed forward) built as runner_cls(model_dir,
    dtype=, batch_size=).

    Returns:
        One dict per entry of `adapters`: task name -> raw outputs of this shard.
    """
    # lazy: torch: heavy, loaded only when this runs
    import torch

    torch.manual_seed(seed)
    if runner_cls is not None and runner_cls is not HFRunner:
        runner: HFRunner = runner_cls(model_dir, dtype=dtype, batch_size=batch_size)
    else:
        runner = HFRunner(model_dir, dtype=dtype, batch_size=batch_size,
                          experts_implementation=experts_implementation)
    results = []
    for adapter in adapters:
        if adapter is not None:
            runner.attach_adapter(adapter)
        # None is the base: adapters loaded for earlier entries must not apply to it
        with runner.base_only() if adapter is None else nullcontext():
            results.append({t.name: task_outputs(runner, t, t.records[shard::num_shards])
                            for t in tasks})
    close = getattr(runner, "close", None)  # a runner with workers of its own (layer ranges) stops them
    if close is not None:
        close()
    return results


def _ray_eval_shard(*args, **kwargs):
    # lazy: torch: heavy, loaded only when this runs
    import torch

    torch.set_num_threads(1)  # one CPU per shard task; no oversubscription
    return eval_shard(*args, **kwargs)


def evaluate(suite: Suite, model_dir: str | Path, adapters: list[str | None] | None = None, *,
             shards: int = 1, dtype: str = "float32", batch_size: int = 16,
             seed: int = 0, experts_implementation: str | None = None,
             runner_cls: type | None = None) -> list[dict]:
    """Evaluate a model (base, then each adapter) on a suite, in process or over Ray.

    Args:
        suite: the loaded suite.
        model_dir: base checkpoint.
        adapters: entries evaluated in order; None is the base itself. Default [None].
        shards: Ray tasks to split the records over; 1 runs here, without Ray.
        dtype, batch_size, seed: runner settings (part of the result).
        experts_implementation: transformers experts kernel to evaluate with (None: its default).
        runner_cls: another runner of HFRunner's interface (`eval_shard`); one with a
            `text_only` reason runs no image task (the streamed one: moeflow.evaluation.
            streamed_runner, whose experts kernel is transformers' default).

    Returns:
        One result dict per adapter entry (see `assemble`).
    """

    adapters = [None] if adapters is None else list(adapters)
    why = getattr(runner_cls, "text_only", None) or text_only_reason(model_dir)
    if why is None and any(t.spec.type == "multimodal" for t in suite.tasks):
        why = processor_problem(model_dir)  # None: images reach the model
    tasks, skipped = runnable_tasks(suite, why is None, why or "")
    args = (str(model_dir), adapters, tasks)
    if shards <= 1:
        parts = [eval_shard(*args, 0, 1, dtype, batch_size, seed, experts_implementation, runner_cls)]
    else:
        # lazy: ray: heavy, loaded only when this runs
        import ray

        if not ray.is_initialized():
            raise RuntimeError("evaluate(shards>1) needs Ray: call ray.init() first")

        remote = ray.remote(num_cpus=1, num_gpus=gpus_per_worker(), max_retries=1)(_ray_eval_shard)
        parts = ray.get([remote.remote(*args, s, shards, dtype, batch_size, seed, experts_implementation,
                                       runner_cls) for s in range(shards)])
    settings = {"dtype": dtype, "batch_size": batch_size, "seed": seed, "shards": shards,
                "experts_implementation": experts_implementation or "default"}
    if getattr(runner_cls, "text_only", None):  # its kernel is transformers' default
        settings["experts_implementation"] = "default"
    results = []
    for v, adapter in enumerate(adapters):
        raw = {t.name: _merge([p[v][t.name] for p in parts], len(t.records)) for t in tasks}
        results.append(assemble(suite, raw, skipped, model=str(model_dir), adapter=adapter,
                                settings=settings))
    return results


def _merge(shard_outputs: list[list[dict]], n: int) -> list[dict]:
    """Interleave strided shard outputs back into record order."""
    merged: list[dict] = [{}] * n
    for s, outs in enumerate(shard_outputs):
        merged[s::len(shard_outputs)] = outs
    return merged
