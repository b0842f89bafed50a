"""DAG order, selection and cache keys (pure functions)."""

import os
import time

import pytest

from moeflow.core.config import validate
from moeflow.core.errors import UserError
from tasks.base import StageSpec
from workflows import dag
from workflows.selection import select


def _noop(ctx):
    return {}


def specs(**edges):
    return {name: StageSpec(name=name, run=_noop, upstream=tuple(ups), sections=("lora",))
            for name, ups in edges.items()}


DIAMOND = specs(convert=[], plan=["convert"], finetune=["convert", "plan"],
                regress=["convert", "finetune"], deploy=["finetune", "regress"], ops=["plan"])


def test_topological_order_upstream_first():
    order = dag.topological_order(DIAMOND)
    for name, spec in DIAMOND.items():
        for up in spec.upstream:
            assert order.index(up) < order.index(name)


def test_cycle_and_unknown_upstream_are_errors():
    with pytest.raises(UserError, match="cycle"):
        dag.topological_order(specs(a=["b"], b=["a"]))
    with pytest.raises(UserError, match="unknown stage 'zz'"):
        dag.topological_order(specs(a=["zz"]))


def test_closures():
    assert dag.downstream(DIAMOND, {"plan"}) == {"plan", "finetune", "regress", "deploy", "ops"}
    assert dag.upstream_closure(DIAMOND, {"regress"}) == {"convert", "plan", "finetune", "regress"}


def test_cache_key_depends_on_config_code_upstream_and_files(tmp_path):
    base = dag.cache_key("s", {"lora": {"rank": 8}}, "v1", {"u": "k1"})
    assert base == dag.cache_key("s", {"lora": {"rank": 8}}, "v1", {"u": "k1"})
    assert base != dag.cache_key("s", {"lora": {"rank": 16}}, "v1", {"u": "k1"})
    assert base != dag.cache_key("s", {"lora": {"rank": 8}}, "v2", {"u": "k1"})
    assert base != dag.cache_key("s", {"lora": {"rank": 8}}, "v1", {"u": "k2"})
    assert base != dag.cache_key("t", {"lora": {"rank": 8}}, "v1", {"u": "k1"})
    data = tmp_path / "train.jsonl"
    data.write_text("a\n")
    k1 = dag.cache_key("s", {}, "v1", {}, files=[str(data)])
    assert k1 == dag.cache_key("s", {}, "v1", {}, files=[str(data)])
    data.write_text("ab\n")
    os.utime(data, (time.time() + 5, time.time() + 5))
    assert k1 != dag.cache_key("s", {}, "v1", {}, files=[str(data)])


def test_fingerprint_keys_default_and_explicit():
    spec = StageSpec(name="x", run=_noop, sections=("model", "data"))
    assert spec.fingerprint_keys() == ("model.path", "data.train_file", "data.eval_file")
    assert StageSpec(name="x", run=_noop, sections=("lora",)).fingerprint_keys() == ()
    assert StageSpec(name="x", run=_noop, sections=("model",),
                     fingerprint=("hardware.spec",)).fingerprint_keys() == ("hardware.spec",)
    assert dag.lookup({"a": {"b": 1}}, "a.b") == 1 and dag.lookup({"a": {}}, "a.b") is None


def test_code_version_tracks_module_source():
    spec = StageSpec(name="x", run=_noop)
    assert spec.code_version() == StageSpec(name="x", run=_noop).code_version()
    assert spec.code_version() != StageSpec(name="x", run=_noop, version="2").code_version()


def _cfg(**stages):
    return validate({"model": {"path": "/m"}, "stages": stages})


def test_select_modes():
    cfg = _cfg()
    order, must, forced = select(DIAMOND, cfg)
    assert set(order) == set(DIAMOND) and not must and not forced
    order, must, forced = select(DIAMOND, cfg, only=["finetune"])
    assert must == {"convert", "plan"} and forced == {"finetune"}
    order, must, forced = select(DIAMOND, cfg, from_=["plan"])
    assert must == {"convert"} and forced == {"plan", "finetune", "regress", "deploy", "ops"}
    order, must, forced = select(DIAMOND, cfg, rerun=["regress"])
    assert forced == {"regress"} and not must
    order, _, _ = select(DIAMOND, cfg, targets=["finetune"])
    assert order == ["convert", "plan", "finetune"]


def test_select_errors_name_the_stage():
    with pytest.raises(UserError, match="did you mean finetune"):
        select(DIAMOND, _cfg(), only=["finetnue"])
    with pytest.raises(UserError, match="stage plan needs convert"):
        select(DIAMOND, _cfg(enabled=["plan"]))
    with pytest.raises(UserError, match="stages.resources: unknown stage"):
        select(DIAMOND, _cfg(resources={"convrt": {"num_cpus": 1}}))


def test_code_version_sees_library_modules_the_stage_imports_lazily(tmp_path, monkeypatch):
    """Editing a module the stage reaches (even through an import inside a function)
    changes its code version; editing one it never imports does not."""
    import importlib
    import sys

    pkg = tmp_path / "mfpkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "stage.py").write_text("def run(ctx):\n    from .sub import lib  # lazy\n"
                                  "    return lib.value()\n")
    (pkg / "sub" / "lib.py").write_text("from mfpkg import deep\n\ndef value():\n"
                                        "    return deep.X\n")
    (pkg / "deep.py").write_text("X = 1\n")
    (pkg / "other.py").write_text("Y = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    stage = importlib.import_module("mfpkg.stage")
    spec = StageSpec(name="s", run=stage.run)
    names = [name for name, _ in spec.code_files()]
    assert {"mfpkg.stage", "mfpkg.sub.lib", "mfpkg.deep", "mfpkg"} <= set(names)
    assert "mfpkg.other" not in names
    before = spec.code_version()

    def edit(path, text):
        path.write_text(text)
        os.utime(path, ns=(time.time_ns() + 10**9, time.time_ns() + 10**9))

    edit(pkg / "other.py", "Y = 2\n")
    assert spec.code_version() == before  # unrelated module
    edit(pkg / "deep.py", "X = 2\n")
    assert spec.code_version() != before  # reached through a lazy import, then a plain one
    for name in [m for m in sys.modules if m.startswith("mfpkg")]:
        del sys.modules[name]


def test_real_stage_code_files_and_library_versions():
    from workflows.dag import registry

    files = {name for name, _ in registry()["convert"].code_files()}
    assert {"tasks.convert", "moeflow.checkpoint.convert", "moeflow.checkpoint.verify",
            "tasks.base"} <= files  # the last three imported inside functions or transitively
    assert not any(n.startswith(("moeflow.serving", "moeflow.training", "tests")) for n in files)
    finetune = {name for name, _ in registry()["finetune"].code_files()}
    assert {"moeflow.training.trainer", "moeflow.training.steps", "moeflow.training.lora"} <= finetune
    libs = dag.library_versions()
    assert set(libs) == {"torch", "transformers", "peft", "ray", "mlflow", "safetensors"}
    key = dag.cache_key("s", {}, "v1", {})
    assert key == dag.cache_key("s", {}, "v1", {}, libraries=libs)
    assert key != dag.cache_key("s", {}, "v1", {}, libraries=dict(libs, transformers="9.9.9"))


def test_submit_forwards_verbosity_to_the_job(monkeypatch, tmp_path):
    from workflows.submit import build_job
    from workflows.verbosity import VERBOSE_ENV, take_flag

    env = tmp_path / "runtime_env.yaml"
    env.write_text("env_vars: {}\n")
    monkeypatch.delenv(VERBOSE_ENV, raising=False)
    _, runtime = build_job({"name": "x"}, env)
    assert VERBOSE_ENV not in runtime["env_vars"]
    assert take_flag(["submit", "c.yaml", "-v"]) == ["submit", "c.yaml"]
    _, runtime = build_job({"name": "x"}, env)
    assert runtime["env_vars"][VERBOSE_ENV] == "1"
    monkeypatch.delenv(VERBOSE_ENV)


def test_hashing_code_imports_nothing_heavy():
    """The driver hashes library code it never imports (torch, transformers stay out)."""
    import subprocess
    import sys

    from tests.conftest import REPO

    code = ("import sys; from workflows.dag import registry\n"
            "[s.code_version() for s in registry().values()]\n"
            "print(sorted(m for m in ('torch', 'transformers', 'peft') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=300, env={**__import__("os").environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_every_stage_has_a_typed_record():
    """tasks/records.py types the record of every registered stage, and StageContext.input
    is overloaded for every one that a stage reads as an upstream."""
    import typing

    from tasks.base import StageContext
    from tasks.records import RECORDS
    from workflows.dag import registry

    stages = registry()
    assert set(stages) <= set(RECORDS), set(stages) - set(RECORDS)
    upstreams = {u for s in stages.values() for u in (*s.upstream, *s.after)}
    typed = {typing.get_args(typing.get_type_hints(o)["stage"])[0]
             for o in typing.get_overloads(StageContext.input)
             if typing.get_origin(typing.get_type_hints(o)["stage"]) is typing.Literal}
    assert upstreams <= typed, upstreams - typed
