"""The checkpoints a finetune worker reports to Ray Train (moeflow.training.trainer) while
it trains a run's adapters in turn: their layout, each finished job's record (`save_job`),
and rank 0's `Reporter`, which copies every finished job into each checkpoint it reports,
so the run's last checkpoint holds every adapter and a restart skips the finished ones."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from moeflow.training import state as S
from moeflow.training.worker import AdapterState


def _report(metrics: dict, ckpt_dir: Path | None) -> None:
    # lazy: ray: heavy, loaded only when this runs
    import ray.train

    ckpt = ray.train.Checkpoint.from_directory(str(ckpt_dir)) if ckpt_dir else None
    ray.train.report(metrics, checkpoint=ckpt)


# The checkpoints of one Ray Train run that trains several adapters in turn (the main one,
# then each tenant: one set of worker processes, one base load):
#   PROGRESS.json        {"job": name, "step": steps done in it, "seq": reports so far}
#   adapter/, optimizer.safetensors, trainer_state.json   the running job's state (state.py)
#   jobs/<name>/         each finished adapter: adapter/, probe.safetensors, metrics.json
#   FINAL                every job finished (the run's last checkpoint)
PROGRESS, JOBS = "PROGRESS.json", "jobs"


def save_job(root: Path, name: str, w: AdapterState, final: dict[str, Any],
             ids: torch.Tensor | None, logits: torch.Tensor | None,
             whole: dict[str, torch.Tensor] | None = None) -> None:
    """A finished job's adapter (`whole`: gathered under TP), probe logits and metrics
    under root/jobs/<name>/."""
    out = root / JOBS / name
    out.mkdir(parents=True, exist_ok=True)
    S.save_adapter(w.model, out / "adapter", whole)
    if ids is not None and logits is not None:
        save_file({"input_ids": ids, "logits": logits.contiguous()}, str(out / "probe.safetensors"))
    (out / "metrics.json").write_text(json.dumps(final, default=float))


class Reporter:
    """Rank 0's record of finished jobs (copied into every checkpoint it reports, so the run's
    last checkpoint holds every adapter and a restart skips the finished ones)."""

    def __init__(self, rank: int):
        self.rank, self.seq = rank, 0
        self.done: Path | None = Path(tempfile.mkdtemp(prefix="mf-jobs-")) if rank == 0 else None

    def restore(self, d: Path) -> tuple[set[str], dict[str, Any]]:
        """(finished job names, PROGRESS) of a checkpoint directory."""
        if not (d / PROGRESS).is_file():  # written before runs trained several adapters: the first's
            return set(), {"job": None, "step": None, "seq": 0}
        progress = json.loads((d / PROGRESS).read_text())
        self.seq = int(progress.get("seq", 0))
        finished = {p.name for p in (d / JOBS).iterdir()} if (d / JOBS).is_dir() else set()
        if self.done is not None and finished:
            shutil.copytree(d / JOBS, self.done / JOBS, dirs_exist_ok=True)
        return finished, progress

    def report(self, metrics: dict[str, Any], job: str, step: int,
               write: Callable[[Path], object] | None = None, final: bool = False) -> None:
        """Every rank reports (Ray Train needs the same number of reports from each);
        rank 0 with a checkpoint: `write(dir)` adds the running job's files."""
        self.seq += 1
        if self.done is None:  # not rank 0
            _report(metrics, None)
            return
        with tempfile.TemporaryDirectory(prefix="mf-ckpt-") as tmp:
            root = Path(tmp)
            if write is not None:
                write(root)
            if (self.done / JOBS).is_dir():
                shutil.copytree(self.done / JOBS, root / JOBS, dirs_exist_ok=True)
            (root / PROGRESS).write_text(json.dumps({"job": job, "step": step, "seq": self.seq}))
            if final:
                (root / "FINAL").write_text(str(step))
            _report(metrics, root)

    def close(self) -> None:
        if self.done is not None:
            shutil.rmtree(self.done, ignore_errors=True)
