"""cluster/monitoring: the shipped Prometheus rules pass `promtool check rules` and their
unit tests; every query of the Grafana dashboard is valid PromQL and names only series a
live server's /metrics exports; the per-expert series carry logical expert and EP rank."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
import torch
import yaml
from prometheus_client.parser import text_string_to_metric_families

from moeflow.serving.app import ServeSettings, free_port
from moeflow_testing.serving import LocalServer
from moeflow_testing.tiny import build_debug_model
from tests.conftest import REPO

MON = REPO / "cluster" / "monitoring"


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:  # .ci/run installs it (Debian's prometheus package)
        pytest.fail("promtool not found: install Prometheus (apt-get install prometheus)")
    return path


def test_promtool_checks_and_unit_tests_the_shipped_rules():
    check = subprocess.run([promtool(), "check", "rules", str(MON / "rules.yml")], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "SUCCESS: 6 rules found" in check.stdout
    test = subprocess.run([promtool(), "test", "rules", "rules_test.yml"], cwd=MON, capture_output=True, text=True)
    assert test.returncode == 0, test.stdout + test.stderr


def test_promtool_refuses_a_broken_rule(tmp_path):
    """The check can fail: a rule with a PromQL syntax error is refused."""
    rules = yaml.safe_load((MON / "rules.yml").read_text())
    rules["groups"][0]["rules"][0]["expr"] = "sum by (layer (rate(moeflow_expert_tokens_total[1m]))"
    bad = tmp_path / "bad.yml"
    bad.write_text(yaml.safe_dump(rules))
    assert subprocess.run([promtool(), "check", "rules", str(bad)], capture_output=True).returncode != 0


def dashboard_queries() -> list[str]:
    dash = json.loads((MON / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs += [v["query"] for v in dash["templating"]["list"] if v["type"] == "query"]
    return exprs


def _as_promql(expr: str) -> str:
    """A dashboard query with Grafana's variables filled in, as Prometheus would get it."""
    m = re.fullmatch(r"label_values\((\w+), *(\w+)\)", expr)
    if m:  # a Grafana variable query: Prometheus answers it from this series
        return m.group(1)
    return expr.replace("$job", ".*").replace("$layer", "0")


@pytest.fixture(scope="module")
def live_metrics(tmp_path_factory, one_thread):
    base = build_debug_model("qwen3_moe", tmp_path_factory.mktemp("mon") / "m")
    settings = ServeSettings(base_dir=str(base), served_model_name="m", ep_size=2, expert_window_steps=1)
    with LocalServer(settings, free_port()) as server:
        for prompt in ("reverse: abc\nanswer:", "Hello there"):
            r = httpx.post(server.url + "/v1/completions", timeout=60,
                           json={"model": "m", "prompt": prompt, "max_tokens": 6, "temperature": 0})
            assert r.status_code == 200, r.text
        load = httpx.get(server.url + "/v1/expert_load", timeout=60).json()
        text = httpx.get(server.url + "/metrics", timeout=60).text
    return text, load


@pytest.mark.integration
def test_every_dashboard_query_names_an_exported_series(live_metrics, tmp_path):
    text, _ = live_metrics
    exported = {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}
    queries = dashboard_queries()
    assert len(queries) >= 15
    used = set()
    for expr in queries:
        names = set(re.findall(r"\bmoeflow_[a-z0-9_]+\b", expr))
        assert names, f"query names no moeflow series: {expr}"
        assert names <= exported, f"{expr}: {sorted(names - exported)} not in /metrics"
        used |= names
    for needed in ("moeflow_kv_cache_usage_perc", "moeflow_lora_adapters_resident", "moeflow_expert_tokens_total",
                   "moeflow_time_to_first_token_seconds_bucket", "moeflow_num_requests_waiting"):
        assert needed in used
    # valid PromQL: promtool parses each query as a recording rule
    rules = {"groups": [{"name": "dashboard", "rules": [{"record": f"dashboard:q{i}", "expr": _as_promql(q)}
                                                         for i, q in enumerate(queries)]}]}
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump(rules))
    check = subprocess.run([promtool(), "check", "rules", str(path)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr


@pytest.mark.integration
def test_expert_tokens_by_logical_expert_and_ep_rank(live_metrics):
    text, load = live_metrics
    fam = next(f for f in text_string_to_metric_families(text) if f.name == "moeflow_expert_tokens")
    got = {(s.labels["layer"], int(s.labels["expert"])): (s.value, int(s.labels["ep_rank"])) for s in fam.samples}
    experts = load["num_experts"]
    for layer_label, layer_row in zip((str(n) for n in load["layers"]), load["counts"]):
        for e, count in enumerate(layer_row):
            value, rank = got[(layer_label, e)]
            assert value == count and rank == e // (experts // 2)  # served order = logical order here
    assert sum(v for v, _ in got.values()) > 0
    kv = next(f for f in text_string_to_metric_families(text) if f.name == "moeflow_kv_cache_usage_perc")
    assert 0 <= kv.samples[0].value <= 1


def test_expert_load_reports_logical_experts_of_a_permuted_checkpoint(tmp_path):
    """Counts of a permuted checkpoint map back to the original expert ids; ep_rank is the
    rank of the served slot."""
    from moeflow.model.models import load_model
    from moeflow.serving.metrics import ExpertLoad

    torch.manual_seed(0)
    base = build_debug_model("qwen3_moe", tmp_path / "m")
    model = load_model(base, torch.float32)
    probe = ExpertLoad(model)
    routers = probe.router_names
    perm = list(reversed(range(probe.num_experts)))
    load = ExpertLoad(model, ep_size=2, placement={routers[0]: perm})
    with torch.no_grad():
        model(torch.tensor([[5, 6, 7, 8, 9, 10]]))
    served = load.total.tolist()
    logical = load.logical_totals()
    assert logical[0] == [served[0][perm.index(e)] for e in range(probe.num_experts)]
    assert logical[1] == served[1]
    from prometheus_client import generate_latest

    text = generate_latest(load.registry).decode()
    # logical expert 0 sits in the last served slot, so on the last rank; unpermuted layer 1 keeps it on 0
    assert f'moeflow_expert_tokens_total{{ep_rank="1",expert="0",layer="{load.labels[0]}"}}' in text
    assert f'moeflow_expert_tokens_total{{ep_rank="0",expert="0",layer="{load.labels[1]}"}}' in text
