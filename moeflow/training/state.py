"""Training state on disk: the LoRA adapter plus optimizer/scheduler state.

A checkpoint directory holds
  adapter/                  a standard PEFT adapter (adapter_config.json +
                            adapter_model.safetensors)
  optimizer.safetensors     AdamW moments per trainable parameter and
                            accumulated routing counts (safetensors: no pickle)
  trainer_state.json        step, scheduler state, metrics carried across restarts
Only trainable (LoRA) state is saved: the frozen base is never copied.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file, save_file

from moeflow.training.steps import is_sharded

if TYPE_CHECKING:  # types only
    from torch.nn.modules.module import _IncompatibleKeys


def full_adapter(model, layout=None) -> dict[str, torch.Tensor] | None:
    """The adapter's tensors whole, in PEFT's file layout (keys without the adapter name);
    collective under TP (every rank must call it: TP-sharded LoRA tensors are gathered,
    moeflow.training.tp_lora). None without TP: `save_adapter` reads the model itself."""
    if layout is None or layout.tp <= 1:
        return None
    # lazy: loads peft, which importing this module does not
    from moeflow.training.tp_lora import gather

    name = model.active_adapter
    return {key.replace(f".{name}.", "."): gather(p, layout)
            for key, p in model.named_parameters() if p.requires_grad}


def full_moments(model, opt, layout=None) -> dict[str, torch.Tensor] | None:
    """AdamW moments per trainable parameter, TP-sharded ones gathered whole (collective
    under TP; None without it). Keys as optimizer.safetensors has them ("{pid}.{moment}")."""
    if layout is None or layout.tp <= 1:
        return None
    # lazy: loads peft, which importing this module does not
    from moeflow.training.tp_lora import gather

    params = [p for p in model.parameters() if p.requires_grad]
    out = {}
    for pid, st in opt.state_dict()["state"].items():
        for key, value in st.items():
            if key != "step":
                out[f"{pid}.{key}"] = gather(params[pid], layout, value)
    return out


def save_adapter(model, out: str | Path, tensors: dict[str, torch.Tensor] | None = None) -> Path:
    """Write `model`'s LoRA adapter as a standard PEFT adapter directory.

    A whole-replica model uses PEFT's save_pretrained. On a base sharded by
    transformers' DistributedConfig (DTensor parameters), PEFT's save path does
    not produce the weights file, but the LoRA tensors themselves are plain,
    full, replicated tensors (PEFT adds them after the base was sharded and they
    are averaged over ranks every step); so we write them in PEFT's own layout:
    parameter names without the adapter name, plus adapter_config.json.

    A tensor-parallel adapter is written from `tensors` (`full_adapter`, gathered on
    every rank beforehand): the same file a TP=1 run writes.

    Returns:
        The adapter directory.
    """

    out = Path(out)
    if tensors is not None:
        out.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in tensors.items()},
                  str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
        model.peft_config[model.active_adapter].save_pretrained(str(out))
        return out
    if not is_sharded(model):
        model.save_pretrained(str(out))
        return out
    out.mkdir(parents=True, exist_ok=True)
    name = model.active_adapter
    tensors = {}
    for key, p in model.named_parameters():
        if p.requires_grad:
            if hasattr(p, "full_tensor"):
                raise RuntimeError(f"LoRA parameter {key} is sharded; cannot save it whole")
            tensors[key.replace(f".{name}.", ".")] = p.detach().contiguous()
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    model.peft_config[name].save_pretrained(str(out))
    return out


def save_checkpoint(path: str | Path, model, opt, sched, step: int, extra: dict,
                    tensors: dict[str, torch.Tensor] | None = None,
                    gathered: tuple | None = None) -> Path:
    """Write the adapter + optimizer state of `model` under `path`.

    Args:
        path: directory (created).
        model: the PEFT model.
        opt / sched: AdamW and its LambdaLR.
        step: optimizer steps done.
        extra: JSON-able values carried across restarts.
        tensors: extra tensors to keep (e.g. routing counts).
        gathered: under TP, (`full_adapter`, `full_moments`) taken on every rank first.

    Returns:
        The directory.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    adapter, moments = gathered or (None, None)
    save_adapter(model, path / "adapter", adapter)
    state = opt.state_dict()
    flat: dict[str, torch.Tensor] = {}
    steps: dict[str, float] = {}
    for pid, st in state["state"].items():
        for key, value in st.items():
            if key == "step":
                steps[str(pid)] = float(value)
            else:
                whole = moments[f"{pid}.{key}"] if moments else value
                flat[f"{pid}.{key}"] = whole.detach().contiguous()
    for key, value in (tensors or {}).items():
        flat[f"extra.{key}"] = value.detach().contiguous()
    save_file(flat, str(path / "optimizer.safetensors"))
    meta = {"step": step, "adam_steps": steps, "scheduler": sched.state_dict(), "extra": extra}
    (path / "trainer_state.json").write_text(json.dumps(meta, default=float))
    return path


def load_checkpoint(path: str | Path, model, opt, sched, layout=None) -> tuple[int, dict, dict]:
    """Restore adapter weights and optimizer/scheduler state written by save_checkpoint.
    Under TP each rank takes its piece of the whole tensors the checkpoint holds.

    Returns:
        (step, extra, extra tensors).
    """
    # lazy: peft: heavy, loaded only when this runs
    from peft import set_peft_model_state_dict

    from moeflow.training.tp_lora import local_piece

    path = Path(path)
    adapter = load_file(str(path / "adapter" / "adapter_model.safetensors"))
    params = [p for p in model.parameters() if p.requires_grad]
    if layout is not None and layout.tp > 1:
        name = model.active_adapter
        by_key = {k.replace(f".{name}.", "."): p for k, p in model.named_parameters()
                  if p.requires_grad}
        adapter = {k: local_piece(v, by_key[k], layout) if k in by_key else v
                   for k, v in adapter.items()}
    # torch's load_state_dict result (peft annotates it as a bare `namedtuple`)
    result: _IncompatibleKeys = set_peft_model_state_dict(model, adapter)
    if result.unexpected_keys:
        raise RuntimeError(f"checkpoint {path}: unexpected adapter keys "
                           f"{result.unexpected_keys[:5]}")
    # the base's keys are always "missing" (an adapter holds only LoRA tensors); a
    # missing LoRA tensor would silently stay at its fresh initialisation
    missing = [k for k in result.missing_keys if "lora_" in k]
    if missing:
        raise RuntimeError(f"checkpoint {path}: adapter lacks {len(missing)} LoRA tensor(s) "
                           f"of this model, e.g. {missing[:3]}")
    meta = json.loads((path / "trainer_state.json").read_text())
    flat = load_file(str(path / "optimizer.safetensors"))
    state = opt.state_dict()
    for pid_str, count in meta["adam_steps"].items():
        pid = int(pid_str)
        entry = {"step": torch.tensor(count)}
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            if f"{pid}.{key}" in flat:
                entry[key] = local_piece(flat[f"{pid}.{key}"], params[pid], layout).clone()
        state["state"][pid] = entry
    opt.load_state_dict(state)
    sched.load_state_dict(meta["scheduler"])
    for group, lr in zip(opt.param_groups, sched.get_last_lr()):
        group["lr"] = lr  # the scheduler's state does not carry into the optimizer's groups
    extras = {k[len("extra."):]: v for k, v in flat.items() if k.startswith("extra.")}
    return int(meta["step"]), meta["extra"], extras
