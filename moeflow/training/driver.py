"""The Ray Train driver of LoRA fine-tuning: checks before any worker starts, then one
TorchTrainer run that trains every adapter of a stage (the main one and each tenant) in
turn on one set of workers (moeflow.training.trainer: the worker loop).

One run, not one per adapter: on a cluster a run costs a worker group, process-group
setup and a base load each time (on 2 CPU cores ~30 s of the demo's finetune stage);
the adapters share the base, the LoRA and optimizer settings and the plan, and differ
in data and step counts. Each adapter keeps its own out dir, MLflow run and record.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from moeflow.core.config import LoraSection, PipelineConfig
from moeflow.core.devices import dist_backend
from moeflow.core.errors import UserError
from moeflow.core.fsutil import staged_dir
from moeflow.core.storage import is_uri, pyarrow_filesystem
from moeflow.model.models import auto_class, loads_image_text, read_config
from moeflow.model.split_lora import SPLIT_IMPL
from moeflow.parallel.planner import expected_rank_bytes
from moeflow.training import data as D
from moeflow.training.lora import Targets, lora_config, resolve_targets
from moeflow.training.parallel import Degrees
from moeflow.training.reporter import JOBS, PROGRESS
from moeflow.training.trainer import WORKER, train_loop_per_worker
from moeflow.training.worker import AdapterJob, WorkerConfig


def check_plan(plan: dict[str, Any], targets: Targets) -> Degrees:
    """Validate the plan's degrees against what this stack can fine-tune.

    Supported: world = TP x DP ranks (TP innermost), the DP ranks split into CP
    ranks sharing one sequence (moeflow.training.parallel); FSDP over all data
    ranks or none (fsdp == data_parallel, or 1), expert parallelism inside FSDP x TP
    for attention / shared-expert LoRA (for expert LoRA too when EP equals TP, FSDP 1),
    tensor parallelism for module LoRA on colwise / rowwise projections and for expert
    LoRA on colwise / packed_colwise / rowwise expert tensors (moeflow.training.tp_lora). Sharded plans load
    the base with transformers' DistributedConfig (TP, EP, FSDP2), which sees the
    CP ranks as more data ranks.

    Returns:
        The degrees the workers run with (`distributed`: None for a whole replica per worker).

    Raises:
        UserError: a combination that does not work (said why, before any worker starts).
    """
    deg = {k: int(plan.get(k, 1) or 1) for k in
           ("tensor_parallel", "pipeline_parallel", "expert_parallel", "fsdp", "context_parallel")}
    workers = int(plan.get("num_workers", 1) or 1)
    tp, ep, fsdp, cp = (deg[k] for k in ("tensor_parallel", "expert_parallel", "fsdp",
                                         "context_parallel"))
    if deg["pipeline_parallel"] > 1:
        raise UserError(f"plan: pipeline_parallel={deg['pipeline_parallel']} is not supported "
                        "by transformers training; use pipeline_parallel: 1")
    if ep > 1 and (ep != tp or fsdp > 1) and targets.parameters:
        raise UserError(f"plan: expert_parallel={ep} with LoRA on "
                        f"{', '.join(targets.parameters)}: expert LoRA on an EP-sharded "
                        f"model runs when expert_parallel equals tensor_parallel={tp} and "
                        "fsdp is 1 (each rank then holds whole experts of its TP group: "
                        f"moeflow.training.tp_lora); plan expert_parallel: {tp} and fsdp: 1, "
                        "or target attention only")
    dp = int(plan.get("data_parallel", workers // tp) or workers // tp)
    if dp * tp != workers:
        raise UserError(f"plan: tensor_parallel={tp} x data_parallel={dp} but "
                        f"num_workers={workers}; they must be equal")
    if dp % cp:
        raise UserError(f"plan: context_parallel={cp} must divide data_parallel={dp}")
    out = Degrees(num_workers=workers, data_parallel=dp, tensor_parallel=tp, context_parallel=cp)
    if tp == ep == fsdp == 1:
        return out
    if fsdp not in (1, dp):
        raise UserError(f"plan: fsdp={fsdp} with data_parallel={dp}: the finetune stage "
                        "shards over all data ranks (no HSDP replicas); plan fsdp: "
                        f"{dp} or fsdp: 1")
    if ep > 1 and tp == 1 and fsdp % ep:
        raise UserError(f"plan: expert_parallel={ep} must divide fsdp={fsdp}")
    if ep > 1 and (ep % tp or (fsdp * tp) % ep):
        raise UserError(f"plan: expert_parallel={ep} must be a multiple of tensor_parallel={tp} "
                        f"and divide fsdp x tensor_parallel={fsdp * tp}")
    return replace(out, distributed={"tp_size": tp, "pp_size": 1, "ep_size": ep,
                                     "fsdp_size": fsdp, "dp_replicate_size": dp // fsdp})


def targets_on_meta(base_dir: str | Path, lora_cfg: LoraSection) -> Targets:
    """Resolve LoRA targets on a meta-device model built from config.json (no weights read),
    of the class the workers load (moeflow.model.models.auto_class).

    Raises:
        UserError: a target matches nothing, or dropout with parameter targets.
    """
    # lazy: transformers: heavy, loaded only when this runs
    from transformers import AutoConfig


    cls = auto_class(base_dir)  # first: a config transformers cannot read is a one-line UserError
    config = AutoConfig.from_pretrained(str(base_dir), trust_remote_code=False)
    with torch.device("meta"):
        model = cls.from_config(config)
    targets = resolve_targets(model, list(lora_cfg.target_modules))
    lora_config(targets, lora_cfg)
    return targets


def preflight(cfg: PipelineConfig, base_dir: str | Path,
              plan: dict[str, Any]) -> tuple[Targets, Degrees]:
    """Cheap checks before any worker starts: targets, dropout, plan.

    Returns:
        (Targets, the degrees the workers run with).
    """
    targets = targets_on_meta(base_dir, cfg.lora)
    return targets, check_plan(plan, targets)


def planned_bytes(plan: dict[str, Any], base_dir: str | Path, dtype: str, workers: int) -> list[int]:
    """Planned base-parameter bytes of every rank (moeflow.parallel.planner.expected_rank_bytes),
    of what the workers load: a multimodal checkpoint that loads as its text model
    (Llama-4, moeflow.model.models) is planned without its vision tower and projector."""

    full = {"tensor_parallel": 1, "pipeline_parallel": 1, "expert_parallel": 1,
            "data_parallel": workers, "fsdp": 1, **plan}
    config = read_config(base_dir)
    if "vision_config" in config and not loads_image_text(base_dir):
        config = {k: v for k, v in config.items() if k != "vision_config"}
    return [expected_rank_bytes(full, config, r, dtype) for r in range(workers)]


def _copy_tree_atomic(src: Path, dst: Path) -> Path:
    with staged_dir(dst) as tmp:
        shutil.copytree(src, tmp, dirs_exist_ok=True)
    return dst


DONE = "training.json"  # an adapter's training record, written last: this out dir is trained


def latest_checkpoint(storage: Path | str) -> dict | None:
    """The checkpoint a restored Ray Train run under `storage` gives its workers
    (`ray.train.get_checkpoint`): {"job": adapter being trained (None in a checkpoint taken
    after a job finished), "step": its steps done, "finished": names of the adapters it had
    finished}, or None (the run starts from scratch).

    That is the newest checkpoint the run's controller registered in its snapshot
    (`checkpoint_manager_snapshot.json`), not the newest directory: workers of a killed
    driver can upload a checkpoint or two before they die that nobody registered.
    """
    from moeflow.core.storage import filesystem  # a local dir or a store URI (workdir: s3://...)

    fs, root = filesystem(str(storage))
    root = root.rstrip("/")
    found: list[tuple[int, dict[str, Any]]] = []
    for snapshot in fs.glob(f"{root}/*/checkpoint_manager_snapshot.json"):
        try:
            name = json.loads(fs.cat_file(snapshot))["latest_checkpoint_result"]["checkpoint_dir_name"]
            info = _checkpoint_info(fs, f"{snapshot.rsplit('/', 1)[0]}/{name}")
        except (OSError, ValueError, KeyError, TypeError, json.JSONDecodeError):
            continue  # torn, or no checkpoint registered yet: Ray Train starts from scratch too
        if info is not None:
            found.append(info)
    return max(found, key=lambda f: f[0])[1] if found else None


def _checkpoint_info(fs: Any, d: str) -> tuple[int, dict[str, Any]] | None:
    try:
        meta = json.loads(fs.cat_file(f"{d}/{PROGRESS}"))
        seq = int(meta["seq"])
    except (OSError, ValueError, KeyError, json.JSONDecodeError):
        return None
    jobs = f"{d}/{JOBS}"
    finished = sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(jobs, detail=False)) \
        if fs.isdir(jobs) else []
    running = meta.get("job") if fs.isfile(f"{d}/trainer_state.json") else None
    return seq, {"job": running, "step": int(meta.get("step") or 0) if running else None,
                 "finished": finished}


def latest_checkpoint_step(storage: Path | str) -> int | None:
    """Steps done in the adapter the newest checkpoint under `storage` was taken in, or None."""
    found = latest_checkpoint(storage)
    return found["step"] if found else None


@dataclass
class TrainJob:
    """One adapter to train: its config (data and finetune sections are its own; model, lora,
    optimizer and seed must be the first job's), out dir, MLflow run and name in lines."""

    name: str
    cfg: PipelineConfig
    out_dir: Path
    mlflow_run_id: str | None = None
    label: str = ""


def run_training(cfg: PipelineConfig, base_dir: str | Path, plan: dict[str, Any],
                 out_dir: str | Path, *, mlflow_run_id: str | None = None, label: str = "",
                 **kwargs: Any) -> dict[str, Any]:
    """Fine-tune one LoRA adapter with Ray Train (train_adapters with one job); its record."""
    job = TrainJob("adapter", cfg, Path(out_dir), mlflow_run_id, label)
    return train_adapters([job], base_dir, plan, **kwargs)[0]


def train_adapters(jobs: list[TrainJob], base_dir: str | Path, plan: dict[str, Any], *,
                   tracking_uri: str | None = None, experts_impl: str = "grouped_mm",
                   use_gpu: bool = False, notify: Callable[[str], None] | None = None,
                   progress_file: str | None = None,
                   storage_uri: str | None = None) -> list[dict[str, Any]]:
    """Fine-tune LoRA adapters on one base, in turn, in one Ray Train run; their records.

    Resumable in place: Ray Train (v2) restores a run from its storage path
    (`<first job's out dir>/ray`) and name, so an attempt after a killed driver or a
    lost node continues the adapter it was training from its newest checkpoint and
    skips the ones it had finished; an adapter whose out dir holds `training.json`
    is returned as is.

    Args:
        jobs: the adapters, in training order.
        base_dir: checkpoint the workers load (the converted one).
        plan: the plan stage's `plan` dict (num_workers and degrees).
        tracking_uri: MLflow store of the jobs' runs (rank 0 logs into them by id).
        experts_impl: transformers experts implementation for training.
        use_gpu: one GPU per worker, NCCL; else gloo on CPU.
        notify: callback for a line the user should see (resuming, kept).
        progress_file: where rank 0 records steps done (tasks.base.write_progress).
        storage_uri: Ray Train's storage in a store (`<stage's store dir>/ray`) instead of the
            first job's out dir, so a retry on another node resumes from its checkpoints.

    Returns:
        Per job: {"adapter_dir", "probe_path", "metrics", "dataset", "targets", "status_dir",
        "num_workers", "experts_implementation" (what training used)}.
    """
    # lazy: ray, transformers: heavy, loaded only when this runs
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer
    from transformers import AutoTokenizer


    first = jobs[0].cfg
    for job in jobs[1:]:  # one base, one LoRA shape, one optimizer: what the workers share
        for section in ("model", "lora", "optimizer", "seed"):
            if getattr(job.cfg, section) != getattr(first, section):
                raise ValueError(f"train_adapters: job {job.name!r} differs from {jobs[0].name!r} "
                                 f"in {section}; train it in a run of its own")
    say = notify or (lambda message: None)
    storage = storage_uri or str(jobs[0].out_dir.resolve() / "ray")
    records: dict[str, dict[str, Any]] = {}
    for job in jobs:
        done = job.out_dir / DONE
        if done.is_file() and (job.out_dir / "adapter" / "adapter_config.json").is_file():
            say(f"{_prefix(job)}already trained by an earlier attempt; keeping {job.out_dir / 'adapter'}")
            records[job.name] = json.loads(done.read_text())
    todo = [j for j in jobs if j.name not in records]
    if not todo:
        return [records[j.name] for j in jobs]
    found = latest_checkpoint(storage)
    if found and found["job"]:
        running = next((j for j in todo if j.name == found["job"]), None)
        say(f"{_prefix(running) if running else ''}resuming from checkpoint at step {found['step']}")
    elif found and found["finished"]:
        say(f"resuming after {', '.join(found['finished'])} (trained by an earlier attempt)")
    targets, degrees = preflight(first, base_dir, plan)
    if degrees.tensor_parallel > 1 and targets.parameters and experts_impl != SPLIT_IMPL:
        # TP-sharded experts take their LoRA as activations (moeflow.training.tp_lora)
        say(f"expert LoRA under tensor_parallel={degrees.tensor_parallel} trains with experts "
            f"implementation {SPLIT_IMPL} (not {experts_impl})")
        experts_impl = SPLIT_IMPL
    tok = AutoTokenizer.from_pretrained(str(base_dir))
    datasets = {}
    for job in todo:
        datasets[job.name] = ds = D.build_dataset(job.cfg.data, tok, first.seed)
        # TP/CP ranks share rows: enough rows for every replica?
        D.micro_batches(ds.train_rows, 1, 0, degrees.replicas, 0).__next__()
    planned = planned_bytes(plan, base_dir, first.model.dtype, degrees.num_workers)
    status_dir = str(jobs[0].out_dir.resolve() / "workers")
    worker = WorkerConfig.build(
        first, base_dir,
        [AdapterJob(j.name, j.cfg.finetune, datasets[j.name], j.mlflow_run_id, j.label) for j in todo],
        degrees=degrees, experts_impl=experts_impl, recompute=bool(plan.get("recompute")),
        planned_rank_bytes=tuple(planned), **WorkerConfig.plan_memory(plan),
        use_gpu=use_gpu, tracking_uri=tracking_uri, status_dir=status_dir,
        progress_file=progress_file)
    ft = first.finetune
    trainer = TorchTrainer(
        train_loop_per_worker, train_loop_config={WORKER: worker},
        torch_config=TorchConfig(backend=dist_backend(use_gpu)),  # NCCL on GPUs, gloo on CPU
        scaling_config=ScalingConfig(
            num_workers=degrees.num_workers, use_gpu=use_gpu,
            resources_per_worker={"CPU": ft.cpus_per_worker, **({"GPU": 1} if use_gpu else {})}),
        run_config=RunConfig(
            name="finetune", **_storage_config(storage),
            failure_config=FailureConfig(max_failures=ft.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=2)))
    try:
        result = trainer.fit()
    except Exception as exc:  # Ray wraps the worker's error; keep its last line
        last = (str(exc).strip().splitlines() or [type(exc).__name__])[-1]
        said = f"{UserError.__module__}.{UserError.__name__}: "
        if last.startswith(said):  # a worker's user error: its own line, as the stage's
            raise UserError(f"finetune: {last[len(said):]}") from exc
        raise RuntimeError(f"finetune training failed: {last}") from exc
    if result.checkpoint is None:
        raise RuntimeError("finetune: Ray Train finished without a final checkpoint")
    with result.checkpoint.as_directory() as d:
        if not (Path(d) / "FINAL").exists():
            raise RuntimeError(f"finetune: last checkpoint {d} is not the final one")
        for job in todo:
            src = Path(d) / JOBS / job.name
            if not (src / "metrics.json").is_file():
                raise RuntimeError(f"finetune: the final checkpoint {d} lacks adapter {job.name}")
            records[job.name] = _record(job, src, datasets[job.name], targets, degrees, status_dir,
                                        experts_impl)
    # every adapter's record is written: the run's checkpoints (adapter copies) only confuse now
    from moeflow.core.storage import remove

    remove(storage)
    return [records[j.name] for j in jobs]


def _storage_config(storage: str) -> dict[str, Any]:
    """RunConfig storage: a local path as is; a store URI through its fsspec filesystem
    (pyarrow's FSSpecHandler), so Ray Train uses the same endpoint and credentials."""

    if not is_uri(storage):
        return {"storage_path": storage}
    fs, path = pyarrow_filesystem(storage)
    return {"storage_path": path, "storage_filesystem": fs}


def _prefix(job: TrainJob) -> str:
    return f"{job.label}: " if job.label else ""


def _record(job: TrainJob, src: Path, ds: D.Dataset, targets: Targets, degrees: Degrees,
            status_dir: str, experts_impl: str) -> dict[str, Any]:
    """Copy a finished adapter (and its probe logits) out of the final checkpoint into its out
    dir and write its record there, last and atomically (a torn one is never "trained")."""
    out = job.out_dir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    adapter = _copy_tree_atomic(src / "adapter", out / "adapter")
    probe = None
    if (src / "probe.safetensors").exists():
        probe = out / "probe.safetensors"
        shutil.copyfile(src / "probe.safetensors", probe)
    record = {"adapter_dir": str(adapter), "probe_path": str(probe) if probe else None,
              "metrics": json.loads((src / "metrics.json").read_text()), "targets": targets.matched,
              "status_dir": status_dir, "num_workers": degrees.num_workers,
              "experts_implementation": experts_impl,
              "dataset": {"sha256": ds.sha256, "n_train": ds.n_train, "n_eval": ds.n_eval,
                          "skipped_lines": ds.skipped,
                          "train_rows": int(ds.train_rows["input_ids"].shape[0]),
                          "loss_tokens": ds.train_tokens}}
    done = out / DONE
    tmp = done.with_name(done.name + ".tmp")
    tmp.write_text(json.dumps(record, default=float))
    tmp.replace(done)
    return record
