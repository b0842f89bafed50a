"""LoRA fine-tuning on Ray Train: the worker loop and the driver that launches it.

Three layers, as in Ray's own examples and Made-With-ML: plain PyTorch step
functions (steps.py), `train_loop_per_worker` here (the only code that calls
Ray Train APIs: context, checkpoint, report), and `run_training` (the driver:
ScalingConfig / RunConfig / FailureConfig / CheckpointConfig / TorchTrainer).

Data parallelism: every worker holds the frozen base and the adapter; the
loss is token-weighted over a step's micro-batches and all ranks (steps.accumulate:
the sum of token losses over the global target-token count), and after backward
only the LoRA gradients are summed, in one flat all-reduce whose size is
measured and logged next to the LoRA and base sizes.

Sharded plans (fsdp == data_parallel == workers, optionally expert_parallel
inside): the base is loaded by transformers' DistributedConfig (FSDP2
`fully_shard` per layer, experts split over EP ranks), frozen. PEFT wraps it
afterwards, so the LoRA tensors are NOT FSDP-managed: they stay whole and
replicated (KBs), and the same one flat all-reduce of LoRA gradients is the
only gradient traffic (the frozen base has no gradients, so FSDP reduce-scatters
nothing); FSDP's own traffic is the per-layer all-gather of frozen base shards
in forward/backward. The adapter is then saved whole from rank 0 in PEFT's
layout. Every rank's loaded parameters must equal the plan's exactly.

The base loads with moeflow.models' class rule (the one regress and deploy
use): Qwen3-VL-MoE and ERNIE-4.5-VL as image-text models (vision tower loaded,
frozen, never adapted), Llama-4 as its text model; the data is text.
Only rank 0 logs to MLflow, into the stage's run (by run id, MlflowClient, so
the worker never changes the run's status).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from moeflow.errors import UserError
from moeflow.training import data as D
from moeflow.training import routing as R
from moeflow.training import state as S
from moeflow.training import steps as T
from moeflow.training.lora import apply_lora


def _ns(d: dict) -> SimpleNamespace:
    return SimpleNamespace(**d)


class Tracker:
    """Rank-0 MLflow logging into an existing run; a no-op without a run id."""

    def __init__(self, run_id: str | None, uri: str | None, enabled: bool):
        self.run_id = run_id if enabled else None
        self.buffer: list = []
        if self.run_id:
            from mlflow.tracking import MlflowClient

            self.client = MlflowClient(tracking_uri=uri)

    def metrics(self, values: dict[str, float], step: int) -> None:
        if self.run_id:
            from mlflow.entities import Metric

            now = int(time.time() * 1000)
            self.buffer += [Metric(k, float(v), now, step) for k, v in values.items()]
            if len(self.buffer) >= 5000:  # bounded memory on long runs between checkpoints
                self.flush()

    def flush(self) -> None:
        if self.run_id and self.buffer:
            for i in range(0, len(self.buffer), 1000):  # log_batch limit
                self.client.log_batch(self.run_id, metrics=self.buffer[i:i + 1000])
        self.buffer = []

    def dict(self, obj: dict, name: str) -> None:
        if self.run_id:
            self.client.log_dict(self.run_id, obj, name)

    def figure(self, fig, name: str) -> None:
        """Log a matplotlib figure, then close it (pyplot keeps every open figure alive)."""
        import matplotlib.pyplot as plt

        try:
            if self.run_id:
                self.client.log_figure(self.run_id, fig, name)
        finally:
            plt.close(fig)


def _setup(cfg: dict, rank: int, world: int) -> SimpleNamespace:
    """Load the frozen base, wrap with LoRA, build optimizer and data (plain PyTorch)."""
    torch.manual_seed(cfg["seed"])
    ft, opt_cfg = _ns(cfg["finetune"]), _ns(cfg["optimizer"])
    model, tok = T.load_base(cfg["base_dir"], cfg["dtype"], cfg["experts_impl"],
                             cfg.get("distributed"))
    plan_check = _check_rank_bytes(model, cfg.get("planned_rank_bytes"), rank, world,
                                   strict=bool(cfg.get("distributed")), dtype=cfg["dtype"])
    if cfg.get("use_gpu"):  # one GPU per worker (NCCL); Ray Train sets CUDA_VISIBLE_DEVICES
        import ray.train.torch

        model.to(ray.train.torch.get_device())
    text_cfg = model.config.get_text_config()  # the config itself for a text model
    if ft.router_aux_loss_coef is not None and hasattr(text_cfg, "router_aux_loss_coef"):
        text_cfg.router_aux_loss_coef = ft.router_aux_loss_coef
        if hasattr(model, "router_aux_loss_coef"):  # ERNIE-VL copies it at construction
            model.router_aux_loss_coef = ft.router_aux_loss_coef
    model.config.use_cache = text_cfg.use_cache = False
    peft_model, targets, sizes = apply_lora(model, _ns(cfg["lora"]))
    if ft.gradient_checkpointing:
        peft_model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False})
    peft_model.train()
    opt, sched = T.make_optimizer(peft_model, opt_cfg, ft.max_steps)
    num_experts = int(next((getattr(text_cfg, k) for k in ("num_experts", "num_local_experts",
                                                           "n_routed_experts")
                            if getattr(text_cfg, k, None)), 0))
    top_k = int(getattr(text_cfg, "num_experts_per_tok", 0) or 0)
    tap = T.RouterTap(peft_model, top_k) if num_experts else None
    if rank == 0:  # PEFT's familiar line, in the worker log
        print(f"trainable params: {sizes['trainable_params']:,} || all params: "
              f"{sizes['total_params']:,} || trainable%: {sizes['trainable_pct']:.4f} || "
              f"targets: {', '.join(targets.matched)}", flush=True)
    ds: D.Dataset = cfg["dataset"]
    return SimpleNamespace(
        model=peft_model, tok=tok, sharded=T.is_sharded(peft_model), plan_check=plan_check,
        opt=opt, sched=sched, ft=ft, opt_cfg=opt_cfg, sizes=sizes,
        targets=targets, tap=tap, num_experts=num_experts, ds=ds, rank=rank, world=world,
        batches=D.micro_batches(ds.train_rows, ft.micro_batch_size, rank, world, cfg["seed"]),
        pad=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)


def _check_rank_bytes(model, planned: list[int] | None, rank: int, world: int,
                      strict: bool = True, dtype: str | None = None) -> dict:
    """The plan against reality: this rank's loaded parameters == the planned bytes.

    Compared as elements x the size of `dtype`, the plan's one-dtype bytes:
    transformers keeps a few tensors in fp32 whatever the dtype
    (`_keep_in_fp32_modules`: ERNIE-VL's and DeepSeek-V3's routers, GPT-OSS's
    norms), KBs the plan does not model; the real bytes are logged as
    `measured_bytes`. Every rank learns every rank's numbers (one tiny
    all-reduce), so rank 0 can log them all and every rank fails the same way.
    Whole replicas (not strict) only warn: they hold exactly what from_pretrained
    loads, so a difference is an accounting gap of the planner, not a wrong
    load; a sharded load is fully the plan's doing.

    Returns:
        {"plan/rank{r}/planned_bytes", "plan/rank{r}/measured_bytes",
         "plan/bytes_match"} for all ranks.

    Raises:
        RuntimeError: strict, and any rank's bytes differ from the plan.
    """
    if planned is None:
        return {}
    from moeflow.memory import dtype_bytes

    size = dtype_bytes(dtype) if dtype else None
    mine = torch.zeros(2 * world, dtype=torch.float64)  # [bytes per rank, elements per rank]
    mine[rank] = T.local_param_bytes(model)
    mine[world + rank] = T.local_param_numel(model)
    both = _allreduce_sum(mine, world).long().tolist()
    measured, numel = both[:world], both[world:]
    as_planned = [n * size if size else b for n, b in zip(numel, measured)]
    out = {}
    for r in range(world):
        out[f"plan/rank{r}/planned_bytes"] = float(planned[r])
        out[f"plan/rank{r}/measured_bytes"] = float(measured[r])
    bad = [r for r in range(world) if as_planned[r] != planned[r]]
    out["plan/bytes_match"] = float(not bad)
    if bad:
        msg = "plan vs reality: rank parameters differ from the plan: " + "; ".join(
            f"rank {r} loaded {numel[r]} elements ({as_planned[r]} B in {dtype}), "
            f"planned {planned[r]} B" for r in bad)
        if strict:
            raise RuntimeError(msg)
        if rank == 0:
            print(f"WARNING {msg}", flush=True)
    return out


def _peak_rss_bytes() -> int:
    """Peak resident memory of this worker process (Linux ru_maxrss is in KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


_allreduce_sum = T.allreduce_sum


def _exact_match(w: SimpleNamespace, limit: int | None, prefix: str) -> dict[str, float]:
    """Held-out exact match (overall and per record `task`), examples sharded over ranks.

    Returns:
        {prefix: overall, f"{prefix}/{task}": per task}.
    """
    examples = w.ds.eval_examples[:limit] if limit else w.ds.eval_examples
    tasks = sorted({e.task for e in examples if e.task})
    # a sharded base gathers its weights collectively in every forward: all ranks
    # must run the same generate calls, so each evaluates every example
    mine = examples if w.sharded else examples[w.rank::w.world]
    preds = T.generate_completions(w.model, mine, w.pad, w.tok.eos_token_id, w.tok,
                                   batch_size=w.ft.eval_batch_size) if mine else []
    hit = T.exact_hits(preds, mine)
    sums = torch.tensor([float(sum(hit))] + [float(sum(h for h, e in zip(hit, mine)
                                                       if e.task == t)) for t in tasks])
    sums = _allreduce_sum(sums, w.world)
    if w.sharded:
        sums = sums / w.world
    out = {prefix: float(sums[0]) / max(1, len(examples))}
    for i, t in enumerate(tasks):
        out[f"{prefix}/{t}"] = float(sums[i + 1]) / sum(e.task == t for e in examples)
    return out


def _eval_loss(w: SimpleNamespace) -> float:
    """Held-out loss per completion token; rows sharded over ranks (every rank runs
    every row on a sharded base, whose forwards are collective)."""
    rows = w.ds.eval_rows
    if not w.sharded:
        rows = {k: v[w.rank::w.world] for k, v in rows.items()}  # [R / world, S]
    sums = torch.tensor(T.eval_loss_sum(w.model, rows, w.ft.micro_batch_size),
                        dtype=torch.float64)  # [total, count]
    sums = _allreduce_sum(sums, w.world)
    if w.sharded:
        sums = sums / w.world
    return float(sums[0]) / max(1.0, float(sums[1]))


def _train_step(w: SimpleNamespace) -> dict:
    """grad_accum micro-batches (token-weighted over them and all ranks), LoRA
    all-reduce (sum), clip + AdamW step; metrics of the step."""
    t0 = time.perf_counter()
    batches = [next(w.batches)[1] for _ in range(w.ft.grad_accum)]
    seen = float(sum(float(b["real"].sum()) for b in batches))
    r = T.accumulate(w.model, batches, w.tap, w.num_experts, w.world)
    counts = r["counts"]
    comm = T.allreduce_lora_grads(w.model, w.world, average=False)
    grad_norm = T.optimizer_step(w.model, w.opt, w.sched, w.opt_cfg.max_grad_norm)
    # one small all-reduce for monitoring: [loss sum, aux, seen, counts...]
    stats = torch.cat([torch.tensor([r["loss_sum"], r["aux_loss"] / w.ft.grad_accum, seen]),
                       counts.reshape(-1) if counts is not None else torch.zeros(0)])
    stats = _allreduce_sum(stats, w.world)
    dt = time.perf_counter() - t0
    return {"loss": float(stats[0]) / max(1, r["token_total"]), "aux_loss": float(stats[1]) / w.world,
            "loss_tokens": float(r["token_total"]), "tokens": float(stats[2]),
            "tokens_per_s": float(stats[2]) / dt, "step_time_s": dt, "grad_norm": grad_norm,
            "lr": w.sched.get_last_lr()[0], "comm_bytes": comm,
            "counts": stats[3:].reshape(counts.shape) if counts is not None else None}


def log_step(tracker: Tracker, spikes: R.SpikeDetector, m: dict, counts, layer_ids: list[int],
             step: int, log_metrics: bool = True) -> dict | None:
    """Rank 0: step metrics + routing statistics; a loss spike becomes an event artifact.

    Returns:
        The spike record, or None.
    """
    flat = {f"train/{k}": v for k, v in m.items() if isinstance(v, (int, float))}
    flat["comm/allreduce_bytes_per_step"] = flat.pop("train/comm_bytes", 0)
    routing = R.step_metrics(counts, layer_ids) if counts is not None else {}
    if log_metrics:
        tracker.metrics({**flat, **routing}, step)
    spike = spikes.update(m["loss"])
    if spike:  # with the routing of that step: did routing fluctuation cause it?
        tracker.metrics({"train/loss_spike": 1.0}, step)
        tracker.dict({"step": step, **spike, "routing": routing,
                      "counts": counts.tolist() if counts is not None else None},
                     f"events/loss_spike_step{step:06d}.json")
    return spike


def _max_over_ranks(value: float, world: int) -> float:
    """Largest value over ranks (one-hot sum, then max: gloo and NCCL both sum)."""
    if world <= 1:
        return float(value)
    rank = dist.get_rank()
    vec = torch.zeros(world, dtype=torch.float64)
    vec[rank] = value
    return float(_allreduce_sum(vec, world).max())


def _write_pid(status_dir: str | None, rank: int) -> None:
    if status_dir:
        Path(status_dir).mkdir(parents=True, exist_ok=True)
        (Path(status_dir) / f"rank{rank}.pid").write_text(str(os.getpid()))


def _progress(status_dir: str | None, step: int, rank: int) -> None:
    if status_dir and rank == 0:
        tmp = Path(status_dir) / "progress.json.tmp"
        tmp.write_text(json.dumps({"step": step, "pid": os.getpid(), "time": time.time()}))
        tmp.replace(Path(status_dir) / "progress.json")


def _report(metrics: dict, ckpt_dir: Path | None) -> None:
    import ray.train

    ckpt = ray.train.Checkpoint.from_directory(str(ckpt_dir)) if ckpt_dir else None
    ray.train.report(metrics, checkpoint=ckpt)


def _finish(w, cfg: dict, tracker: Tracker, step: int, carried: dict, routing_total) -> None:
    """Evaluate, log the heatmap, save the final adapter + probe logits, report them."""
    ft = w.ft
    final = dict(carried)
    if w.ds.eval_rows is not None:
        final["eval_loss"] = _eval_loss(w)
        final.update(_exact_match(w, ft.max_eval_examples, "adapter_exact_match"))
    final.update(peak_rss_bytes=_max_over_ranks(_peak_rss_bytes(), w.world),
                 **{k: v for k, v in w.plan_check.items()})
    if cfg.get("planned_peak_bytes"):
        final["plan_peak_bytes"] = cfg["planned_peak_bytes"]
    final.update(step=step, trainable_params=w.sizes["trainable_params"],
                 total_params=w.sizes["total_params"], trainable_pct=w.sizes["trainable_pct"],
                 lora_bytes=w.sizes["lora_bytes"], base_bytes=w.sizes["base_bytes"])
    probe = (w.ds.eval_examples or [None])[0]
    logits = None
    if probe is not None and (w.rank == 0 or w.sharded):  # sharded: a collective forward
        ids = torch.tensor([probe.prompt_ids + probe.completion_ids])  # [1, S]
        w.model.eval()
        with torch.no_grad():
            logits = w.model(input_ids=ids.to(w.model.device)).logits.float().cpu()  # [1, S, V]
    if w.rank != 0:
        _report(final, None)
        return
    tracker.metrics({k: v for k, v in final.items() if isinstance(v, (int, float))}, step)
    if routing_total is not None:
        tracker.figure(R.heatmap_figure(routing_total, w.tap.layer_ids,
                                        f"expert load over {step} steps"), "routing/heatmap.png")
        tracker.dict({"layers": w.tap.layer_ids, "counts": routing_total.tolist()},
                     "routing/expert_load.json")
    tracker.flush()
    with tempfile.TemporaryDirectory(prefix="mf-final-") as tmp:
        S.save_checkpoint(tmp, w.model, w.opt, w.sched, step, final)
        if logits is not None:
            from safetensors.torch import save_file

            save_file({"input_ids": ids, "logits": logits.contiguous()},
                      str(Path(tmp) / "probe.safetensors"))
        Path(tmp, "FINAL").write_text(str(step))
        _report(final, Path(tmp))


def train_loop_per_worker(cfg: dict) -> None:
    """Ray Train worker: resume if a checkpoint exists, train, checkpoint, finish.

    Args:
        cfg: built by `run_training` (sections as dicts, the packed Dataset,
            base_dir, MLflow run id / tracking URI, status_dir).
    """
    import ray.train

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    # transformers' DistributedConfig reads the torchrun variables; Ray Train set up
    # the process group but not all of them
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(ctx.get_local_rank()),
                      LOCAL_WORLD_SIZE=str(ctx.get_local_world_size()))
    _write_pid(cfg.get("status_dir"), rank)
    w = _setup(cfg, rank, world)
    ft = w.ft
    tracker = Tracker(cfg.get("mlflow_run_id"), cfg.get("tracking_uri"), rank == 0)
    start, carried, routing_total = 0, {}, None
    ckpt = ray.train.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d:
            start, carried, extras = S.load_checkpoint(d, w.model, w.opt, w.sched)
        routing_total = extras.get("routing_total")
        carried["resumed_from_step"] = start
        carried["restarts"] = carried.get("restarts", 0) + 1
        for _ in range(start * ft.grad_accum):  # same data order as an uninterrupted run
            next(w.batches)
    elif w.ds.eval_examples:
        with w.model.disable_adapter():
            carried.update(_exact_match(w, ft.max_eval_examples, "base_exact_match"))
    if rank == 0:
        tracker.metrics(w.plan_check, start)
        tracker.metrics({"params/trainable": w.sizes["trainable_params"],
                         "params/total": w.sizes["total_params"],
                         "params/trainable_pct": w.sizes["trainable_pct"],
                         "params/lora_bytes": w.sizes["lora_bytes"],
                         "params/base_bytes": w.sizes["base_bytes"]}, start)
    spikes = R.SpikeDetector(ft.spike_window, ft.spike_k)
    pace = [0.0, 0.0]  # tokens, seconds of training steps (all ranks' tokens)
    for step in range(start, ft.max_steps):
        m = _train_step(w)
        _progress(cfg.get("status_dir"), step + 1, rank)
        if rank == 0 and cfg.get("progress_file"):  # the driver's progress bar (tasks.base.PROGRESS)
            tmp = Path(cfg["progress_file"] + ".tmp")
            tmp.write_text(json.dumps({"done": step + 1, "total": ft.max_steps,
                                       "what": cfg.get("progress_label", "")}))
            tmp.replace(cfg["progress_file"])
        counts = m.pop("counts")
        if counts is not None:
            routing_total = counts if routing_total is None else routing_total + counts
        carried["train_loss"] = m["loss"]
        carried["comm_bytes_per_step"] = m["comm_bytes"]
        if step > start:  # steady state: the first step of an attempt pays warm-up costs
            pace[0], pace[1] = pace[0] + m["tokens"], pace[1] + m["step_time_s"]
            carried["tokens_per_s"] = pace[0] / pace[1]
        if rank == 0:
            every = (step + 1) % ft.log_every == 0 or step + 1 == ft.max_steps
            log_step(tracker, spikes, m, counts, w.tap.layer_ids if w.tap else [], step + 1, every)
        last = step + 1 == ft.max_steps
        if (step + 1) % ft.checkpoint_every == 0 and not last:
            tracker.flush()
            if rank == 0:
                with tempfile.TemporaryDirectory(prefix="mf-ckpt-") as tmp:
                    tensors = {"routing_total": routing_total} if routing_total is not None else {}
                    S.save_checkpoint(tmp, w.model, w.opt, w.sched, step + 1, carried, tensors)
                    _report({"step": step + 1, "loss": m["loss"]}, Path(tmp))
            else:
                _report({"step": step + 1, "loss": m["loss"]}, None)
    _finish(w, cfg, tracker, ft.max_steps, carried, routing_total)


# ------------------------------------------------------------------ driver


def check_plan(plan: dict, targets) -> dict:
    """Validate the plan's degrees against what this stack can fine-tune.

    Supported: replicated data parallelism; FSDP over all workers (fsdp ==
    data_parallel == num_workers), and expert parallelism inside it for
    attention/shared-expert LoRA. Sharded plans load the base with transformers'
    DistributedConfig (FSDP2 under the hood).

    Returns:
        {"num_workers", "data_parallel", "distributed_config" (dict | None)}.

    Raises:
        UserError: a combination that does not work (said why, before any worker starts).
    """
    deg = {k: int(plan.get(k, 1) or 1) for k in
           ("tensor_parallel", "pipeline_parallel", "expert_parallel", "fsdp")}
    workers = int(plan.get("num_workers", 1) or 1)
    if deg["tensor_parallel"] > 1:
        raise UserError(f"plan: tensor_parallel={deg['tensor_parallel']}, but PEFT LoRA on "
                        "transformers tensor parallelism fails (shape error, docs/facts.md); "
                        "plan the finetune with tensor_parallel: 1")
    if deg["pipeline_parallel"] > 1:
        raise UserError(f"plan: pipeline_parallel={deg['pipeline_parallel']} is not supported "
                        "by transformers training; use pipeline_parallel: 1")
    if deg["expert_parallel"] > 1 and targets.parameters:
        raise UserError(f"plan: expert_parallel={deg['expert_parallel']} with LoRA on "
                        f"{', '.join(targets.parameters)}: PEFT expert LoRA on an EP-sharded "
                        "model fails (DTensor mixing); target attention only, or plan "
                        "expert_parallel: 1")
    dp = int(plan.get("data_parallel", workers) or workers)
    if dp != workers:
        raise UserError(f"plan: data_parallel={dp} but num_workers={workers}; without tensor "
                        "or pipeline parallelism they must be equal")
    ep, fsdp = deg["expert_parallel"], deg["fsdp"]
    if ep == 1 and fsdp == 1:
        return {"num_workers": workers, "data_parallel": dp, "distributed_config": None}
    if fsdp != workers:
        raise UserError(f"plan: fsdp={fsdp} with num_workers={workers}: the finetune stage "
                        "shards over all workers (no HSDP replicas); plan fsdp: "
                        f"{workers} or fsdp: 1")
    if fsdp % ep:
        raise UserError(f"plan: expert_parallel={ep} must divide fsdp={fsdp}")
    if targets.parameters:  # not measured to work on a DistributedConfig-sharded base
        raise UserError(f"plan: fsdp={fsdp} with LoRA on {', '.join(targets.parameters)}: "
                        "expert LoRA is fine-tuned with replicated data parallelism only; "
                        "target attention, or plan fsdp: 1")
    return {"num_workers": workers, "data_parallel": dp,
            "distributed_config": {"tp_size": 1, "pp_size": 1, "ep_size": ep,
                                   "fsdp_size": fsdp, "dp_replicate_size": 1}}


def targets_on_meta(base_dir: str | Path, lora_cfg):
    """Resolve LoRA targets on a meta-device model built from config.json (no weights read),
    of the class the workers load (moeflow.models.auto_class).

    Raises:
        UserError: a target matches nothing, or dropout with parameter targets.
    """
    from transformers import AutoConfig

    from moeflow.models import auto_class
    from moeflow.training.lora import lora_config, resolve_targets

    cls = auto_class(base_dir)  # first: a config transformers cannot read is a one-line UserError
    config = AutoConfig.from_pretrained(str(base_dir), trust_remote_code=False)
    with torch.device("meta"):
        model = cls.from_config(config)
    targets = resolve_targets(model, list(lora_cfg.target_modules))
    lora_config(targets, lora_cfg)
    return targets


def preflight(cfg, base_dir: str | Path, plan: dict):
    """Cheap checks before any worker starts: targets, dropout, plan.

    Returns:
        (Targets, {"num_workers", "data_parallel"}).
    """
    targets = targets_on_meta(base_dir, cfg.lora)
    return targets, check_plan(plan, targets)


def planned_bytes(plan: dict, base_dir: str | Path, dtype: str, workers: int) -> list[int]:
    """Planned base-parameter bytes of every rank (moeflow.planner.expected_rank_bytes),
    of what the workers load: a multimodal checkpoint that loads as its text model
    (Llama-4, moeflow.models) is planned without its vision tower and projector."""
    from moeflow.models import loads_image_text, read_config
    from moeflow.planner import expected_rank_bytes

    full = {"tensor_parallel": 1, "pipeline_parallel": 1, "expert_parallel": 1,
            "data_parallel": workers, "fsdp": 1, **plan}
    config = read_config(base_dir)
    if "vision_config" in config and not loads_image_text(base_dir):
        config = {k: v for k, v in config.items() if k != "vision_config"}
    return [expected_rank_bytes(full, config, r, dtype) for r in range(workers)]


def _copy_tree_atomic(src: Path, dst: Path) -> Path:
    tmp = dst.with_name(f".{dst.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    if dst.exists():
        shutil.rmtree(dst)
    tmp.rename(dst)
    return dst


DONE = "training.json"  # run_training's record, written last: this out dir is trained


def latest_checkpoint_step(storage: Path) -> int | None:
    """Step of the newest Ray Train checkpoint an earlier attempt left under `storage`
    (`<storage>/<run name>/checkpoint_*/trainer_state.json`), or None."""
    steps = []
    for state in storage.glob("*/checkpoint_*/trainer_state.json"):
        try:
            steps.append(int(json.loads(state.read_text())["step"]))
        except (OSError, ValueError, KeyError, json.JSONDecodeError):
            continue  # a torn checkpoint: Ray Train ignores it too
    return max(steps) if steps else None


def run_training(cfg, base_dir: str | Path, plan: dict, out_dir: str | Path, *,
                 mlflow_run_id: str | None = None, tracking_uri: str | None = None,
                 experts_impl: str = "grouped_mm", use_gpu: bool = False,
                 notify=None, label: str = "", progress_file: str | None = None) -> dict:
    """Fine-tune a LoRA adapter with Ray Train; returns the final metrics and paths.

    Resumable in place: Ray Train (v2) restores a run from its storage path and
    name, so an out dir where an earlier attempt (a killed driver, a lost node)
    left checkpoints continues from the newest one, not from step 0; an out dir
    whose training finished (`training.json`) is returned as is.

    Args:
        cfg: PipelineConfig.
        base_dir: checkpoint the workers load (the converted one).
        plan: the plan stage's `plan` dict (num_workers and degrees).
        out_dir: where `adapter/`, `probe.safetensors` and Ray's run storage go.
        mlflow_run_id / tracking_uri: the run rank 0 logs into (None: no logging).
        experts_impl: transformers experts implementation for training.
        use_gpu: one GPU per worker, NCCL; else gloo on CPU.
        notify: callback for a line the user should see (resuming, kept).
        label: what to call this training in those lines (e.g. a tenant's name).
        progress_file: where rank 0 records steps done (tasks.base.write_progress).

    Returns:
        {"adapter_dir", "probe_path", "metrics", "dataset", "targets", "status_dir"}.
    """
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer
    from transformers import AutoTokenizer

    from moeflow.devices import dist_backend

    out_dir = Path(out_dir).resolve()
    say = notify or (lambda message: None)
    prefix = f"{label}: " if label else ""
    done = out_dir / DONE
    if done.is_file() and (out_dir / "adapter" / "adapter_config.json").is_file():
        say(f"{prefix}already trained by an earlier attempt; keeping {out_dir / 'adapter'}")
        return json.loads(done.read_text())
    resumed = latest_checkpoint_step(out_dir / "ray")
    if resumed is not None:
        say(f"{prefix}resuming from checkpoint at step {resumed}")
    targets, layout = preflight(cfg, base_dir, plan)
    tok = AutoTokenizer.from_pretrained(str(base_dir))
    ds = D.build_dataset(cfg.data, tok, cfg.seed)
    D.micro_batches(ds.train_rows, 1, 0, layout["num_workers"], 0).__next__()  # enough rows?
    ft = cfg.finetune
    planned = planned_bytes(plan, base_dir, cfg.model.dtype, layout["num_workers"])
    peak = plan.get("memory_per_device_gb") or (plan.get("memory") or {}).get("total_gb")
    loop_cfg = {
        "distributed": layout["distributed_config"], "planned_rank_bytes": planned,
        "planned_peak_bytes": float(peak) * 1e9 if peak else None,
        "base_dir": str(base_dir), "dtype": cfg.model.dtype, "experts_impl": experts_impl,
        "seed": cfg.seed, "lora": cfg.lora.model_dump(), "optimizer": cfg.optimizer.model_dump(),
        "finetune": ft.model_dump(), "dataset": ds, "mlflow_run_id": mlflow_run_id,
        "tracking_uri": tracking_uri, "status_dir": str(out_dir / "workers"), "use_gpu": use_gpu,
        "progress_file": progress_file, "progress_label": f"{label or 'training'} steps"}
    trainer = TorchTrainer(
        train_loop_per_worker, train_loop_config=loop_cfg,
        torch_config=TorchConfig(backend=dist_backend(use_gpu)),  # NCCL on GPUs, gloo on CPU
        scaling_config=ScalingConfig(
            num_workers=layout["num_workers"], use_gpu=use_gpu,
            resources_per_worker={"CPU": ft.cpus_per_worker, **({"GPU": 1} if use_gpu else {})}),
        run_config=RunConfig(
            name="finetune", storage_path=str(out_dir / "ray"),
            failure_config=FailureConfig(max_failures=ft.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=2)))
    try:
        result = trainer.fit()
    except Exception as exc:  # Ray wraps the worker's error; keep its last line
        last = (str(exc).strip().splitlines() or [type(exc).__name__])[-1]
        raise RuntimeError(f"finetune training failed: {last}") from exc
    if result.checkpoint is None:
        raise RuntimeError("finetune: Ray Train finished without a final checkpoint")
    with result.checkpoint.as_directory() as d:
        if not (Path(d) / "FINAL").exists():
            raise RuntimeError(f"finetune: last checkpoint {d} is not the final one")
        adapter = _copy_tree_atomic(Path(d) / "adapter", out_dir / "adapter")
        probe = None
        if (Path(d) / "probe.safetensors").exists():
            probe = out_dir / "probe.safetensors"
            shutil.copyfile(Path(d) / "probe.safetensors", probe)
    # the run finished: its intermediate checkpoints (adapter copies) only confuse now
    record = {"adapter_dir": str(adapter), "probe_path": str(probe) if probe else None,
              "metrics": dict(result.metrics), "targets": targets.matched,
              "status_dir": str(out_dir / "workers"), "num_workers": layout["num_workers"],
              "dataset": {"sha256": ds.sha256, "n_train": ds.n_train, "n_eval": ds.n_eval,
                          "skipped_lines": ds.skipped,
                          "train_rows": int(ds.train_rows["input_ids"].shape[0]),
                          "loss_tokens": ds.train_tokens}}
    tmp = done.with_name(done.name + ".tmp")
    tmp.write_text(json.dumps(record, default=float))
    tmp.replace(done)  # written last and atomically: a torn one is never "trained"
    shutil.rmtree(out_dir / "ray", ignore_errors=True)
    return record
