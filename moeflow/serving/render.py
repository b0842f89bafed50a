"""What the serving search writes: serving.yaml, the same settings for vLLM and Ray
Serve LLM, the comparison table and the plots.

    serving.yaml           chosen knobs under the deploy: section's names (deploy applies it)
    vllm_serve_args.txt    `vllm serve` command line with the same engine settings
    ray_serve_llm.yaml     a Ray Serve LLM `LLMConfig` dict (engine_kwargs, deployment_config)
"""

from __future__ import annotations

import io
import shlex
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from rich.console import Console
from rich.table import Table

from moeflow.core.sections.deploy import DeploySection
from moeflow.serving.tune import Candidate
from moeflow.serving.tune_space import ENGINE_KNOBS

# The engine knobs vLLM has under the same name. vLLM 0.29's EngineArgs / SchedulerConfig have
# no max_num_partial_prefills / max_long_partial_prefills (concurrent partial prefills, vLLM's
# V0 scheduler; `vllm serve` refuses the flags): those stay the local engine's.
VLLM_ENGINE_KNOBS = tuple(k for k in ENGINE_KNOBS
                          if k not in ("max_num_partial_prefills", "max_long_partial_prefills"))


def deploy_knobs(knobs: dict) -> dict:
    """The knobs the deploy: section has (serving.yaml keys), in search order."""

    return {k: v for k, v in knobs.items() if k in DeploySection.model_fields}


def serving_yaml(knobs: dict, note: str) -> str:
    """serving.yaml text: a comment saying where it came from, then deploy: knobs."""
    head = "".join(f"# {line}\n" for line in note.splitlines())
    return head + yaml.safe_dump(deploy_knobs(knobs), sort_keys=False)


def _engine_kwargs(knobs: dict, *, max_model_len: int | None, lora_rank: int | None,
                   max_loras: int, plan: dict, max_cpu_loras: int | None = None) -> dict:
    """vLLM engine arguments (EngineArgs names) for the chosen knobs; with LoRA, the adapter
    tiers as deploy: has them (max_cpu_loras unset: 4 x max_loras, the local backend's default)."""
    kw = {k: knobs[k] for k in VLLM_ENGINE_KNOBS if knobs.get(k) is not None}
    if kw.get("long_prefill_token_threshold") is None:
        # moeflow's engine caps a prompt's chunk at half the step budget when unset; say so to vLLM
        kw["long_prefill_token_threshold"] = max(1, knobs["max_num_batched_tokens"] // 2)
    if max_model_len:
        kw["max_model_len"] = int(max_model_len)
        # vLLM refuses a threshold above max_model_len (SchedulerConfig); a prompt is never longer
        kw["long_prefill_token_threshold"] = min(kw["long_prefill_token_threshold"], int(max_model_len))
    if lora_rank:
        kw.update(enable_lora=True, max_loras=max_loras, max_lora_rank=int(lora_rank),
                  max_cpu_loras=max_cpu_loras if max_cpu_loras is not None else 4 * max_loras)
    tp, pp, ep = (int(plan.get(k) or 1) for k in ("tensor_parallel", "pipeline_parallel", "expert_parallel"))
    kw.update(tensor_parallel_size=tp, pipeline_parallel_size=pp)
    if ep > 1:
        kw["enable_expert_parallel"] = True
    return kw


def vllm_args(knobs: dict, *, model: str, served_name: str, adapters: dict[str, str],
              max_model_len: int | None, lora_rank: int | None, max_loras: int, plan: dict,
              max_cpu_loras: int | None = None) -> str:
    """A `vllm serve` command line (one replica; replicas are Serve's, or --data-parallel-size)."""
    kw = _engine_kwargs(knobs, max_model_len=max_model_len, lora_rank=lora_rank,
                        max_loras=max_loras, plan=plan, max_cpu_loras=max_cpu_loras)
    parts = ["vllm", "serve", model, "--served-model-name", served_name]
    for key, value in kw.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            parts.append(flag if value else "--no-" + key.replace("_", "-"))
        else:
            parts += [flag, str(value)]
    if knobs.get("num_replicas", 1) > 1:
        parts += ["--data-parallel-size", str(knobs["num_replicas"])]
    if adapters and lora_rank:
        parts += ["--lora-modules", *(f"{n}={p}" for n, p in adapters.items())]
    return " ".join(shlex.quote(p) for p in parts)


def ray_llm_config(knobs: dict, *, model: str, served_name: str, max_model_len: int | None,
                   lora_rank: int | None, max_loras: int, plan: dict,
                   accelerator_type: str | None = None, max_cpu_loras: int | None = None) -> dict:
    """A Ray Serve LLM `LLMConfig` as a dict (ray.serve.llm.LLMConfig(**it) on a GPU cluster).

    Adapters are not listed: LLMConfig's lora_config loads them from a cloud URI
    (dynamic_lora_loading_path), which a local adapter dir is not.
    """
    replicas = int(knobs.get("num_replicas") or 1)
    cfg: dict[str, Any] = {"model_loading_config": {"model_id": served_name, "model_source": model},
           "engine_kwargs": _engine_kwargs(knobs, max_model_len=max_model_len, lora_rank=lora_rank,
                                           max_loras=max_loras, plan=plan, max_cpu_loras=max_cpu_loras),
           "deployment_config": {
               "autoscaling_config": {"min_replicas": replicas, "max_replicas": replicas,
                                      "target_ongoing_requests": int(knobs["max_num_seqs"])},
               "max_ongoing_requests": int(knobs["max_ongoing_requests"])}}
    if accelerator_type:
        cfg["accelerator_type"] = accelerator_type
    return cfg


# ------------------------------------------------------------------ table and plots


def _ms(v) -> str:
    return "-" if v is None else f"{v:.0f}"


def table_rows(cands: list[Candidate], chosen: Candidate) -> list[list[str]]:
    rows = []
    for c in cands:
        run = c.best_run() or {}
        k = c.knobs
        knobs = (f"seqs {k['max_num_seqs']} tok {k['max_num_batched_tokens']} "
                 f"chunk {'on' if k['enable_chunked_prefill'] else 'off'} "
                 f"thr {k.get('long_prefill_token_threshold') or '-'} "
                 f"long {k.get('max_long_partial_prefills', 1)} rep {k['num_replicas']} "
                 f"ongoing {k['max_ongoing_requests']}")
        mark = "*" if c is chosen else ""
        measured = bool(run)  # a candidate the budget left unprobed has no numbers
        rows.append([mark + c.name, knobs, f"{run['request_goodput']:.2f}" if measured else "-",
                     f"{100 * run['slo_attainment']:.0f}%" if measured else "-", _ms(run.get("p99_ttft_ms")),
                     _ms(run.get("p99_tpot_ms")), _ms(run.get("p99_e2el_ms")),
                     "-" if c.max_rate is None else f"{c.max_rate:.1f}",
                     "final" if c.final else ("dropped" if c.dropped else "probe")])
    return rows


HEADERS = ["candidate", "settings", "goodput req/s", "SLO attained", "p99 TTFT ms", "p99 TPOT ms",
           "p99 E2EL ms", "max rate req/s", "stage"]


def table_text(cands: list[Candidate], chosen: Candidate, title: str) -> str:
    """The comparison table as plain text (terminal and MLflow)."""

    table = Table(title=title)
    for h in HEADERS:
        table.add_column(h)
    for row in table_rows(cands, chosen):
        table.add_row(*row)
    console = Console(width=200, record=True, file=io.StringIO(), highlight=False, markup=False)
    console.print(table)
    return console.export_text()


def plot_rates(cands: list[Candidate], path: Path, target_rate: float):
    """Goodput vs request rate, one line per finalist (the diagonal: every request good)."""
    # lazy: matplotlib: heavy, loaded only when this runs
    import matplotlib

    matplotlib.use("Agg")
    # lazy: matplotlib: heavy, loaded only when this runs
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    top = target_rate
    for c in cands:
        if c.rates:
            xs, ys = [p["rate"] for p in c.rates], [p["goodput"] for p in c.rates]
            ax.plot(xs, ys, marker="o", label=c.name)
            top = max(top, *xs)
    ax.plot([0, top], [0, top], "k:", linewidth=0.8, label="all requests good")
    ax.axvline(target_rate, color="grey", linestyle="--", linewidth=0.8)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("goodput (req/s meeting every SLO)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    return fig


def plot_cdfs(cands: list[Candidate], path: Path, slo: dict[str, float]):
    """TTFT and TPOT CDFs of each finalist's longest run, SLO limits dashed."""
    # lazy: matplotlib: heavy, loaded only when this runs
    import matplotlib

    matplotlib.use("Agg")
    # lazy: matplotlib: heavy, loaded only when this runs
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in ((axes[0], "ttft", "TTFT (ms)"), (axes[1], "tpot", "TPOT (ms)")):
        for c in cands:
            values = np.sort(np.asarray(c.samples.get(key) or []))
            if values.size:
                ax.plot(values, np.arange(1, values.size + 1) / values.size, label=c.name)
        if key in slo:
            ax.axvline(slo[key], color="grey", linestyle="--", linewidth=0.8)
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of requests")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    return fig
