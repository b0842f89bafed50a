"""A per-stage command is `moeflow run CONFIG` with that stage as its target (one way to run a stage).

The stage commands (`operators`, `calibrate`, `finetune`) are built by
workflows/commands/stage.py; here the same builder makes a command for the runner tests'
small real stages (tests/pipeline_stages.py: a -> b -> c, a -> d) and runs it on Ray.
"""

from __future__ import annotations

import yaml
from typer import Typer
from typer.testing import CliRunner

from tests.conftest import abcd_config
from workflows.commands import calibrate, finetune, operators
from workflows.commands.stage import stage_command


def _app(shown: list) -> Typer:
    app = Typer()
    app.command(name="c")(stage_command("c", lambda console, result: shown.append(result), "stage c", "x=1"))
    app.command(name="other")(lambda: None)  # two commands: typer then routes by name
    return app


def test_a_stage_command_runs_its_stage_and_upstream_only_and_prints_as_run_does(ray_local, tmp_path, capsys):
    cfg = tmp_path / "p.yaml"
    cfg.write_text(yaml.safe_dump(abcd_config(tmp_path, lines="good\n", optimizer={"lr": 0.01})))
    shown: list = []
    res = CliRunner().invoke(_app(shown), ["c", str(cfg)])
    assert res.exit_code == 0, res.output
    assert shown == [{"value": 20}]  # c's own record, handed to the command's printer
    out = res.output + capsys.readouterr().out  # moeflow's console writes to the process's stdout
    assert "parent run" in out and "FINISHED" in out  # run's MLflow line
    rows = {words[0] for line in out.splitlines() if len(words := line.split()) > 2 and words[1] == "done"}
    assert rows == {"a", "b", "c"}  # the stage table: only what c needs ran (d is not upstream of c)


def test_a_failed_stage_exits_1_with_runs_resume_hint(ray_local, tmp_path, capsys):
    cfg = tmp_path / "p.yaml"
    cfg.write_text(yaml.safe_dump(abcd_config(tmp_path, lines="good\nbad\n", optimizer={"lr": 0.01})))
    shown: list = []
    res = CliRunner().invoke(_app(shown), ["c", str(cfg)])
    assert res.exit_code == 1, res.output
    assert shown == []
    out = res.output + capsys.readouterr().out
    assert "train.jsonl:2: bad line" in out and "moeflow resume " in out


def test_the_shipped_stage_commands_are_built_by_the_one_helper():
    for module, stage in ((operators, "operators"), (calibrate, "calibrate"), (finetune, "finetune")):
        command = getattr(module, stage)
        assert command.__qualname__.startswith("stage_command."), stage
        assert command.__name__ == stage
