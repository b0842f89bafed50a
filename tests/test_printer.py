"""Everything moeflow prints is literal text: `[red]` and `[/x]` in paths, names and errors
are printed as they are, never read as markup (and never crash the CLI)."""

import sys

import pytest

HOSTILE = ["x[red]/t.jsonl", "[red]x", "cannot bind [/tmp/mfh-1/hap/haproxy.cfg:95]", "[/]", "[bold"]


def _stages(error: str):
    from workflows.outcome import StageState

    return {"convert": StageState(name="convert", state="done", run_id="r1", attempts=1, seconds=1.0,
                                  result={"output_dir": "/a/x[red]/very/long/" + "p" * 120,
                                          "metrics": {"gb_per_s": 1.25, "name": "[red]x"}}),
            "finetune": StageState(name="finetune", state="failed", run_id="r2", attempts=1,
                                   seconds=2.0, error=error)}


@pytest.mark.parametrize("text", HOSTILE)
def test_every_console_prints_brackets_verbatim(text, capsys):
    from workflows.printer import error_line, make_console

    make_console().print(f"path {text}")
    make_console(stderr=True).print(error_line(text), soft_wrap=True)
    out = capsys.readouterr()
    assert f"path {text}" in out.out
    assert f"error: {text}" in out.err


@pytest.mark.parametrize("text", HOSTILE)
def test_stage_table_results_and_runs_keep_brackets(text):
    from workflows import report
    from workflows.printer import make_console

    console = make_console(width=80)
    console.record = True
    console.file = open("/dev/null", "w")
    console.print(report.stage_table(_stages(text), title="pipeline run [red]r"))
    for line in report.results_lines(_stages(text)):
        console.print(line, soft_wrap=True)
    run = type("R", (), {})()
    run.info = type("I", (), {"run_id": "r1", "run_name": text, "status": "FAILED",
                              "start_time": 1_700_000_000_000})()
    run.data = type("D", (), {"tags": {"moeflow.stages": "convert", "moeflow.state.convert": "done"}})()
    console.print(report.runs_table([run]))
    got = console.export_text()
    assert "pipeline run [red]r" in got
    assert "name=[red]x" in got
    assert "/a/x[red]/very/long/" + "p" * 120 in got  # a path: whole, on one line, never cut
    assert text in got.replace("\n", "") or text in got  # the error, wrapped at most


def test_cli_prints_an_error_quoting_a_config_line_as_one_line(monkeypatch, capsys):
    """HAProxy's `[/tmp/.../haproxy.cfg:95]` in an error killed the CLI with a MarkupError."""
    from moeflow.core.errors import UserError
    from workflows import cli

    def failing(**_):
        raise UserError("serving: HAProxy: [/tmp/x/haproxy.cfg:95] cannot bind [red]socket")

    monkeypatch.setattr(cli, "app", failing)
    monkeypatch.setattr("workflows.commands.register_all", lambda app: None)
    monkeypatch.setattr("workflows.verbosity.configure", lambda: None)
    monkeypatch.setattr(sys, "argv", ["moeflow", "resume", "x"])
    with pytest.raises(SystemExit) as stop:
        cli.main()
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.strip() == "error: serving: HAProxy: [/tmp/x/haproxy.cfg:95] cannot bind [red]socket"


@pytest.mark.parametrize("argv", [["--help"], ["run", "--help"], ["deploy", "--help"]])
def test_help_imports_no_heavy_library(argv):
    """`moeflow --help` took 6-7 s importing MLflow; help needs none of the libraries a command runs."""
    import subprocess

    code = ("import sys\nsys.argv = ['moeflow', *sys.argv[1:]]\nfrom workflows.cli import main\n"
            "try:\n    main()\nexcept SystemExit as e:\n    assert e.code in (0, None), e.code\n"
            "heavy = [m for m in ('mlflow', 'ray', 'torch', 'transformers', 'pandas', 'moeflow.core.config')"
            " if m in sys.modules]\nprint('HEAVY', heavy)")
    out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "HEAVY []" in out.stdout, out.stdout[-500:]


def test_every_console_in_the_code_has_markup_off():
    """A rich Console built anywhere but workflows/printer.py must say markup=False: text with
    brackets (paths, HAProxy errors, run names) is printed as it is, never parsed as style tags."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    offenders = []
    for path in [*root.glob("moeflow/**/*.py"), *root.glob("workflows/**/*.py"), *root.glob("tasks/**/*.py")]:
        if path.name == "printer.py":
            continue
        for m in re.finditer(r"\bConsole\((.*?)\)\n", path.read_text(), re.S):
            if "markup=False" not in m.group(1):
                offenders.append(f"{path.relative_to(root)}: Console({m.group(1)[:60]})")
    assert not offenders, offenders
