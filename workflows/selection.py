"""What a pipeline run executes, decided before anything starts: which stages take part
(`--only`, `--from`, `--rerun`, `--stages`, plugins), their preflight checks, and the config
as Ray workers see it (paths made absolute).
"""

from __future__ import annotations

import difflib
import importlib
import json
from pathlib import Path
from typing import Mapping

import ray
from pydantic import BaseModel

from moeflow.core import storage
from moeflow.core import tracking as T
from moeflow.core.config import PipelineConfig
from moeflow.core.errors import UserError
from moeflow.core.sections import absolute_paths
from moeflow.core.storage.stage import StageIO
from moeflow.model.remote_code import refuse_untrusted
from tasks.base import StageSpec
from workflows import dag
from workflows.dag import registry


def _check_names(names, known: Mapping[str, StageSpec], what: str) -> None:
    for name in names:
        if name not in known:
            near = difflib.get_close_matches(name, list(known), n=1)
            hint = f" (did you mean {near[0]}?)" if near else ""
            raise UserError(f"{what}: unknown stage {name!r}{hint}; stages: {', '.join(known)}")


def select(stages: Mapping[str, StageSpec], cfg: PipelineConfig, *, targets=(), only=(),
           from_=(), rerun=()) -> tuple[list[str], set[str], set[str]]:
    """Which stages take part, which must be reused, which are forced to run.

    Returns:
        (selected in dependency order, must_reuse, forced)
    """
    enabled = list(cfg.stages.enabled) if cfg.stages.enabled is not None else list(stages)
    _check_names(enabled, stages, "stages.enabled")
    _check_names(cfg.stages.resources, stages, "stages.resources")
    for opt, names in (("--target", targets), ("--only", only), ("--from", from_),
                       ("--rerun", rerun)):
        _check_names(names, stages, opt)
    selected = set(enabled)
    must_reuse: set[str] = set()
    forced = set(rerun)
    if targets:
        selected = dag.upstream_closure(stages, set(targets))
    if only:
        selected = set(only)
        must_reuse = dag.upstream_closure(stages, set(only)) - selected
        forced |= set(only)
    elif from_:
        forced |= dag.downstream(stages, set(from_)) & selected
        must_reuse = dag.upstream_closure(stages, set(from_)) - forced
    for name in selected:
        for up in stages[name].upstream:
            if up not in selected and up not in must_reuse:
                raise UserError(f"stage {name} needs {up}, which is not enabled "
                                f"(add it to stages.enabled)")
    order = [n for n in stages if n in selected or n in must_reuse]
    return order, must_reuse, forced


def preflight(cfg: PipelineConfig, stages: Mapping[str, StageSpec], order: list[str]) -> None:
    """Cheap checks before anything starts (no MLflow run, no Ray)."""
    needs = [n for n in order if stages[n].needs_model]
    storage.check_location(cfg.model.path, "model.path")
    storage.check_writable(cfg.workdir, "workdir")  # a store URI: one probe object, before any run
    if needs and storage.is_uri(cfg.model.path):
        storage.check_readable(cfg.model.path, "model.path")
    elif needs and not Path(cfg.model.path).exists():
        raise UserError(f"model path not found: {cfg.model.path} (model.path; read by "
                        f"{', '.join(needs)})")
    if needs and (Path(cfg.model.path) / "config.json").is_file():  # a bad value: exit 2 before any run
        from moeflow.model.anatomy import check_config_values
        from moeflow.model.params import load_config_json

        check_config_values(load_config_json(cfg.model.path), f"{cfg.model.path}/config.json")
    if not order:
        raise UserError("no stages to run (stages.enabled is empty or no stage is installed)")
    # a checkpoint that needs its own code runs only when the user opted in
    if not storage.is_uri(cfg.model.path) and Path(cfg.model.path).exists():
        refuse_untrusted(cfg.model.path, cfg.model.trust_remote_code)
    checks = [check for n in order if (check := stages[n].preflight)]
    if checks:
        cfg = _fetched_for_preflight(cfg)
    for check in checks:
        check(cfg)


def _fetched_for_preflight(cfg: PipelineConfig) -> PipelineConfig:
    """The config with a store URI as model.path or data file replaced by this node's cached
    copy, for the stages' preflight checks (they read config.json, data lines): the model's
    a sparse copy, its configs and shard headers without the weights."""

    if not any(storage.is_uri(v) for v in (cfg.model.path, cfg.data.train_file, cfg.data.eval_file,
                                           *[f for t in cfg.finetune.adapters.values()
                                             for f in (t.train_file, t.eval_file)])):
        return cfg
    data, _ = StageIO(storage.join(cfg.workdir, "preflight", "x"), cfg.workdir).localize(
        cfg.model_dump(mode="json"), {}, model_by_ranges=True)  # checks read configs, not weights
    return _keep_fields_set(cfg, PipelineConfig.model_validate(data))




def absolutize(cfg: PipelineConfig) -> PipelineConfig:
    """Relative paths are relative to the driver's working directory; Ray
    workers may start elsewhere, so the runner passes absolute paths."""
    data = absolute_paths(PipelineConfig, cfg.model_dump(mode="json"))  # the fields typed as paths
    return _keep_fields_set(cfg, PipelineConfig.model_validate(data))


def _keep_fields_set(src, dst):
    """`dst` remembers which keys the user set in `src` (plus those changed here), so
    stages can tell an explicit setting from a default (deploy vs serving.yaml)."""

    if isinstance(src, BaseModel) and isinstance(dst, BaseModel):
        names = type(src).model_fields
        dst.__pydantic_fields_set__ = set(src.model_fields_set) | {
            n for n in names if getattr(src, n) != getattr(dst, n)}
        for n in names:
            _keep_fields_set(getattr(src, n), getattr(dst, n))
    elif isinstance(src, dict) and isinstance(dst, dict):
        for k in src.keys() & dst.keys():
            _keep_fields_set(src[k], dst[k])
    return dst


SELECTION_TAG = "moeflow.selection"  # the --only/--from/--rerun/targets a pipeline run was started with


def recorded_selection(cfg: PipelineConfig, run_id: str, given: dict) -> dict:
    """The selection `run_id` was started with, plus `given`'s (a resume's own --rerun)."""
    client = T.client_for(T.resolve_tracking_uri(cfg.tracking.uri))
    try:
        recorded = json.loads(T.get_pipeline_run(client, run_id).data.tags.get(SELECTION_TAG) or "{}")
    except json.JSONDecodeError:
        recorded = {}
    return {k: list(dict.fromkeys([*recorded.get(k, []), *given.get(k, [])])) for k in given}


def enable_only(cfg: PipelineConfig, names, stages: Mapping[str, StageSpec] | None = None
                ) -> PipelineConfig:
    """`moeflow run --stages A,B`: enable just the named stages and those they cannot run
    without (their `upstream`, transitively); optional upstreams (`after`) run only when
    named. Recorded as `stages.enabled`, so a resume keeps the selection."""
    if stages is None:
        stages = registry()
    specs = plugin_specs(stages, cfg)
    _check_names(list(names), specs, "--stages")
    needed = dag.upstream_closure(specs, set(names))  # unfolded: hard upstreams only
    enabled = cfg.stages.enabled
    off = sorted(n for n in needed if enabled is not None and n not in enabled)
    if off:
        raise UserError(f"--stages: {', '.join(off)} needed but not in stages.enabled")
    stages_cfg = cfg.stages.model_copy(update={"enabled": [n for n in specs if n in needed]})
    return cfg.model_copy(update={"stages": stages_cfg})


def with_plugins(stages: Mapping[str, StageSpec], cfg: PipelineConfig) -> dict[str, StageSpec]:
    """The stages plus `stages.plugins`, optional edges folded for what is enabled,
    in dependency order."""
    out = dag.with_optional_edges(plugin_specs(stages, cfg), cfg.stages.enabled)
    return {n: out[n] for n in dag.topological_order(out)}


def plugin_specs(stages: Mapping[str, StageSpec], cfg: PipelineConfig) -> dict[str, StageSpec]:
    """Add stages from `stages.plugins` modules (each defines STAGE or STAGES)."""
    out = dict(stages)
    for module_name in cfg.stages.plugins:
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise UserError(f"stages.plugins: cannot import {module_name!r}: {exc}") from None
        specs = list(getattr(module, "STAGES", [])) + [getattr(module, "STAGE", None)]
        specs = [s for s in specs if isinstance(s, StageSpec)]
        if not specs:
            raise UserError(f"stages.plugins: module {module_name} defines no STAGE/STAGES")
        ray.cloudpickle.register_pickle_by_value(module)  # workers need not import it
        for spec in specs:
            out[spec.name] = spec
    return out
