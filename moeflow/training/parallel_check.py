"""Run a few LoRA steps under a parallel layout and return what a single process
must reproduce: the loss of every step and every LoRA gradient, gathered whole.

The ranks are spawned gloo processes on CPU (fp32): the equivalence tests and
`benchmarks/bench_activation.py` use it, and it is a quick self-check of a
layout before a long run:

    python -m moeflow.training.parallel_check MODEL_DIR --tp 2 --cp 1 --ep 1 --fsdp 1

Layout: world = TP x CP x DP ranks (parallel.py); EP and FSDP subdivide them as
transformers' DistributedConfig does (the CP ranks count as data ranks there).
The same fixed micro-batches are used at every layout: DP rank d takes
micro-batches d, d + DP, ...; a single process takes them all.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moeflow.core.config import LoraSection
from moeflow.core.ports import free_port
from moeflow.training import context_parallel as CP
from moeflow.training import state as S
from moeflow.training import steps as T
from moeflow.training.lora import apply_lora
from moeflow.training.parallel import make_layout


@dataclass(frozen=True)
class CheckRun:
    """One layout's run (`run`'s arguments), handed to every spawned rank."""

    model_dir: str
    tp: int = 1
    cp: int = 1
    ep: int = 1
    fsdp: int = 1
    steps: int = 2
    accum: int = 2  # micro-batches per step
    rows: int = 2  # rows per micro-batch
    seq: int = 32
    rank: int = 4  # LoRA rank
    targets: tuple[str, ...] = ("attention",)
    lr: float = 0.5
    seed: int = 0
    recompute: bool = False
    packed: bool = True
    resume_at: int = 0  # > 0: checkpoint before this step, restore into a fresh adapter
    ckpt_dir: str = ""  # where (shared by the ranks)


def distributed_kwargs(world: int, tp: int, ep: int, fsdp: int) -> dict | None:
    """transformers DistributedConfig kwargs of a layout (None: whole replicas)."""
    if tp == ep == fsdp == 1:
        return None
    data = world // tp  # DP x CP: data ranks to transformers
    return {"tp_size": tp, "ep_size": ep, "fsdp_size": fsdp, "dp_replicate_size": data // fsdp}


def fixed_batches(n: int, rows: int, seq: int, vocab: int, seed: int = 0,
                  packed: bool = True) -> list[dict]:
    """n micro-batches of `rows` rows: two packed examples per row (one when not `packed`),
    prompt tokens unlabelled."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(4, vocab, (rows, seq), generator=g)  # [B, S]
        cut = seq // 2 + 3 if packed else seq
        pos = torch.cat([torch.arange(cut), torch.arange(seq - cut)]).repeat(rows, 1)  # [B, S]
        labels = ids.clone()
        labels[:, :4] = -100  # a prompt
        labels[:, cut:cut + 3] = -100
        out.append({"input_ids": ids, "labels": labels, "position_ids": pos,
                    "real": torch.ones(rows, seq, dtype=torch.bool)})
    return out


def _wrap(model, args: CheckRun, layout):
    """A fresh adapter on `model` (seeded as a run seeds it), made tensor-parallel; its
    trainable (name, parameter) pairs, plain SGD and a constant schedule."""

    # lazy: loads peft, which importing this module does not
    from moeflow.training import tp_lora

    torch.manual_seed(args.seed)
    lora = LoraSection(rank=args.rank, alpha=2 * args.rank, dropout=0.0,
                       target_modules=list(args.targets))
    peft_model, _, _ = apply_lora(model, lora)
    tp_lora.shard_lora(peft_model, layout, args.seed)
    if args.recompute:
        peft_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    peft_model.train()
    params = [(n, p) for n, p in peft_model.named_parameters() if p.requires_grad]
    # SGD: the step moves the adapter by lr x gradient, so float rounding stays rounding (Adam
    # would turn a 1e-7 difference of a near-zero gradient into a whole step of either sign)
    opt = torch.optim.SGD([p for _, p in params], lr=args.lr)
    return peft_model, params, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)


def _restart(peft_model, opt, sched, step: int, args: CheckRun, layout, ckpt: str):
    """Checkpoint as the trainer does (whole adapter, rank 0 writes), take the adapter off,
    wrap a fresh one and restore it from the checkpoint (each rank its piece): a resumed run."""
    gathered = (S.full_adapter(peft_model, layout), S.full_moments(peft_model, opt, layout))
    if dist.get_rank() == 0:
        S.save_checkpoint(ckpt, peft_model, opt, sched, step, {}, gathered=gathered)
    dist.barrier()
    fresh = _wrap(peft_model.unload(), args, layout)
    done, _, _ = S.load_checkpoint(ckpt, fresh[0], fresh[2], fresh[3], layout)
    assert done == step, (done, step)
    return fresh


def run_rank(rank: int, world: int, args: CheckRun) -> dict:
    """One rank's steps; returns (rank 0) losses, gathered gradients and peak memory."""

    # lazy: loads peft, which importing this module does not
    from moeflow.training import tp_lora

    tp, cp, ep, fsdp = args.tp, args.cp, args.ep, args.fsdp
    layout = make_layout(tp, cp)
    model, _ = T.load_base(args.model_dir, "float32", "grouped_mm",
                           distributed_kwargs(world, tp, ep, fsdp))
    model.config.use_cache = False
    peft_model, params, opt, sched = _wrap(model, args, layout)
    if cp > 1:
        CP.install(model)  # the base PEFT wrapped (its get_base_model())
    vocab = model.config.get_text_config().vocab_size
    batches = fixed_batches(args.steps * args.accum, args.rows, args.seq, vocab,
                            packed=args.packed)
    dp = layout.dp
    losses, grads, peaks = [], [], []
    meter = ActivationMeter(peft_model)
    for step in range(args.steps):
        if step and step == args.resume_at:
            peft_model, params, opt, sched = _restart(peft_model, opt, sched, step, args,
                                                      layout, args.ckpt_dir)
            meter = ActivationMeter(peft_model)
        mine = batches[step * args.accum:(step + 1) * args.accum][layout.dp_rank::dp]
        with meter:
            r = T.accumulate(peft_model, mine, None, 0, 1, layout)
        peaks.append(meter.peak)
        T.allreduce_lora_grads(peft_model, layout.grad_size, average=False, group=layout.grad_group)
        loss = T.allreduce_sum(torch.tensor([r["loss_sum"]], dtype=torch.float64),
                               layout.grad_size, layout.grad_group)
        losses.append(float(loss[0]) / r["token_total"])
        grads.append({n: tp_lora.gather(p, layout, p.grad) for n, p in params})
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    if world > 1:
        dist.barrier()
    return {"losses": losses, "grads": grads, "peaks": peaks}


class ActivationMeter:
    """Activation bytes of a forward/backward: every tensor autograd saves for backward
    (unique storages; parameters, frozen or not, are weights, not activations), at the end
    of the forward when they are all alive, plus the gradient of the logits that backward
    allocates first (measured by a hook on the LM head's output). `peak`: the largest
    such total over the micro-batches run inside the `with` block."""

    def __init__(self, model):
        self.model = model
        self.peak = 0

    def __enter__(self):
        self.peak, self._saved, self._grad = 0, {}, 0
        params = {(p.to_local() if hasattr(p, "to_local") else p).untyped_storage().data_ptr()
                  for p in self.model.parameters()}

        def pack(t):
            local = t.to_local() if hasattr(t, "to_local") else t
            st = local.untyped_storage()
            if st.data_ptr() not in params:
                self._saved[st.data_ptr()] = st.nbytes()
            return t

        def head_hook(_mod, _inp, out):
            if out.requires_grad:
                out.register_hook(self._on_logits_grad)

        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self._hooks.__enter__()
        head = self.model.get_output_embeddings()
        self._handle = head.register_forward_hook(head_hook)
        return self

    def _on_logits_grad(self, grad):
        # backward has begun: every saved tensor of this micro-batch is still alive
        self.peak = max(self.peak, sum(self._saved.values()) + grad.numel() * grad.element_size())
        self._saved = {}
        return grad

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        self._handle.remove()
        return False


def _worker(rank: int, world: int, port: int, out: str, args: CheckRun) -> None:
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        res = run_rank(rank, world, args)
        if rank == 0:
            torch.save(res, out)
    finally:
        dist.destroy_process_group()


def run(model_dir: str, tp: int = 1, cp: int = 1, ep: int = 1, fsdp: int = 1, dp: int = 1,
        steps: int = 2, accum: int = 2, rows: int = 2, seq: int = 32, rank: int = 4,
        targets: list[str] | None = None, lr: float = 0.5, seed: int = 0,
        recompute: bool = False, packed: bool = True, resume_at: int = 0) -> dict:
    """Spawn TP x CP x DP gloo ranks (one process when all are 1) and run `steps` steps;
    `resume_at` > 0: checkpoint before that step and go on from the checkpoint restored into
    a fresh adapter, as a resumed run does (moeflow.training.state).

    Returns:
        {"losses": [per step], "grads": [per step {param name: whole gradient}],
         "peaks": [per step, rank 0's activation bytes (ActivationMeter)]}.
    """


    args = CheckRun(model_dir=str(model_dir), tp=tp, cp=cp, ep=ep, fsdp=fsdp, steps=steps,
                    accum=accum, rows=rows, seq=seq, rank=rank,
                    targets=tuple(targets or ["attention"]), lr=lr, seed=seed,
                    recompute=recompute, packed=packed, resume_at=resume_at)
    world = tp * cp * dp
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # gloo ranks on CPU even on a GPU host
    try:
        with tempfile.TemporaryDirectory(prefix="moeflow-par-") as tmp:
            out = str(Path(tmp) / "rank0.pt")
            args = replace(args, ckpt_dir=str(Path(tmp) / "checkpoint"))
            mp.spawn(_worker, args=(world, free_port(), out, args), nprocs=world, join=True)
            return torch.load(out)
    finally:
        if saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved


def compare(ref: dict, got: dict) -> dict:
    """Worst relative differences: loss per step, and each gradient (norm-relative)."""
    loss = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(ref["losses"], got["losses"]))
    worst, where = 0.0, ""
    for ga, gb in zip(ref["grads"], got["grads"]):
        if set(ga) != set(gb):
            raise AssertionError(f"LoRA parameters differ: {sorted(set(ga) ^ set(gb))[:4]}")
        for k in ga:
            d = float((ga[k] - gb[k]).norm() / ga[k].norm().clamp_min(1e-20))
            if d > worst:
                worst, where = d, k
    return {"loss_rel": loss, "grad_rel": worst, "worst_param": where}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir")
    for k in ("tp", "cp", "ep", "fsdp", "dp"):
        ap.add_argument(f"--{k}", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--targets", default="attention")
    a = ap.parse_args(argv)
    kw = dict(steps=a.steps, targets=a.targets.split(","))
    ref = run(a.model_dir, **kw)
    got = run(a.model_dir, tp=a.tp, cp=a.cp, ep=a.ep, fsdp=a.fsdp, dp=a.dp, **kw)
    print(json.dumps(compare(ref, got)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
