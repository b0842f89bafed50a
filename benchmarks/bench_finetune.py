"""Fine-tuning throughput: Ray Train job vs a plain single-process PEFT loop, and
grouped_mm vs eager experts — each ratio against a baseline measured in this run.

    .venv/bin/python benchmarks/bench_finetune.py            # ~1-2 min on 2 idle cores
    .venv/bin/python benchmarks/bench_finetune.py --steps 60 --hidden 256

1. Same tiny Qwen3-MoE, data, LoRA and steps: tokens/s of (a) a plain PEFT loop
   in this process with the same thread count as (b) a 1-worker Ray Train job
   (steady-state steps, as the worker measures them). The Ray overhead is
   1 - b/a; the issue's budget is < 15%. Start-up (Ray, worker, model load) is
   printed separately: it is paid once per job, not per step.
2. Forward+backward of expert LoRA with experts_implementation grouped_mm vs
   eager on one bigger MoE model (docs/facts.md: ~7x measured on a large block).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # moeflow_testing: in the checkout, not installed


def _config(model: Path, data: tuple[Path, Path], steps: int, threads: int, tmp: Path,
            micro_batch: int = 8, seq_len: int = 128):
    from moeflow.core.config import validate

    return validate({
        "name": "bench", "model": {"path": str(model), "dtype": "float32"},
        "data": {"train_file": str(data[0]), "eval_file": str(data[1]), "seq_len": seq_len},
        "lora": {"rank": 16, "alpha": 32, "dropout": 0.0, "target_modules": ["attention"]},
        "optimizer": {"lr": 5e-3, "warmup_steps": 2},
        "finetune": {"max_steps": steps, "micro_batch_size": micro_batch, "checkpoint_every": 10_000,
                     "max_eval_examples": 1, "cpus_per_worker": threads},
        "tracking": {"uri": f"sqlite:///{tmp}/mlflow.db"}})


def plain_loop(cfg, threads: int) -> float:
    """Steady-state tokens/s of the same steps in one process, no Ray."""
    from moeflow.training import data as D
    from moeflow.training import steps as T
    from moeflow.training.lora import apply_lora

    torch.set_num_threads(threads)
    torch.manual_seed(cfg.seed)
    model, tok = T.load_base(cfg.model.path, "float32", "grouped_mm")
    model, _, _ = apply_lora(model, cfg.lora)
    model.train()
    ds = D.build_dataset(cfg.data, tok, cfg.seed)
    opt, sched = T.make_optimizer(model, cfg.optimizer, cfg.finetune.max_steps)
    tap = T.RouterTap(model, model.config.num_experts_per_tok)
    batches = D.micro_batches(ds.train_rows, cfg.finetune.micro_batch_size, 0, 1, cfg.seed)
    tokens, seconds = 0.0, 0.0
    for step in range(cfg.finetune.max_steps):
        t0 = time.perf_counter()
        _, batch = next(batches)
        T.forward_backward(model, batch, 1.0, tap, model.config.num_experts)
        T.optimizer_step(model, opt, sched, cfg.optimizer.max_grad_norm)
        if step > 0:  # same steady-state accounting as the Ray worker
            tokens += float(batch["real"].sum())
            seconds += time.perf_counter() - t0
    return tokens / seconds


def ray_job(cfg, model: Path, tmp: Path) -> tuple[float, float]:
    """(steady-state tokens/s, wall seconds) of a 1-worker Ray Train job."""
    import ray

    from moeflow.training.driver import run_training

    ray.init(num_cpus=cfg.finetune.cpus_per_worker, include_dashboard=False,
             _temp_dir=tempfile.mkdtemp(prefix="/tmp/mfb"))
    try:
        t0 = time.perf_counter()
        res = run_training(cfg, model, {"num_workers": 1, "data_parallel": 1}, tmp / "out")
        wall = time.perf_counter() - t0
    finally:
        ray.shutdown()
    return res["metrics"]["tokens_per_s"], wall


def experts_fwd_bwd(impl: str, model_dir: Path, targets: list[str], repeats: int = 3) -> float:
    """Median seconds of forward+backward with LoRA on `targets`."""
    from moeflow.training import steps as T
    from moeflow.training.lora import apply_lora

    torch.manual_seed(0)
    model, _ = T.load_base(str(model_dir), "float32", impl)
    model, _, _ = apply_lora(model, SimpleNamespace(rank=8, alpha=16, dropout=0.0,
                                                    target_modules=targets))
    ids = torch.randint(0, 300, (4, 256))  # [B, S]
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    return statistics.median(times[1:])


def main() -> None:
    from moeflow_testing.demo_data import make_dataset
    from moeflow_testing.tiny import build_debug_model

    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: a shared 2-core box)")
    ap.add_argument("--micro-batch", type=int, default=8, help="packed rows per step")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=512, help="experts benchmark hidden size")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="mf-bench-ft-"))
    model = build_debug_model("qwen3_moe", tmp / "model", dtype="float32")
    data = make_dataset(tmp / "data", n_train=2000, n_eval=8)
    cfg = _config(model, data, args.steps, args.threads, tmp, args.micro_batch, args.seq_len)

    # plain loop before and after the Ray job: the machine is shared, average out drift
    plain_runs = [plain_loop(cfg, args.threads)]
    ray_tps, wall = ray_job(cfg, model, tmp)
    plain_runs.append(plain_loop(cfg, args.threads))
    plain = statistics.mean(plain_runs)
    print(f"training tokens/s  plain PEFT loop (baseline): {plain:10.0f}  "
          f"(runs: {', '.join(f'{p:.0f}' for p in plain_runs)})")
    print(f"training tokens/s  Ray Train, 1 worker       : {ray_tps:10.0f}  "
          f"ratio {ray_tps / plain:.3f}  overhead {100 * (1 - ray_tps / plain):+.1f}% (budget < 15%)")
    print(f"Ray Train job wall time incl. start-up: {wall:.1f} s for {args.steps} steps")

    torch.set_num_threads(args.threads)
    big = build_debug_model("qwen3_moe", tmp / "big", dtype="float32", hidden_size=args.hidden,
                            moe_intermediate_size=args.hidden // 2, num_experts=32,
                            num_experts_per_tok=4, num_hidden_layers=2, head_dim=32)
    for targets in (["attention"], ["attention", "experts"]):
        eager = experts_fwd_bwd("eager", big, targets)
        grouped = experts_fwd_bwd("grouped_mm", big, targets)
        name = "+".join(targets)
        print(f"fwd+bwd, LoRA on {name:18s} eager (baseline): {eager * 1e3:8.1f} ms")
        print(f"fwd+bwd, LoRA on {name:18s} grouped_mm      : {grouped * 1e3:8.1f} ms  "
              f"speed-up {eager / grouped:.2f}x")

if __name__ == "__main__":
    main()
