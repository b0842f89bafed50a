"""What a deployment serves: the one decision the deploy stage, `moeflow deploy` / `moeflow serve`
and the vLLM backend share.

    dep = decide(cfg, {"convert": ..., "finetune": ..., "calibrate": ..., "operators": ...,
                       "serving": ...})
    dep.checkpoint, dep.adapters, dep.merge, dep.dtype, dep.serving_yaml, ...

`decide` is pure: it reads the config and the upstream stages' records (no files, no Ray, no
MLflow) and returns a frozen `Deployment`. How each backend then runs it -- moeflow's engine on
Ray Serve (moeflow.serving.launch) or a Ray Serve LLM app (moeflow.serving.vllm_backend) -- is
theirs. The serving.yaml helpers below are pure too: they apply the serving stage's tuned engine
knobs to `deploy:`, explicit `deploy:` keys winning.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import ValidationError

from moeflow.core.config import PipelineConfig
from moeflow.core.errors import UserError

# prefill_keys_per_token and max_long_partial_prefills are the local engine's: the vLLM render
# (vllm_backend.engine_kwargs) takes vLLM's arguments by name, so neither reaches vLLM's args
ENGINE_KEYS = ("max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill",
               "long_prefill_token_threshold", "max_long_partial_prefills", "prefill_keys_per_token",
               "max_model_len", "max_loras")
SERVING_KEYS = ENGINE_KEYS + ("num_replicas", "max_ongoing_requests")  # what serving.yaml may set

Record = Mapping[str, Any]  # an upstream stage's result record


@dataclass(frozen=True)
class Deployment:
    """What is served, decided once (see `decide`)."""

    backend: Literal["local", "vllm"]
    checkpoint: str  # the base served: converted, calibrated (quantised), or model.path
    weights: Literal["converted", "calibrated", "model"]  # where `checkpoint` comes from
    adapter: tuple[str, str] | None  # the run's fine-tuned adapter: (name, dir or models:/ URI)
    adapters: Mapping[str, str] = field(default_factory=dict)  # all served: name -> dir or URI
    merge: str | None = None  # the adapter served merged into the base (deploy.merge)
    merged_dirs: Mapping[str, str] = field(default_factory=dict)  # finetune.merge's checkpoints
    served_model_name: str | None = None  # None: the checkpoint directory's name
    dtype: str = "auto"  # serving precision (deploy.dtype)
    merge_dtype: str = "float32"  # precision a merge is written in (model.dtype)
    serving_yaml: str | None = None  # engine knobs to apply (deploy.serving_config, else the serving stage's)
    experts_implementation: str | None = None  # the operators stage's serving kernel (None: default)
    ep_size: int = 1  # the EP size the operators stage placed experts for
    lora_uri: str | None = None  # vllm: cloud prefix replicas load LoRA adapters from

    @property
    def mode(self) -> str:
        """"merged" (an adapter folded into the base) or "shared" (base + LoRA adapters)."""
        return "merged" if self.merge else "shared"


def decide(cfg: PipelineConfig, records: Mapping[str, Record | None], *,
           backend: Literal["local", "vllm"] | None = None, merge: str | None = None) -> Deployment:
    """The deployment of a run (or, without a convert record, of `model.path`).

    Args:
        cfg: pipeline config (`deploy:`, `model:`).
        records: upstream result records by stage: convert (absent: serve model.path, as
            `moeflow serve` does), finetune, calibrate, operators, serving; any may be missing.
        backend: overrides deploy.backend (auto: the backend the plan stage chose).
        merge: with deploy.merge, the adapter to merge (default: the run's fine-tuned one).
    Raises:
        UserError: the local engine for a model the plan found too large for one device;
            deploy.backend auto without the plan's choice; deploy.weights calibrated without
            a usable quantised checkpoint; deploy.merge with nothing to merge; a name served twice with two sources;
            a models:/ adapter for the vllm backend.
    """
    d = cfg.deploy
    backend = backend or resolved_backend(cfg, records)
    _refuse_too_large(backend, records)
    ft = records.get("finetune") or {}
    checkpoint, weights = _checkpoint(cfg, records, backend)
    adapter = _fine_tuned(ft)
    adapters = _adapters(adapter, tenant_adapters(ft), d.adapters, backend)
    for name in d.pinned_adapters:  # pinned ones must be served (deploy.pinned_adapters)
        if name not in adapters:
            raise UserError(f"deploy.pinned_adapters: {name!r} is not a served adapter "
                            f"(served: {', '.join(adapters) or 'none'})")
    target = None
    if d.merge:
        target = merge or (adapter[0] if adapter else None)
        if target is None:
            raise UserError("deploy.merge: there is no fine-tuned adapter to merge")
    merged = {adapter[0]: str(ft["merged_dir"])} if adapter and ft.get("merged_dir") else {}
    operators = records.get("operators")
    return Deployment(
        backend=backend, checkpoint=checkpoint, weights=weights, adapter=adapter, adapters=adapters,
        merge=target, merged_dirs=merged,
        # default name: the original checkpoint's directory (what vLLM would call it), not "converted"
        served_model_name=d.served_model_name or Path(cfg.model.path).name or None,
        dtype=d.dtype, merge_dtype=cfg.model.dtype,
        serving_yaml=serving_yaml(cfg, records),
        experts_implementation=serving_experts_impl(operators), ep_size=placement_ep(operators),
        lora_uri=d.lora_uri or ft.get("lora_uri"))


def resolved_backend(cfg: PipelineConfig, records: Mapping[str, Record | None]) -> Literal["local", "vllm"]:
    """deploy.backend, with auto replaced by the plan stage's choice (tasks/plan.py serving_plan).

    A pipeline's deploy always has its plan record (plan is upstream of deploy); without any
    (no run: a checkpoint served as given, tests) auto is the local engine, as `moeflow serve`
    is, which checks the model's size itself (workflows/commands/deploy.py).
    """
    if cfg.deploy.backend != "auto":
        return cfg.deploy.backend
    if not records.get("plan"):
        return "local"
    chosen = _plan_serving(records).get("backend")
    if chosen not in ("local", "vllm"):
        raise UserError("deploy.backend auto: the run's plan record does not say which backend fits "
                        "(rerun its plan stage with this version, or set deploy.backend local or vllm)")
    return chosen


def _plan_serving(records: Mapping[str, Record | None]) -> Record:
    return ((records.get("plan") or {}).get("plan") or {}).get("serving") or {}


def _refuse_too_large(backend: str, records: Mapping[str, Record | None]) -> None:
    """The local engine holds the whole model on one device: never start it on a model the
    plan found larger than that (one line naming the limit, before anything starts)."""
    s = _plan_serving(records)
    if backend == "local" and s.get("local_fits") is False:
        from moeflow.parallel.vllm_plan import local_limit  # the planner's modules: only for this line

        raise UserError(local_limit(s["local_memory_gb"] * 1e9, s["device_gb"] * 1e9))


def serving_yaml(cfg: PipelineConfig, records: Mapping[str, Record | None]) -> str | None:
    """The serving.yaml whose engine knobs apply: deploy.serving_config, else the serving stage's."""
    path = cfg.deploy.serving_config or (records.get("serving") or {}).get("serving_yaml")
    return str(path) if path else None


def _checkpoint(cfg: PipelineConfig, records: Mapping[str, Record | None],
                backend: str) -> tuple[str, Literal["converted", "calibrated", "model"]]:
    """(base to serve, where from). No convert record: model.path as given (`moeflow serve`)."""
    convert = records.get("convert")
    if not convert:
        return cfg.model.path, "model"
    if cfg.deploy.weights == "calibrated":  # the quantised checkpoint (compressed-tensors)
        # vLLM runs every scheme's compressed-tensors checkpoint; moeflow's engine (transformers)
        # only the natively loadable ones
        return calibrated_checkpoint(records.get("calibrate"), native=backend == "local"), "calibrated"
    return str(convert["output_dir"]), "converted"


def _fine_tuned(ft: Record) -> tuple[str, str] | None:
    """(name, source) of the run's fine-tuned adapter: its dir, else its registered version."""
    source = ft.get("adapter_dir")
    if not source and ft.get("registered_model") and ft.get("model_version"):
        source = f"models:/{ft['registered_model']}/{ft['model_version']}"
    return (ft.get("adapter_name") or "adapter", str(source)) if source else None


def _adapters(adapter: tuple[str, str] | None, tenants: Mapping[str, str], extra: Mapping[str, str],
              backend: str) -> dict[str, str]:
    """Every adapter served, in order: the fine-tuned one, its tenants, then deploy.adapters."""
    out: dict[str, str] = dict([adapter]) if adapter else {}
    for name, src in tenants.items():
        out.setdefault(name, src)
    for name, src in extra.items():
        if out.get(name, src) != src:
            raise UserError(f"deploy.adapters.{name}: {src} -- the run's adapter {name!r} is "
                            f"{out[name]}; name this one differently")
        out[name] = src
    if backend == "vllm":
        for name, src in out.items():
            if src.startswith("models:/"):
                where = f"deploy.adapters.{name}" if name in extra else f"adapter {name!r}"
                raise UserError(f"{where}: {src} — the vllm backend reads adapters from local dirs "
                                f"it copies to deploy.lora_uri; download it first")
    return out


def calibrated_checkpoint(record: Record | None, native: bool = True) -> str:
    """The quantised checkpoint for `deploy.weights: calibrated` (UserError when unusable).

    Args:
        record: the calibrate stage's result record.
        native: the server loads it with transformers (moeflow's engine): the scheme must be
            one transformers loads.
    """
    if not record or not record.get("checkpoint"):
        raise UserError("deploy.weights: calibrated needs the calibrate stage's result; "
                        "enable the calibrate stage")
    if native:
        from moeflow.quant.schemes import get_scheme  # imports torch: only when it is asked

        scheme = get_scheme(record["scheme"])
        if not scheme.native:
            raise UserError(f"deploy.weights: calibrated: scheme {scheme.name} is not loadable by "
                            f"transformers (moeflow runs it with its own dequantising reader only); "
                            f"calibrate with fp8 or w8a16 to serve it")
    return str(record["checkpoint"])


def placement_ep(operators: Record | None) -> int:
    """The EP size the operators stage placed experts for (1: no such stage)."""
    return int((operators or {}).get("ep_size") or 1)


def serving_experts_impl(operators: Record | None) -> str | None:
    """The operators stage's experts implementation for serving (None: no such stage)."""
    impl = ((operators or {}).get("experts_implementation") or {}).get("serving")
    return str(impl) if impl else None


def tenant_adapters(finetune: Record | None) -> dict[str, str]:
    """{name: dir} of a finetune record's tenant adapters (finetune.adapters), main one excluded."""
    adapters = (finetune or {}).get("adapters") or {}
    return {name: a["adapter_dir"] for name, a in adapters.items() if a.get("tenant")}


# ------------------------------------------------------------ serving.yaml (the serving stage's knobs)


def read_serving_yaml(path: str | Path) -> dict[str, Any]:
    """The knobs of a serving.yaml (serving stage): deploy: names, flat or under `engine:`.
    A store URI (the serving stage's output with the workdir in a store) is read through the
    store layer: fetched, checked against its output's manifest, into this node's cache."""
    from moeflow.core import storage  # lazy: fsspec only when a serving.yaml is read

    where = str(path)
    storage.check_location(where, "deploy.serving_config")  # `s3:/b/x` is neither URI nor path
    if storage.is_uri(where):
        try:
            path = Path(storage.localize(where))
        except UserError as exc:
            raise UserError(f"deploy.serving_config: {exc}") from None
    path = Path(path)
    if not path.is_file():
        raise UserError(f"deploy.serving_config: {where} does not exist")
    tuned = yaml.safe_load(path.read_text()) or {}
    tuned = tuned.get("engine", tuned) if isinstance(tuned, dict) else None
    if not isinstance(tuned, dict):
        raise UserError(f"{where}: expected a mapping of engine settings")
    unknown = sorted(set(tuned) - set(SERVING_KEYS))
    if unknown:
        raise UserError(f"{where}: unknown engine setting {unknown[0]!r}; known: {', '.join(SERVING_KEYS)}")
    return tuned


def apply_serving(cfg: PipelineConfig, path: str | Path | None) -> tuple[PipelineConfig, dict[str, str]]:
    """`cfg` with serving.yaml's knobs applied, except those `deploy:` sets explicitly.

    Returns:
        (config, {knob: "serving.yaml" | "deploy (explicit, wins over serving.yaml)"}).
    """
    if not path:
        return cfg, {}
    tuned = read_serving_yaml(path)
    explicit = cfg.deploy.model_fields_set
    sources = {k: "deploy (explicit, wins over serving.yaml)" if k in explicit else "serving.yaml"
               for k in tuned}
    update = {k: v for k, v in tuned.items() if k not in explicit}
    update["serving_config"] = None  # applied; not again
    try:  # from the explicit fields only, so the result still knows which ones those are
        deploy_ = type(cfg.deploy).model_validate({**cfg.deploy.model_dump(exclude_unset=True), **update})
    except ValidationError as exc:
        err = exc.errors()[0]
        raise UserError(f"{path}: `{'.'.join(map(str, err['loc']))}`: {err['msg']}") from None
    return cfg.model_copy(update={"deploy": deploy_}), sources


def engine_settings(cfg: PipelineConfig) -> dict[str, Any]:
    """Engine knobs from `deploy:`, with the serving stage's serving.yaml applied if named."""
    cfg, _ = apply_serving(cfg, cfg.deploy.serving_config)
    return {k: getattr(cfg.deploy, k) for k in ENGINE_KEYS}
