"""lm-evaluation-harness tasks in a suite, run against a deployed endpoint.

A suite task of type `lm_eval` names a directory of lm-eval task YAML + local
data (relative to the suite file) and a task name in it::

    - name: next_letter_lmeval
      type: lm_eval
      task_dir: lmeval/next_letter_mc
      task: next_letter_mc
      metric: acc

It runs only with the endpoint runner: `lm_eval.simple_evaluate` with lm-eval's
own `local-completions` model against `<url>/v1/completions` (token-id prompts,
echo + logprobs), tokenising with the served model's local HF tokenizer. Its
metric and stderr become ours, so baselines and gates treat it like any task.
Every file under `task_dir` is hashed (the YAML decides what the data mean).

No network: datasets load from local files (`dataset_path: json` +
`data_files`), with HF_DATASETS_OFFLINE / HF_HUB_OFFLINE set.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from importlib.util import find_spec
from pathlib import Path

import yaml

from moeflow.core.errors import UserError
from moeflow.evaluation.scoring import Metric

EXTRA_HINT = "pip install moeflow[lmeval]"
API_PACKAGES = ("aiohttp", "tqdm", "tenacity", "requests")  # lm-eval[api]


def require_lm_eval():
    """Import lm_eval or raise a UserError naming the extra that provides it."""

    try:
        import lm_eval  # noqa: F401
        from lm_eval.tasks import TaskManager  # noqa: F401
    except ImportError as exc:
        raise UserError(f"lm_eval tasks need lm-evaluation-harness ({EXTRA_HINT}): "
                        f"{exc}") from None
    # lm-eval's API models (local-completions) need its `api` extra as well
    missing = [p for p in API_PACKAGES if find_spec(p) is None]
    if missing:
        raise UserError(f"lm_eval tasks need lm-eval's API model packages, missing: "
                        f"{', '.join(missing)} ({EXTRA_HINT}, i.e. lm-eval[api])")
    return lm_eval


class _Tagged:
    """A node under a custom YAML tag (lm-eval's `!function utils.fn`), kept verbatim."""

    def __init__(self, tag: str, value, kind: type):
        self.tag, self.value, self.kind = tag, value, kind


class _TagLoader(yaml.SafeLoader):
    """safe_load that keeps custom-tag nodes as `_Tagged` instead of failing."""


class _TagDumper(yaml.SafeDumper):
    """safe_dump that writes `_Tagged` nodes back under their own tag."""


def _construct_tagged(loader, _suffix, node):
    if isinstance(node, yaml.ScalarNode):
        return _Tagged(node.tag, loader.construct_scalar(node), yaml.ScalarNode)
    if isinstance(node, yaml.SequenceNode):
        return _Tagged(node.tag, loader.construct_sequence(node, deep=True), yaml.SequenceNode)
    return _Tagged(node.tag, loader.construct_mapping(node, deep=True), yaml.MappingNode)


def _represent_tagged(dumper, data: _Tagged):
    if data.kind is yaml.ScalarNode:
        return dumper.represent_scalar(data.tag, data.value)
    if data.kind is yaml.SequenceNode:
        return dumper.represent_sequence(data.tag, data.value)
    return dumper.represent_mapping(data.tag, data.value)


_TagLoader.add_multi_constructor("!", _construct_tagged)
_TagDumper.add_representer(_Tagged, _represent_tagged)


def _localise(task_dir: Path, out: Path) -> None:
    """Copy the task dir, making relative `data_files` absolute (relative to the YAML).

    Why: HF `datasets` resolves relative data_files against the process's
    working dir, not the YAML's; lm-eval has no option for that. Custom tags
    (`!function`) are kept as written: a YAML that uses them is rewritten too.

    Raises:
        UserError: a task YAML that is not valid YAML (file named).
    """
    shutil.copytree(task_dir, out, dirs_exist_ok=True)
    for src in task_dir.rglob("*.y*ml"):
        try:
            cfg = yaml.load(src.read_text(), Loader=_TagLoader)  # noqa: S506 (safe + tags)
        except yaml.YAMLError as exc:
            raise UserError(f"{src}: invalid YAML: {str(exc).splitlines()[0]}") from None
        kwargs = cfg.get("dataset_kwargs") if isinstance(cfg, dict) else None
        files = kwargs.get("data_files") if isinstance(kwargs, dict) else None
        if not files or not isinstance(kwargs, dict):  # (files implies a dict: said for mypy)
            continue
        fix = lambda f: f if Path(f).is_absolute() else str((src.parent / f).resolve())  # noqa: E731, B023
        if isinstance(files, str):
            files = fix(files)
        elif isinstance(files, list):
            files = [fix(f) for f in files]
        else:
            files = {k: fix(v) if isinstance(v, str) else [fix(f) for f in v]
                     for k, v in files.items()}
        kwargs["data_files"] = files
        (out / src.relative_to(task_dir)).write_text(
            yaml.dump(cfg, Dumper=_TagDumper, sort_keys=False))


def run_lm_eval_task(task, base_url: str, model: str, tokenizer: str | None) -> dict:
    """Run one `lm_eval` suite task against `<base_url>/v1/completions`.

    Args:
        task: the loaded suite `Task` (spec.task_dir resolved in `task.path`).
        base_url: server root or `/v1` URL; model: served model name.
        tokenizer: local HF tokenizer dir of the served model.

    Returns:
        {"metrics": {name: (value, stderr)}, "samples": [...], "n": int, "higher_is_better": {...}}
    """
    spec = task.spec
    if not tokenizer:
        raise UserError(f"task {task.name}: lm_eval tasks need the served model's local "
                        f"tokenizer dir (suite key `tokenizer` or evaluate_endpoint(tokenizer=...))")
    if not Path(tokenizer).is_dir():
        raise UserError(f"task {task.name}: tokenizer dir not found: {tokenizer}")
    require_lm_eval()
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # lazy: lm_eval: optional dependency
    import lm_eval
    from lm_eval.tasks import TaskManager

    url = base_url.rstrip("/")
    url = (url if url.endswith("/v1") else url + "/v1") + "/completions"
    with tempfile.TemporaryDirectory(prefix="mf-lmeval-") as tmp:
        _localise(task.path, Path(tmp) / "tasks")
        manager = TaskManager(include_path=str(Path(tmp) / "tasks"), include_defaults=False)
        if spec.task not in manager.all_tasks:
            raise UserError(f"task {task.name}: lm-eval task {spec.task!r} not found in "
                            f"{task.path} (found: {', '.join(sorted(manager.all_tasks)) or 'none'})")
        model_args = {"model": model, "base_url": url, "tokenizer_backend": "huggingface",
                      "tokenizer": str(tokenizer), "tokenized_requests": True,
                      "num_concurrent": 1, "max_retries": 1, "seed": 1234}
        try:
            out = lm_eval.simple_evaluate(
                model="local-completions", model_args=model_args, tasks=[spec.task],
                task_manager=manager, limit=spec.limit, num_fewshot=spec.num_fewshot,
                log_samples=True, bootstrap_iters=1000,  # mean metrics: closed-form stderr
                random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)
        except Exception as exc:  # lm-eval wraps HTTP/tokenizer failures in many types
            first = (str(exc).strip().splitlines() or [""])[0]
            raise UserError(f"task {task.name}: lm-eval run against {url} failed: "
                            f"{type(exc).__name__}: {first}") from exc  # cause kept for logs
    return _parse(task, out)


def _parse(task, out: dict) -> dict:
    """lm-eval's result dict -> metric (value, stderr) pairs of one task."""
    name = task.spec.task
    res = (out or {}).get("results", {}).get(name)
    if res is None:
        raise UserError(f"task {task.name}: lm-eval returned no results for {name!r}")
    hib = out.get("higher_is_better", {}).get(name, {})
    metrics, better = {}, {}
    for key, value in res.items():
        metric, _, filt = key.partition(",")
        if metric.endswith("_stderr") or not isinstance(value, (int, float)) or not filt:
            continue
        stderr = res.get(f"{metric}_stderr,{filt}")
        stderr = float(stderr) if isinstance(stderr, (int, float)) else None
        ours = metric if filt == "none" else f"{metric}_{filt}"
        metrics[ours] = (float(value), stderr)
        better[ours] = bool(hib.get(metric, True))
    if task.spec.metric not in metrics:
        raise UserError(f"task {task.name}: lm-eval task {name!r} has no metric "
                        f"{task.spec.metric!r} (has: {', '.join(sorted(metrics))})")
    samples = [{"index": s.get("doc_id"), "target": s.get("target"),
                "logliks": [r[0] for r in s.get("filtered_resps", []) if isinstance(r, (list, tuple))],
                **{m: s[m] for m in metrics if m in s and isinstance(s[m], (int, float))}}
               for s in out.get("samples", {}).get(name, [])]
    return {"metrics": metrics, "samples": json.loads(json.dumps(samples, default=str)),
            "higher_is_better": better}


def score_lm_eval(task, raw: dict):
    """Our `Metric`s from a `run_lm_eval_task` output; only `spec.metric` gates.

    Returns:
        (metrics by name, per-sample rows) like `scoring.score_task`.
    """

    metrics = {m: Metric(v, se, higher_is_better=raw["higher_is_better"][m],
                         gate=(m == task.spec.metric))
               for m, (v, se) in raw["metrics"].items()}
    return metrics, raw["samples"]
