"""What `pip install .` gives a user is the product: pyproject's package list takes every
package of moeflow/, tasks/ and workflows/ and none of moeflow_testing/ (the fixtures), and
`moeflow demo` away from a checkout says in one line that it needs one."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from setuptools import find_packages

import workflows.demo as demo
from moeflow.core.errors import UserError

REPO = Path(__file__).resolve().parents[1]


def test_the_wheel_takes_the_product_and_no_fixture():
    find = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    packaged = set(find_packages(str(REPO), include=find["include"], exclude=find.get("exclude", ())))
    product = {".".join(p.relative_to(REPO).parent.parts) for top in ("moeflow", "tasks", "workflows")
               for p in (REPO / top).rglob("__init__.py")}
    assert product <= packaged, f"product packages left out of the wheel: {sorted(product - packaged)}"
    assert not {p for p in packaged if p.split(".")[0] not in ("moeflow", "tasks", "workflows")}, sorted(packaged)


def test_demo_away_from_a_checkout_says_it_needs_one(tmp_path, monkeypatch):
    monkeypatch.setattr(demo, "REPO", tmp_path)  # an install: no moeflow_testing/, no configs/
    monkeypatch.setattr(demo, "DEMO_CONFIG", tmp_path / "configs" / "demo.yaml")
    with pytest.raises(UserError, match="runs from a checkout of the moeflow repository") as exc:
        demo.run_demo(tmp_path / "work")
    assert "\n" not in str(exc.value)
