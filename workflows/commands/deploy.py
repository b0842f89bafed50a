"""`moeflow deploy` and `moeflow serve`: the OpenAI-compatible Ray Serve endpoint.

    moeflow deploy --run RUN_ID            # base + adapter of a finished pipeline run
    moeflow deploy --run RUN_ID --merge    # adapter merged into the base
    moeflow deploy --run RUN_ID --backend vllm --dry-run --out serve.yaml --lora-uri s3://b/adapters
                                           # Ray Serve LLM (vLLM) config for `serve deploy` / KubeRay
    moeflow serve configs/demo.yaml --adapter demo=work/adapter   # local, foreground

On a Ray cluster (RAY_ADDRESS / --address) `deploy` returns once the app is
up and smoke-tested; the app keeps serving. With a local in-process Ray both
commands keep the endpoint in the foreground until Ctrl-C.
"""

from __future__ import annotations

import contextlib
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Optional

import typer
import yaml
from rich.console import Console
from rich.table import Table

from moeflow.core.errors import Terminated, UserError
from moeflow.evaluation.verdict import parse_uri, require_pass
from moeflow.serving.ingress import INGRESSES
from workflows.printer import make_console

if TYPE_CHECKING:
    from moeflow.core.config import PipelineConfig
    from moeflow.serving.deployment import Deployment



def _pipeline_inputs(run_id: str, tracking_uri: str | None) -> tuple[PipelineConfig, dict[str, dict]]:
    """(config, {stage: record}) of a pipeline run: its finished convert (required),
    finetune, regress, operators, calibrate and serving stages; the serving stage's
    serving.yaml applied to `deploy:` (explicit `deploy:` keys win), as the deploy stage does."""
    # lazy: `moeflow --help` loads none of what commands run (tests/test_printer.py)
    from moeflow.core import tracking as T  # imports MLflow (seconds): not for --help
    from moeflow.core.config import validate
    from moeflow.serving.deployment import apply_serving, serving_yaml

    client = T.client_for(T.existing_tracking_uri(tracking_uri))
    parent = T.get_pipeline_run(client, run_id)
    cfg = validate(yaml.safe_load(T.download_text(client, run_id, "config.yaml")) or {},
                   source=f"run {run_id} config.yaml")
    records = {}
    for stage in ("convert", "finetune", "regress", "operators", "calibrate", "serving"):
        child = parent.data.tags.get(T.STAGE_RUN_PREFIX + stage)
        state = parent.data.tags.get(T.STATE_PREFIX + stage)
        if child and state in ("done", "reused"):
            records[stage] = T.read_result(client.get_run(child))
        elif stage == "regress" and state == "failed":
            raise UserError(f"run {run_id}: the regress stage failed; refusing to deploy")
    if not records.get("convert"):
        raise UserError(f"run {run_id}: no finished convert stage to deploy")
    # config.yaml holds only the keys the user set (moeflow.core.config.to_yaml)
    cfg, _ = apply_serving(cfg, serving_yaml(cfg, records))
    return cfg, records


def _stage_records(run_id: str, tracking_uri: str | None, stages: tuple[str, ...]) -> dict:
    """Finished records of `stages` of a pipeline run (missing ones left out)."""
    from moeflow.core import tracking as T  # imports MLflow (seconds): not for --help

    client = T.client_for(T.existing_tracking_uri(tracking_uri))
    tags = T.get_pipeline_run(client, run_id).data.tags
    return {s: T.read_result(client.get_run(tags[T.STAGE_RUN_PREFIX + s])) for s in stages
            if tags.get(T.STAGE_RUN_PREFIX + s) and tags.get(T.STATE_PREFIX + s) in ("done", "reused")}


def _plan_serving(run_id: str, tracking_uri: str | None) -> dict | None:
    """The serving sub-plan of a pipeline run's plan stage (replicas; vLLM's layout), if any."""
    plan = _stage_records(run_id, tracking_uri, ("plan",)).get("plan") or {}
    return plan.get("plan", {}).get("serving")


def _run_vllm(cfg: PipelineConfig, dep: Deployment, serving: dict | None, out: str,
              address: str | None) -> None:
    """Build (and unless deploy.dry_run, start) the Ray Serve LLM app of a run."""
    # lazy: `moeflow --help` loads none of what commands run (tests/test_printer.py)
    from moeflow.serving import vllm_backend as V

    if not cfg.deploy.dry_run:
        return _serve_vllm(cfg, dep, serving, Path(out).resolve(), address)
    path = Path(out).resolve()
    dep, stored = _fetched_adapters(dep)
    built = V.build_run(cfg, dep, serving, path.parent, stored=stored)
    V.write_config(built["serve_config"], path)
    _print_vllm(built, path)


def _print_vllm(built: dict, path: Path) -> None:
    console = make_console()
    p = built["plan"]
    console.print(f"vllm plan: TP{p['tensor_parallel_size']} PP{p['pipeline_parallel_size']} "
                  f"EP{p['expert_parallel']} engine-DP{p['data_parallel_size']} x {p['num_replicas']} "
                  f"replica(s), {p['weight_dtype']} weights, {p['devices_per_replica']} devices each")
    for note in built["notes"]:
        console.print(f"  {note}")
    for src, uri in built["uploads"].items():
        console.print(f"  copy {src} -> {uri}")
    console.print(f"wrote {path} (serve run / serve deploy / RayService serveConfigV2)")


def _serve_vllm(cfg: PipelineConfig, dep: Deployment, serving: dict | None, path: Path,
                address: str | None) -> None:
    """Start the Ray Serve LLM app on the cluster's devices (vLLM's CPU build where it has no
    GPU), smoke-test it, and hold it in the foreground as the local backend does."""
    from moeflow.serving import vllm_backend as V
    from moeflow.serving import vllm_run
    from workflows.raylocal import ray_address, ray_session  # imports Ray (seconds): not for --help

    console = make_console()
    local = ray_address(cfg, address) is None
    with ray_session(cfg, address), _sigterm_stops():  # after ray.init: it installs its own
        device = vllm_run.cluster_device()
        built = V.build_run(cfg, dep, serving, path.parent, device=device)
        V.write_config(built["serve_config"], path)
        _print_vllm(built, path)
        record = V.serve_and_smoke(cfg, built, device, notify=console.print)
        _print_record(console, {**record, "mode": f"vllm on {device}"})
        _hold(console, local)  # local: leaving ray_session stops Ray, HAProxy included, in seconds


def _fetched_adapters(dep: Deployment) -> tuple[Deployment, dict[str, str]]:
    """`dep` with what the vLLM config is built from fetched, when in a store (a run whose
    workdir is one), into this node's cache: the adapters, and the base's config.json alone
    (replicas load the base from its URI); (dep, local copy -> URI)."""
    from dataclasses import replace

    from moeflow.core import storage  # lazy: fsspec only when a run is deployed

    stored, adapters = {}, {}
    for name, src in dep.adapters.items():
        if storage.is_uri(src):
            local = storage.localize(src)
            stored[local], src = src, local
        adapters[name] = src
    base = dep.checkpoint
    if storage.is_uri(base):
        base = str(Path(storage.localize(storage.join(base, "config.json"))).parent)
        stored[base] = dep.checkpoint
    return replace(dep, adapters=adapters, checkpoint=base), stored


def _print_record(console: Console, record: dict) -> None:
    table = Table(title=f"moeflow endpoint {record['url']} ({record['mode']} mode)")
    for col in ("model", "parent", "smoke latency s", "smoke text"):
        table.add_column(col)
    parents = {m["id"]: m.get("parent") or "" for m in record["smoke"]["models"]}
    for name, res in record["smoke"]["completions"].items():
        table.add_row(name, parents.get(name, ""), f"{res['latency_s']:.3f}", repr(res["text"]))
    console.print(table)
    metrics = f"   metrics: {record['url']}/metrics" if record["smoke"].get("metrics_ok") else ""
    console.print(f"OpenAI base URL: {record['url']}/v1{metrics}"
                  + (f"   ingress: {record['ingress']}" if record.get("ingress") else ""))


@contextlib.contextmanager
def _sigterm_stops():
    """SIGTERM (`kill`, systemd, a Kubernetes pod stop) stops a foreground server as Ctrl-C
    does: Serve shut down, this process's Ray stopped and its temp files (HAProxy's config
    and socket dir) removed -- Python's default SIGTERM exits without any of that."""
    def stop(signum, frame):
        raise Terminated

    try:
        old = signal.signal(signal.SIGTERM, stop)
    except ValueError:  # not the main thread: nothing to install
        old = None
    try:
        yield
    finally:
        if old is not None:
            signal.signal(signal.SIGTERM, old)


def _hold(console: Console, local: bool) -> None:
    if not local:
        console.print("deployed to the cluster; the app keeps serving (serve.delete('moeflow') stops it)")
        return
    from workflows.raylocal import ray_address_line  # imports Ray (seconds): not for --help

    # what `moeflow rebalance --address` (and any other driver) joins this Ray with
    console.print(f"Ray: {ray_address_line()}  (the --address of `moeflow rebalance`)", soft_wrap=True)
    try:  # the line inside: a signal right after it still stops cleanly
        console.print("serving in the foreground; Ctrl-C stops it")
        while True:
            time.sleep(3600)
    except KeyboardInterrupt as exc:
        _drain(console)
        raise typer.Exit(143 if isinstance(exc, Terminated) else 130) from None


def _drain(console: Console) -> None:
    """Requests in flight finish (at most DRAIN_S) before Ray stops; a second signal cuts it short."""
    from moeflow.serving.app import DRAIN_S, drain  # imported already by the deployment

    console.print(f"stopping: requests in flight get up to {DRAIN_S:.0f} s to finish "
                  "(Ctrl-C again stops at once)")
    try:
        drain()
    except KeyboardInterrupt:
        console.print("stopping now")


def _run_deploy(cfg: PipelineConfig, dep: Deployment, api_key: str | None, address: str | None,
                serving: dict | None = None, force: bool = False) -> None:
    """Check what `dep` serves, start Ray (unless `address`), deploy, hold it in the foreground.

    Args:
        api_key: --api-key (None: deploy.api_key_env's variable, else an open API).
    """
    # lazy: `moeflow --help` loads none of what commands run (tests/test_printer.py)
    from moeflow.serving.preflight import check_deployment

    # first, in this process: a replica's failure costs Serve three starts (about a minute)
    check_deployment(dep, cfg.model.trust_remote_code)
    # lazy: `moeflow --help` loads none of what commands run (tests/test_printer.py)
    from moeflow.serving.launch import apply_plan, deploy, settings_for
    from workflows.raylocal import ray_address, ray_session  # imports Ray (seconds): not for --help

    api_key = _api_key(api_key, cfg.deploy.api_key_env)
    console = make_console()
    local = ray_address(cfg, address) is None
    with ray_session(cfg, address), _sigterm_stops():  # after ray.init: it installs its own
        cfg = apply_plan(cfg, serving)  # replicas from the run's plan unless deploy.num_replicas
        if cfg.deploy.compile:  # else minutes without a line
            console.print("deploy.compile: each replica compiles its forwards before it serves "
                          "(70-200 s on a CPU host, about 20 s with Inductor's cache)")
        record = deploy(cfg, settings_for(cfg, dep, api_key, allow_ungated=force))
        _print_record(console, record)
        if force:
            console.print("--force: runtime loads of registered versions without a PASS gate verdict "
                          "are served too (each logged)")
        _hold(console, local)  # local: leaving ray_session stops Ray, HAProxy included, in seconds


def _api_key(flag: str | None, env_name: str) -> str | None:
    from moeflow.serving.app import api_key_from_env  # imports the engine (torch): not for --help

    return flag or api_key_from_env(env_name)


def deploy_cmd(
    run: str = typer.Option(..., "--run", help="pipeline run id (MLflow parent run)"),
    merge: bool = typer.Option(False, help="merge the adapter into the base (single-scenario latency)"),
    host: Optional[str] = typer.Option(None, help="bind address (default: deploy.host)"),
    port: Optional[int] = typer.Option(None, help="HTTP port (0: a free one)"),
    api_key: Optional[str] = typer.Option(None, "--api-key",
                                          help="require this bearer token (default $MOEFLOW_API_KEY)"),
    tracking_uri: Optional[str] = typer.Option(None, help="MLflow tracking URI"),
    address: Optional[str] = typer.Option(None, help="Ray cluster address (default $RAY_ADDRESS, else local)"),
    backend: Optional[str] = typer.Option(None, help="auto | local | vllm (default: deploy.backend; "
                                          "auto: the run's plan stage's choice)"),
    dry_run: bool = typer.Option(False, "--dry-run", help="vllm: write the Serve config, deploy nothing"),
    out: str = typer.Option("serve_config.yaml", help="vllm: where the Serve config YAML goes"),
    lora_uri: Optional[str] = typer.Option(None, help="vllm: s3/gs/abfss/azure prefix of <adapter>/ dirs"),
    ingress: Optional[str] = typer.Option(None, help="local: auto | proxy | haproxy (default: deploy.ingress)"),
    adapter_root: Optional[str] = typer.Option(None, "--adapter-root", help="directory runtime "
                                               "load_lora_adapter may read adapters from "
                                               "(default: deploy.adapter_root)"),
    force: bool = typer.Option(False, "--force", help="deploy registered versions without a PASS gate verdict "
                               "(runtime loads too)"),
):
    """Deploy a finished pipeline run's model and adapter on Ray Serve; smoke-test it."""
    # lazy: `moeflow --help` loads none of what commands run (tests/test_printer.py)
    from moeflow.serving.deployment import decide

    cfg, records = _pipeline_inputs(run, tracking_uri)
    _require_verdicts(_run_versions(records.get("finetune"), cfg.deploy.adapters), tracking_uri, force)
    if backend not in (None, "auto", "local", "vllm"):
        raise UserError(f"--backend {backend!r}: expected auto, local or vllm")
    _check_ingress(ingress)
    cfg = cfg.model_copy(update={"deploy": cfg.deploy.model_copy(update={
        k: v for k, v in {"merge": merge or cfg.deploy.merge, "host": host, "port": port,
                          "backend": backend, "lora_uri": lora_uri, "ingress": ingress,
                          "dry_run": dry_run or None, "adapter_root": _adapter_root(adapter_root)
                          }.items() if v is not None})})
    dep = decide(cfg, records)  # serving.yaml already applied (_pipeline_inputs)
    if dry_run and dep.backend != "vllm":
        raise UserError("--dry-run writes a vLLM Serve config: use it with --backend vllm")
    if dep.backend == "vllm":
        return _run_vllm(cfg, dep, _plan_serving(run, tracking_uri), out, address)
    _run_deploy(cfg, dep, api_key, address, _plan_serving(run, tracking_uri), force)


def serve_cmd(
    config: str = typer.Argument(..., help="pipeline config YAML (model.path + deploy: section)"),
    adapter: list[str] = typer.Option([], help="NAME=DIR adapter to serve (repeatable)"),
    merge: Optional[str] = typer.Option(None, help="merge this adapter NAME into the base"),
    port: Optional[int] = typer.Option(None, help="HTTP port (0: a free one)"),
    api_key: Optional[str] = typer.Option(None, "--api-key",
                                          help="require this bearer token (default $MOEFLOW_API_KEY)"),
    set_: list[str] = typer.Option([], "--set", help="override a config key, e.g. deploy.max_loras=8"),
    ingress: Optional[str] = typer.Option(None, help="auto | proxy | haproxy (default: deploy.ingress)"),
    adapter_root: Optional[str] = typer.Option(None, "--adapter-root", help="directory runtime "
                                               "load_lora_adapter may read adapters from "
                                               "(default: deploy.adapter_root)"),
    force: bool = typer.Option(False, "--force", help="serve registered versions without a PASS gate verdict "
                               "(runtime loads too)"),
):
    """Serve model.path (+ adapters) locally in the foreground until Ctrl-C."""
    # lazy: `moeflow --help` loads none of what commands run (tests/test_printer.py)
    from moeflow.core.config import load_config
    from moeflow.serving.deployment import decide

    _check_ingress(ingress)

    cfg = load_config(config, set_)
    extra = {}
    for item in adapter:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise UserError(f"--adapter {item!r}: expected NAME=DIR")
        extra[name] = path
    adapters = {**cfg.deploy.adapters, **extra}
    _require_verdicts(_run_versions(None, adapters), cfg.tracking.uri, force)
    if merge and merge not in adapters:
        raise UserError(f"--merge {merge!r}: not among the adapters ({', '.join(adapters) or 'none'})")
    update = {"adapters": adapters, "merge": bool(merge)}
    if port is not None:
        update["port"] = port
    if ingress is not None:
        update["ingress"] = ingress
    if adapter_root is not None:
        update["adapter_root"] = _adapter_root(adapter_root)
    cfg = cfg.model_copy(update={"deploy": cfg.deploy.model_copy(update=update)})
    # no run, so no plan stage chose for auto: serve runs the local engine unless told vllm
    backend: Literal["local", "vllm"] = "vllm" if cfg.deploy.backend == "vllm" else "local"
    if backend == "local":
        _refuse_too_large(cfg)
    dep = decide(cfg, {}, backend=backend, merge=merge)  # no run: model.path as given
    if dep.backend == "vllm":  # no run, so no plan: one vLLM engine on one device
        from moeflow.parallel.vllm_plan import single_device_plan

        # the Serve config and any merged checkpoint go under the workdir, as a run's would
        out = Path(cfg.workdir).resolve() / "serve-vllm" / "serve_config.yaml"
        return _serve_vllm(cfg, dep, {"vllm": single_device_plan()}, out, None)
    _run_deploy(cfg, dep, api_key, None, force=force)


def _refuse_too_large(cfg: PipelineConfig) -> None:
    """`moeflow serve` runs the local engine, the whole model on one device: a model larger than
    one device of the hardware spec stops here, before Ray starts (the plan stage's check)."""
    # lazy: the model on the meta device (transformers): only when this runs
    from moeflow.core.hardware import load_hardware
    from moeflow.model.params import spec_from_path
    from moeflow.parallel.vllm_plan import choose_backend, local_limit
    from tasks.plan import local_workload

    hw = load_hardware(cfg.hardware.spec, cfg.hardware.nodes)
    choice = choose_backend("local", spec_from_path(cfg.model.path), hw, local_workload(cfg, hw))
    if not choice["local_fits"]:
        raise UserError(local_limit(choice["local_memory_bytes"], choice["device_bytes"]))


def _adapter_root(path: str | None) -> str | None:
    """--adapter-root: an existing directory, absolute (replicas run elsewhere)."""
    if path is None:
        return None
    root = Path(path).expanduser().resolve()
    if not root.is_dir():
        raise UserError(f"--adapter-root {path}: not a directory")
    return str(root)


def _run_versions(finetune: dict | None, adapters: dict[str, str]) -> list[tuple[str, str]]:
    """Registered versions a deployment would serve: the run's adapters and models:/ URIs."""
    found = []
    for rec in [finetune or {}, *((finetune or {}).get("adapters") or {}).values()]:
        if rec.get("registered_model") and rec.get("model_version"):
            found.append((rec["registered_model"], str(rec["model_version"])))
    found += [v for v in map(parse_uri, adapters.values()) if v]
    return list(dict.fromkeys(found))


def _require_verdicts(versions, tracking_uri: str | None, force: bool) -> None:
    """Refuse versions without a PASS gate verdict (moeflow watch / regress), unless --force."""
    if not versions:  # nothing registered: no MLflow import (seconds), no store opened
        return
    from moeflow.core.tracking import existing_tracking_uri  # imports MLflow (seconds): not for --help

    console = make_console(stderr=True)
    require_pass(existing_tracking_uri(tracking_uri), versions, force, notify=console.print)


def _check_ingress(ingress: str | None) -> None:
    if ingress is not None and ingress not in INGRESSES:
        raise UserError(f"--ingress {ingress!r}: expected {', '.join(INGRESSES)}")


def register(app: typer.Typer) -> None:
    app.command("deploy")(deploy_cmd)
    app.command("serve")(serve_cmd)
