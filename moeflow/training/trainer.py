"""LoRA fine-tuning on Ray Train: the worker loop.

Three layers, as in Ray's own examples and Made-With-ML: plain PyTorch step
functions (steps.py), `train_loop_per_worker` here (the only code that calls
Ray Train APIs: context, checkpoint, report), and the driver (driver.py:
ScalingConfig / RunConfig / FailureConfig / CheckpointConfig / TorchTrainer).
A worker loads the base once and trains the run's adapters on it in turn (the
main one, then each tenant): a fresh LoRA per adapter, PEFT `unload` between.

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

The base loads with moeflow.model.models' class rule (the one regress and deploy
use): Qwen3-VL-MoE and ERNIE-4.5-VL as image-text models (vision tower loaded,
frozen, never adapted), Llama-4 as its text model; the data is text.
Only rank 0 logs to MLflow, into the stage's run (by run id, MlflowClient, so
the worker never changes the run's status): tracker.py. The checkpoints the worker
reports while it trains the adapters in turn, and each finished one: reporter.py.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from moeflow.core.errors import UserError
from moeflow.core.memmeter import PeakMemory
from moeflow.model import routing as R
from moeflow.model.anatomy import EXPERT_COUNT_KEYS, TOP_K_KEYS
from moeflow.parallel.memory import dtype_bytes
from moeflow.training import context_parallel as CP
from moeflow.training import data as D
from moeflow.training import state as S
from moeflow.training import steps as T
from moeflow.training import tp_lora
from moeflow.training.lora import apply_lora
from moeflow.training.parallel import make_layout
from moeflow.training.reporter import JOBS, Reporter, save_job
from moeflow.training.tracker import Tracker, log_step
from moeflow.training.worker import (
    AdapterJob,
    AdapterState,
    LoadedBase,
    WorkerConfig,
    cpu_rank_memory,
    import_first,
    own_weights,
    tight_cpu_rank,
)


def _load(cfg: WorkerConfig, rank: int, world: int) -> LoadedBase:
    """Load the frozen base once per worker (every adapter of the run trains on it)."""
    torch.manual_seed(cfg.seed)
    deg = cfg.degrees
    import_first(cfg, rank)
    # TP x CP x DP groups (tp innermost, as transformers' mesh); a single process without any.
    # Before the meter: a group's gloo connections and buffers are the runtime's, not the model's
    layout = make_layout(deg.tensor_parallel, deg.context_parallel)
    meter = PeakMemory().start()  # each rank's model-attributable peak (issue 45's rehearsal)
    model, tok = T.load_base(cfg.base_dir, cfg.dtype, cfg.experts_impl, deg.distributed)
    if tight_cpu_rank(cfg):
        own_weights(model)
    load_peak = meter.peak()
    plan_check = _check_rank_bytes(model, cfg.planned_rank_bytes, rank, world,
                                   strict=bool(deg.distributed), dtype=cfg.dtype)
    if cfg.use_gpu:  # one GPU per worker (NCCL); Ray Train sets CUDA_VISIBLE_DEVICES
        import ray.train.torch

        model.to(ray.train.torch.get_device())
    return LoadedBase(model=model, tok=tok, plan_check=plan_check, rank=rank, world=world,
                      layout=layout, meter=meter, load_peak=load_peak)


def _config_count(config: Any, keys: tuple[str, ...]) -> int:
    """The first positive integer among a config's `keys` (moeflow.model.anatomy's names), else 0."""
    for key in keys:
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return 0


def _setup(cfg: WorkerConfig, base: LoadedBase, job: AdapterJob) -> AdapterState:
    """Wrap the base with a fresh LoRA adapter for `job`; its optimizer and data (plain PyTorch).

    Seeded here, so each adapter starts as it would in a worker of its own.
    """
    torch.manual_seed(cfg.seed)
    ft, opt_cfg = job.finetune, cfg.optimizer
    model, tok, rank = base.model, base.tok, base.rank
    text_cfg = model.config.get_text_config()  # the config itself for a text model
    if ft.router_aux_loss_coef is not None and hasattr(text_cfg, "router_aux_loss_coef"):
        text_cfg.router_aux_loss_coef = ft.router_aux_loss_coef
        if hasattr(model, "router_aux_loss_coef"):  # ERNIE-VL copies it at construction
            model.router_aux_loss_coef = ft.router_aux_loss_coef  # type: ignore[assignment]  # a float attribute, not a module
    model.config.use_cache = text_cfg.use_cache = False
    peft_model, targets, sizes = apply_lora(model, cfg.lora)
    layout = base.layout
    tp_lora.shard_lora(peft_model, layout, cfg.seed)  # TP: each rank's piece of the adapter
    if layout.cp > 1:
        CP.install(model)  # the base PEFT wrapped (its get_base_model())
    # the plan turns recompute on where a sequence's activations do not fit without it
    if ft.gradient_checkpointing or cfg.recompute:
        peft_model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False})
    peft_model.train()
    opt, sched = T.make_optimizer(peft_model, opt_cfg, ft.max_steps)
    num_experts = _config_count(text_cfg, EXPERT_COUNT_KEYS)
    top_k = _config_count(text_cfg, TOP_K_KEYS)
    tap = T.RouterTap(peft_model, top_k) if num_experts else None
    if rank == 0:  # PEFT's familiar line, in the worker log
        print(f"{job.label or 'adapter'}: trainable params: {sizes['trainable_params']:,} "
              f"|| all params: {sizes['total_params']:,} || trainable%: "
              f"{sizes['trainable_pct']:.4f} || targets: {', '.join(targets.matched)}", flush=True)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    return AdapterState(
        job=job, base=base, model=peft_model, opt=opt, sched=sched, opt_cfg=opt_cfg,
        targets=targets, sizes=sizes, tap=tap, num_experts=num_experts,
        # TP and CP ranks of one replica take the same rows: rows are dealt over DP replicas
        batches=D.micro_batches(job.dataset.train_rows, ft.micro_batch_size, layout.dp_rank,
                                layout.dp, cfg.seed),
        pad=pad, sharded=T.is_sharded(peft_model))


def _release(w: AdapterState, base: LoadedBase) -> None:
    """Take `w`'s adapter off the shared base (PEFT `unload`: LoRA layers removed, base
    weights untouched) and drop its optimizer state, so the next adapter starts from the
    base; `w` is not used again."""
    if w.tap is not None:
        w.tap.remove()
    base.model = w.model.unload()
    w.opt.state.clear()  # the moments of the unloaded LoRA tensors


def _check_rank_bytes(model: torch.nn.Module, planned: list[int] | tuple[int, ...] | None,
                      rank: int, world: int, strict: bool = True,
                      dtype: str | None = None) -> dict[str, float]:
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

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _rank_peaks(w: AdapterState) -> dict[str, float]:
    """{"plan/rank{r}/peak_bytes", "plan/rank{r}/load_peak_bytes"}: every rank's resident-set
    peak above its level just before the base's first tensor was read (moeflow.core.memmeter;
    -1 where unmeasurable), so far and when the base had loaded, gathered by one small
    all-reduce, so rank 0 logs them all."""
    meter = w.base.meter
    peaks = (meter.peak() if meter is not None else None, w.base.load_peak)
    vec = torch.zeros(2 * w.world, dtype=torch.float64)  # [peak per rank, load peak per rank]
    for k, peak in enumerate(peaks):
        vec[k * w.world + w.rank] = -1.0 if peak is None else float(peak)
    vec = _allreduce_sum(vec, w.world)
    keys = ("peak_bytes", "load_peak_bytes")
    return {f"plan/rank{r}/{key}": float(vec[k * w.world + r]) for k, key in enumerate(keys) for r in range(w.world)}


def _peak_device_bytes(model) -> int | None:
    """Peak GPU memory torch allocated on this worker's device (None on CPU): on a GPU the
    plan's per-device peak (`plan_peak_bytes`) is device memory, not the process's RSS."""
    try:
        device = next(model.parameters()).device
    except StopIteration:
        return None
    if device.type != "cuda":
        return None
    return int(torch.cuda.max_memory_allocated(device))


_allreduce_sum = T.allreduce_sum


def _exact_match(w: AdapterState, limit: int | None, prefix: str) -> dict[str, float]:
    """Held-out exact match (overall and per record `task`), examples sharded over ranks.

    Returns:
        {prefix: overall, f"{prefix}/{task}": per task}.
    """
    examples = w.ds.eval_examples[:limit] if limit else w.ds.eval_examples
    tasks = sorted({e.task for e in examples if e.task})
    # a sharded base gathers its weights collectively in every forward: all ranks
    # must run the same generate calls, so each evaluates every example
    mine = examples if w.sharded else examples[w.rank::w.world]
    preds: list[str] = []
    if mine:
        if w.pad is None:
            raise UserError("the base's tokenizer has neither a pad nor an eos token: "
                            "exact-match generation pads prompts with one")
        preds = T.generate_completions(w.model, mine, w.pad, w.tok.eos_token_id, w.tok,
                                       batch_size=w.ft.eval_batch_size)
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


def _eval_loss(w: AdapterState, rows: dict[str, torch.Tensor]) -> float:
    """Held-out loss per completion token of the packed eval `rows`; rows sharded over ranks
    (every rank runs every row on a sharded base, whose forwards are collective)."""
    if not w.sharded:
        rows = {k: v[w.rank::w.world] for k, v in rows.items()}  # [R / world, S]
    sums = torch.tensor(T.eval_loss_sum(w.model, rows, w.ft.micro_batch_size),
                        dtype=torch.float64)  # [total, count]
    sums = _allreduce_sum(sums, w.world)
    if w.sharded:
        sums = sums / w.world
    return float(sums[0]) / max(1.0, float(sums[1]))


def _train_step(w: AdapterState) -> dict[str, Any]:
    """grad_accum micro-batches (token-weighted over them and all ranks), LoRA
    all-reduce (sum), clip + AdamW step; metrics of the step."""
    t0 = time.perf_counter()
    lay = w.layout
    batches = [next(w.batches)[1] for _ in range(w.ft.grad_accum)]
    # each CP rank runs 1/CP of every row: its share of the real tokens
    seen = float(sum(float(b["real"].sum()) for b in batches)) / lay.cp
    r = T.accumulate(w.model, batches, w.tap, w.num_experts, w.world, lay)
    counts = r["counts"]
    # over the ranks of this TP index (all ranks without TP): TP ranks hold whole gradients
    comm = T.allreduce_lora_grads(w.model, lay.grad_size, average=False, group=lay.grad_group)
    grad_norm = T.optimizer_step(w.model, w.opt, w.sched, w.opt_cfg.max_grad_norm, lay)
    # one small all-reduce for monitoring: [loss sum, aux, seen, counts...]
    stats = torch.cat([torch.tensor([r["loss_sum"], r["aux_loss"] / w.ft.grad_accum, seen]),
                       counts.reshape(-1) if counts is not None else torch.zeros(0)])
    stats = T.allreduce_sum(stats, lay.grad_size, lay.grad_group)
    dt = time.perf_counter() - t0
    return {"loss": float(stats[0]) / max(1, r["token_total"]),
            "aux_loss": float(stats[1]) / lay.grad_size,
            "loss_tokens": float(r["token_total"]), "tokens": float(stats[2]),
            "tokens_per_s": float(stats[2]) / dt, "step_time_s": dt, "grad_norm": grad_norm,
            "lr": w.sched.get_last_lr()[0], "comm_bytes": comm,
            "counts": stats[3:].reshape(counts.shape) if counts is not None else None}


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


def _finish(w: AdapterState, tracker: Tracker, step: int, carried: dict[str, float],
            routing_total: torch.Tensor | None,
            cfg: WorkerConfig) -> tuple[dict[str, Any], torch.Tensor | None, torch.Tensor | None]:
    """Evaluate the finished adapter and log its heatmap.

    Returns:
        (final metrics, probe input ids, probe logits) -- the probe on rank 0 (every rank
        of a sharded base) when there are eval examples, else None.
    """
    ft = w.ft
    final: dict[str, Any] = dict(carried)
    if w.ds.eval_rows is not None:
        final["eval_loss"] = _eval_loss(w, w.ds.eval_rows)
        final.update(_exact_match(w, ft.max_eval_examples, "adapter_exact_match"))
    final.update(peak_rss_bytes=_max_over_ranks(_peak_rss_bytes(), w.world),
                 **{k: v for k, v in w.plan_check.items()}, **_rank_peaks(w))
    peak_device = _peak_device_bytes(w.model)  # every rank on a GPU, or none: one collective or none
    if peak_device is not None:
        final["peak_device_bytes"] = _max_over_ranks(peak_device, w.world)
    if cfg.planned_peak_bytes:
        final["plan_peak_bytes"] = cfg.planned_peak_bytes
    final.update(step=step, trainable_params=w.sizes["trainable_params"],
                 total_params=w.sizes["total_params"], trainable_pct=w.sizes["trainable_pct"],
                 lora_bytes=w.sizes["lora_bytes"], base_bytes=w.sizes["base_bytes"])
    probe = w.ds.eval_examples[0] if w.ds.eval_examples else None
    ids = logits = None
    if probe is not None and (w.rank == 0 or w.sharded):  # sharded: a collective forward
        ids = torch.tensor([probe.prompt_ids + probe.completion_ids])  # [1, S]
        w.model.eval()
        with torch.no_grad():
            logits = w.model(input_ids=ids.to(w.model.device)).logits.float().cpu()  # [1, S, V]
    if w.rank == 0:
        tracker.metrics({k: v for k, v in final.items() if isinstance(v, (int, float))}, step)
        if routing_total is not None and w.tap is not None:
            tracker.figure(R.heatmap_figure(routing_total, w.tap.layer_ids,
                                            f"expert load over {step} steps"), "routing/heatmap.png")
            tracker.dict({"layers": w.tap.layer_ids, "counts": routing_total.tolist()},
                         "routing/expert_load.json")
        tracker.flush()
    return final, ids, logits


WORKER = "worker"  # the key of the WorkerConfig in Ray Train's `train_loop_config`


def train_loop_per_worker(loop_config: dict[str, WorkerConfig]) -> None:
    """Ray Train worker: load the base once, then train each of the config's jobs in turn
    (resuming the one a checkpoint was taken in, skipping those it had finished),
    checkpointing as it goes; the last report carries every adapter.

    Args:
        loop_config: Ray Train's `train_loop_config`, {WORKER: the WorkerConfig
            `moeflow.training.driver.train_adapters` built}.
    """
    # lazy: ray: heavy, loaded only when this runs
    import ray.train

    cfg = loop_config[WORKER]
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    # transformers' DistributedConfig reads the torchrun variables; Ray Train set up
    # the process group but not all of them
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(ctx.get_local_rank()),
                      LOCAL_WORLD_SIZE=str(ctx.get_local_world_size()))
    if not cfg.use_gpu:
        # a CPU worker (gloo) on a GPU host: Ray does not hide the host's GPUs, and transformers'
        # DistributedConfig would bind it to cuda:LOCAL_RANK. Set before CUDA is first touched here
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        if tight_cpu_rank(cfg):  # before the first tensor: a CPU rank holds what the plan books
            cpu_rank_memory()
    _write_pid(cfg.status_dir, rank)
    base = _load(cfg, rank, world)
    reporter = Reporter(rank)
    finished: set[str] = set()
    progress: dict[str, Any] | None = None
    ckpt = ray.train.get_checkpoint()
    try:
        if ckpt is not None:
            with ckpt.as_directory() as d:
                finished, progress = reporter.restore(Path(d))
                if progress["job"] in finished or not (Path(d) / "trainer_state.json").is_file():
                    progress = None  # a job-end checkpoint: nothing of a job to resume
                else:
                    state_dir = Path(tempfile.mkdtemp(prefix="mf-resume-"))
                    shutil.copytree(d, state_dir, dirs_exist_ok=True, ignore=shutil.ignore_patterns(JOBS))
        jobs = [j for j in cfg.jobs if j.name not in finished]
        for k, job in enumerate(jobs):
            resume = None
            if progress is not None and progress["job"] in (job.name, None):
                resume, progress = state_dir, None
            _train_job(cfg, base, job, reporter, resume, last=k + 1 == len(jobs))
            if resume is not None:
                shutil.rmtree(resume, ignore_errors=True)
        if not jobs:  # a restart after the last job had finished: report what it left again
            reporter.report({"step": 0}, cfg.jobs[-1].name, 0, final=True)
    finally:
        reporter.close()


def _train_job(cfg: WorkerConfig, base: LoadedBase, job: AdapterJob, reporter: Reporter,
               resume: Path | None, last: bool) -> None:
    """Train one adapter on the shared base, from `resume` (a checkpoint's job state) if given;
    checkpoint every `checkpoint_every` steps; report it finished; take it off the base."""
    rank = base.rank
    w = _setup(cfg, base, job)
    ft, name = w.ft, job.name
    tracker = Tracker(job.mlflow_run_id, cfg.tracking_uri, rank == 0)
    start = 0
    carried: dict[str, Any] = {}
    routing_total: torch.Tensor | None = None
    if resume is not None:
        start, carried, extras = S.load_checkpoint(resume, w.model, w.opt, w.sched, w.layout)
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
        _progress(cfg.status_dir, step + 1, rank)
        if rank == 0 and cfg.progress_file:  # the driver's progress bar (tasks.base.PROGRESS)
            tmp = Path(cfg.progress_file + ".tmp")
            tmp.write_text(json.dumps({"done": step + 1, "total": ft.max_steps,
                                       "what": job.progress_label}))
            tmp.replace(cfg.progress_file)
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
        if (step + 1) % ft.checkpoint_every == 0 and step + 1 < ft.max_steps:
            tracker.flush()
            tensors = {"routing_total": routing_total} if routing_total is not None else {}
            # under TP every rank gathers the whole adapter and moments; rank 0 writes them
            gathered = (S.full_adapter(w.model, w.layout), S.full_moments(w.model, w.opt, w.layout))
            reporter.report({"step": step + 1, "loss": m["loss"]}, name, step + 1, partial(
                S.save_checkpoint, model=w.model, opt=w.opt, sched=w.sched, step=step + 1,
                extra=carried, tensors=tensors, gathered=gathered))
    final, ids, logits = _finish(w, tracker, ft.max_steps, carried, routing_total, cfg)
    whole = S.full_adapter(w.model, w.layout)  # collective under TP
    if reporter.done is not None:  # rank 0
        save_job(reporter.done, name, w, final, ids, logits, whole)
    reporter.report(final, name, ft.max_steps, final=last)
    _release(w, base)
