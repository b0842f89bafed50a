"""Where a stage's tensors live and in which dtype: from Ray resources, CUDA and the plan.

Library code never assumes CPU. The rules, in one place:
  - a Ray task/actor computes on the GPUs Ray assigned to it (`ray.get_gpu_ids()`), at
    their positions in CUDA_VISIBLE_DEVICES: usually that lists only them (`cuda:0`), but
    Ray Train's workers on one node share one list of all their GPUs (worker 3 of 8 is
    `cuda:3`, not `cuda:0`); outside Ray, whatever `torch.cuda` sees;
  - "auto" dtype means bfloat16 on a GPU that supports it (float16 on one that does not)
    and float32 on CPU, where bf16 matmuls are slower and inexact;
  - collectives: NCCL between GPUs, gloo on CPU;
  - "auto" GPU requests: one GPU per worker/replica/shard when the Ray cluster has GPUs.

    python -c "from moeflow.core.devices import describe; print(describe())"
"""

from __future__ import annotations

import os
from typing import Any

from moeflow.core.errors import UserError

DTYPES = ("float32", "bfloat16", "float16")


def cuda_available() -> bool:
    """True when torch sees a usable CUDA device in this process."""
    # lazy: torch: heavy, loaded only when this runs
    import torch

    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def cluster_gpus() -> float:
    """GPUs in the connected Ray cluster (0 when Ray is not initialised)."""
    # lazy: ray: heavy, loaded only when this runs
    import ray

    if not ray.is_initialized():
        return 0.0
    return float(ray.cluster_resources().get("GPU", 0))


def assigned_gpus() -> list:
    """GPU ids Ray assigned to the current task/actor ([] outside Ray or with none)."""
    # lazy: ray: heavy, loaded only when this runs
    import ray

    if not ray.is_initialized():
        return []
    try:
        return list(ray.get_gpu_ids())
    except Exception:  # the driver of a client connection has no worker context
        return []


def want_gpu(setting: bool | str = "auto", workers: int = 1) -> bool:
    """Whether a stage should request GPUs (one per worker).

    Args:
        setting: True/False (explicit) or "auto": yes when the Ray cluster has a GPU for
            each of `workers` (fewer would leave workers waiting forever), or, without
            Ray, when torch sees that many.
        workers: how many workers would each hold one.
    Returns:
        bool.
    """
    if setting != "auto":
        return bool(setting)
    # lazy: ray: heavy, loaded only when this runs
    import ray

    if ray.is_initialized():
        return cluster_gpus() >= max(1, workers)
    # lazy: torch: heavy, loaded only when this runs
    import torch

    return cuda_available() and torch.cuda.device_count() >= max(1, workers)


def gpus_per_worker(setting: bool | float | str = "auto") -> float:
    """`num_gpus` for one Ray task/actor/replica: a number is taken as is, True is 1,
    "auto" is 1 when the cluster has GPUs, else 0."""
    if isinstance(setting, (int, float)) and not isinstance(setting, bool):
        return float(setting)
    return 1.0 if want_gpu(setting) else 0.0


def local_device(index: int = 0):
    """The torch device this process should compute on.

    Inside a Ray task/actor with GPUs assigned, the `index`-th of its assigned GPUs, at
    its position in CUDA_VISIBLE_DEVICES (`visible_index`); a Ray worker without
    assigned GPUs computes on CPU even on a GPU host (the GPU belongs to another task);
    outside Ray, `cuda:<index>` when CUDA is available.
    """
    # lazy: ray, torch: heavy, loaded only when this runs
    import ray
    import torch

    in_worker = ray.is_initialized() and _in_ray_worker()
    if in_worker:
        ids = assigned_gpus()
        if not ids or not cuda_available():
            return torch.device("cpu")
        if index >= len(ids):
            raise ValueError(f"local_device({index}): Ray assigned this worker {len(ids)} GPU(s)")
        return torch.device("cuda", visible_index(ids[index]))
    return torch.device("cuda", index) if cuda_available() else torch.device("cpu")


def visible_index(gpu_id) -> int:
    """The CUDA ordinal of Ray GPU `gpu_id` in this process: its position in
    CUDA_VISIBLE_DEVICES (Ray sets it; a Ray Train worker sees all its node's workers'
    GPUs). Without the variable, ids are ordinals already."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    listed = [v.strip() for v in visible.split(",") if v.strip()] if visible != "NoDevFiles" else []
    if not listed:
        return int(gpu_id) if str(gpu_id).isdigit() else 0
    try:
        return listed.index(str(gpu_id))
    except ValueError:
        raise RuntimeError(f"Ray assigned GPU {gpu_id} but CUDA_VISIBLE_DEVICES={visible!r} does not "
                           f"list it (was it overridden?)") from None


def _in_ray_worker() -> bool:
    # lazy: ray: heavy, loaded only when this runs
    import ray

    try:
        return ray.get_runtime_context().worker.mode == ray.WORKER_MODE
    except Exception:
        return False


def resolve_dtype(setting: str | None, device) -> Any:
    """torch dtype for `setting` on `device`.

    Args:
        setting: "auto"/None (device default) or one of DTYPES.
        device: torch.device or str.
    Returns:
        torch.dtype: "auto" is bfloat16 on a GPU (float16 where bf16 is unsupported)
        and float32 on CPU.
    """
    # lazy: torch: heavy, loaded only when this runs
    import torch

    if setting not in (None, "auto"):
        if setting not in DTYPES:
            raise UserError(f"dtype must be auto or one of {', '.join(DTYPES)} (got {setting!r})")
        return getattr(torch, setting)
    if torch.device(device).type != "cuda":
        return torch.float32
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def dist_backend(use_gpu: bool) -> str:
    """torch.distributed backend: NCCL between GPUs, gloo on CPU."""
    return "nccl" if use_gpu else "gloo"


def to_device(inputs: dict, device) -> dict:
    """`inputs` with every tensor value moved to `device` (others unchanged)."""
    # lazy: torch: heavy, loaded only when this runs
    import torch

    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def model_device(model):
    """The device of a model's first parameter (CPU for a parameterless module)."""
    # lazy: torch: heavy, loaded only when this runs
    import torch

    try:
        return next(model.parameters()).device
    except StopIteration:
        return torch.device("cpu")


def seeded_generator(seed: int, device):
    """A torch.Generator on `device` (sampling with it must happen on the same device)."""
    # lazy: torch: heavy, loaded only when this runs
    import torch

    return torch.Generator(device=device).manual_seed(seed)


def describe() -> dict:
    """What this process would use: device, auto dtype, backend, visible GPUs."""
    dev = local_device()
    return {"device": str(dev), "dtype": str(resolve_dtype("auto", dev)).replace("torch.", ""),
            "backend": dist_backend(dev.type == "cuda"), "cuda_available": cuda_available(),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "ray_gpus": assigned_gpus()}
