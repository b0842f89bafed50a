"""`StreamedRunner`: HFRunner's log-likelihoods and greedy generations through the
layer-streamed forward (moeflow.quant.streamed), for a model larger than a device.

    runner = StreamedRunner("converted/")
    runner.attach_adapter("adapter/")
    runner.loglikelihood_detail([("2 + 2 =", " 4")])

Memory: the front (embeddings, head), one decoder layer and the batches' hidden states
(moeflow.quant.streamed.StreamedModel), never the model. Every pass is layer-major: all batches
of a call go through layer i before layer i + 1 is read.

Adapters: a PEFT LoRA adapter is applied by PEFT itself (`inject_adapter_in_model`,
`set_peft_model_state_dict`) to each decoder layer as it is built -- the layer sits in a
skeleton under its full module path, so the adapter's target names and keys match as on
the whole model -- and to the front once, where the adapter targets modules outside the
layers (e.g. lm_head), switched on and off with PEFT's own tuner-layer switches.

Generation recomputes: each new token runs the whole sequence (prompt and the tokens so
far) through every layer again, with the positions and mask `generate` gives a
left-padded batch. Why not a KV cache carried per layer: the cache of every layer for
every batch is itself model-sized state to keep beside the streamed layer (and a cache
object per layer to thread through transformers' attention), while recomputing needs
nothing but the token ids and gives the same logits within float rounding; the price is
S passes over the checkpoint for S new tokens, which an evaluation's short greedy
continuations (max_new_tokens) afford.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from moeflow.core.errors import UserError
from moeflow.evaluation.runners import HFRunner

if TYPE_CHECKING:
    import torch

_PEFT_PREFIX = "base_model.model."  # what PeftModel.save_pretrained puts before module names


class StreamedRunner(HFRunner):
    """HFRunner's interface over the layer-streamed forward (see the module docstring).

    Args:
        model_dir: checkpoint directory (converted, Hugging Face or compressed-tensors).
        dtype: compute dtype name.
        batch_size: requests per batch (every batch of a call goes through a layer together).
    """

    text_only = "the layer-streamed evaluation runs text tasks only"

    def __init__(self, model_dir: str | Path, dtype: str = "float32", batch_size: int = 16):
        # lazy: torch, transformers: heavy, loaded only when this runs
        import torch
        import transformers

        from moeflow.core.devices import local_device
        from moeflow.core.memmeter import PeakMemory
        from moeflow.quant.streamed import StreamedModel

        self.model_dir = str(model_dir)
        self.batch_size = batch_size
        # this process's peak above its level just before the first tensor is read
        self.meter = PeakMemory(local_device().type)
        try:
            self.streamed = StreamedModel(self.model_dir, getattr(torch, dtype), meter=self.meter)
            self.tokenizer = transformers.AutoTokenizer.from_pretrained(self.model_dir)
        except (OSError, ValueError) as exc:
            raise UserError(f"cannot load model {self.model_dir}: {str(exc).splitlines()[0]}") from None
        self.multimodal = False  # the streamed forward runs text; image tasks are skipped
        self._processor = None
        self.adapters: list[str] = []
        self._loaded: dict[str, tuple] = {}  # adapter name -> (PEFT config, {key: tensor})
        self._active: str | None = None
        self._front_names: set[str] = set()  # adapters injected into the front

    # ------------------------------------------------------------ adapters

    def attach_adapter(self, adapter_dir: str | Path) -> None:
        """Read a PEFT adapter (its config and tensors: small) and make it the active one."""
        # lazy: peft, safetensors: only with adapters
        from peft import PeftConfig
        from safetensors.torch import load_file

        import moeflow.model.split_lora  # noqa: F401  registers SPLIT_IMPL with transformers (imports peft)

        adapter_dir = Path(adapter_dir)
        weights = adapter_dir / "adapter_model.safetensors"
        if not (adapter_dir / "adapter_config.json").is_file() or not weights.is_file():
            raise UserError(f"not a PEFT adapter dir (no adapter_config.json / adapter_model.safetensors): "
                            f"{adapter_dir}")
        name = f"eval{len(self.adapters)}"
        state = {k.removeprefix(_PEFT_PREFIX): v for k, v in load_file(str(weights)).items()}
        self._loaded[name] = (PeftConfig.from_pretrained(str(adapter_dir)), state)
        self.adapters.append(name)
        self._active = name
        prefix = self.streamed.source.layers_prefix + "."
        outer = {k: v for k, v in state.items() if not k.startswith(prefix)}
        if outer:
            front = self.streamed.front
            self._inject(front.model, name, outer)
            front.head = front.model.get_output_embeddings()  # the head PEFT may have wrapped
            self._front_names.add(name)
        self._switch_front()

    @contextmanager
    def base_only(self):
        """Context in which the base model runs, every adapter off."""
        before, self._active = self._active, None
        self._switch_front()
        try:
            yield
        finally:
            self._active = before
            self._switch_front()

    def _inject(self, model: torch.nn.Module, name: str, state: dict) -> None:
        inject_adapter(model, name, self._loaded[name][0], state, self.streamed.dtype, self.model_dir)

    def _switch_front(self) -> None:
        """The front's LoRA layers on for the active adapter, off for the base."""
        on = self._active in self._front_names
        switch_adapters(self.streamed.front.model, self._active if on else None)

    def _adapt_layer(self, i: int, layer: torch.nn.Module) -> list:
        """on_layer hook: the active adapter's LoRA on decoder layer i (when it has any there)."""
        if self._active is None:
            return []
        prefix = self.streamed.layer_prefix(i)
        state = {k: v for k, v in self._loaded[self._active][1].items() if k.startswith(prefix)}
        if state:
            self._inject(skeleton(self.streamed.source.layers_prefix, i, layer), self._active, state)
        return []

    # ------------------------------------------------------------ forward

    def _max_positions(self) -> int:
        config = self.streamed.source.fam.config.get_text_config()
        return getattr(config, "max_position_embeddings", None) or 1 << 30

    def _hidden_states(self, inputs: list[dict]) -> list[torch.Tensor]:
        """The last decoder layer's output [B, T, H] per batch of model inputs, the active
        adapter applied: here each layer read and run in turn (moeflow.evaluation.ranges_runner
        sends them through resident layer ranges instead)."""
        return self.streamed.hidden_states(inputs, on_layer=self._adapt_layer)

    def _batch_logits(self, batches: list[tuple]) -> Iterator:
        inputs = [{"input_ids": ids, "attention_mask": mask} for ids, mask in batches]
        for hidden in self._hidden_states(inputs):
            yield self.streamed.front.logits(hidden)[1].cpu()

    def _greedy(self, batches: list[tuple], max_new_tokens: int, pad: int) -> Iterator:
        # lazy: torch: heavy, loaded only when this runs
        import torch

        eos = self.tokenizer.eos_token_id
        ids = [b[0] for b in batches]
        masks = [b[1] for b in batches]
        width = [x.shape[1] for x in ids]
        logits: list[list] = [[] for _ in batches]
        done = [torch.zeros(x.shape[0], dtype=torch.bool) for x in ids]
        for _ in range(max_new_tokens):
            live = [k for k in range(len(batches)) if not bool(done[k].all())]
            if not live:
                break
            inputs = []
            for k in live:  # the positions generate gives a left-padded batch
                pos = (masks[k].long().cumsum(-1) - 1).masked_fill(masks[k] == 0, 0)
                inputs.append({"input_ids": ids[k], "attention_mask": masks[k], "position_ids": pos})
            hidden = self._hidden_states(inputs)
            for k, h in zip(live, hidden):
                last = self.streamed.front.logits(h[:, -1:])[1][:, -1].cpu()  # [B, V]
                logits[k].append(last)
                nxt = last.argmax(-1)
                if eos is not None:  # a finished row gets padding, as generate gives it
                    nxt = torch.where(done[k], torch.full_like(nxt, pad), nxt)
                    done[k] = done[k] | (nxt == eos)
                ids[k] = torch.cat([ids[k], nxt[:, None]], 1)
                masks[k] = torch.cat([masks[k], torch.ones_like(masks[k][:, :1])], 1)
        for k in range(len(batches)):
            steps = torch.stack(logits[k], 1) if logits[k] else torch.zeros(ids[k].shape[0], 0, 1)
            yield ids[k][:, : width[k] + steps.shape[1]], steps

    def image_choice_logliks(self, record: dict) -> list[float]:
        raise UserError("the layer-streamed evaluation runs text tasks only")


def inject_adapter(model: torch.nn.Module, name: str, config, state: dict, dtype, where: str) -> None:
    """PEFT's injection of adapter `name` (its PeftConfig `config`) into `model`, whose module
    names are the full model's, and its tensors `state` (keys as the adapter file has them,
    without PeftModel's prefix); `where` names the model in an error."""
    # lazy: peft: only with adapters
    from peft import inject_adapter_in_model, set_peft_model_state_dict

    inject_adapter_in_model(config, model, adapter_name=name)
    # what PEFT's loader reads (a plain dict attribute, not a submodule)
    model.peft_config = {**getattr(model, "peft_config", {}), name: config}  # type: ignore[assignment]
    result = set_peft_model_state_dict(model, state, adapter_name=name)
    unexpected = [k for k in getattr(result, "unexpected_keys", []) if "lora_" in k]
    if unexpected:
        raise UserError(f"adapter {name}: tensors {unexpected[:3]} match no module of {where}")
    model.to(dtype)


def switch_adapters(model: torch.nn.Module, active: str | None) -> None:
    """Every PEFT tuner layer of `model` on for adapter `active`, off for None (the base). A
    layer that lacks `active` adds nothing (PEFT skips an active adapter a layer has not)."""
    # lazy: peft: only with adapters
    from peft.tuners.tuners_utils import BaseTunerLayer

    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            module.enable_adapters(active is not None)
            if active is not None:
                module.set_adapter(active)


def skeleton(layers_prefix: str, i: int, layer: torch.nn.Module) -> torch.nn.Module:
    """A module tree holding only `layer`, at its full-model path `<layers_prefix>.<i>`."""
    # lazy: torch: heavy, loaded only when this runs
    import torch

    root = holder = torch.nn.Module()
    for part in layers_prefix.split("."):
        child = torch.nn.Module()
        holder.add_module(part, child)
        holder = child
    holder.add_module(str(i), layer)
    return root
