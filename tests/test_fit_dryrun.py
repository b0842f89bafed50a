"""benchmarks/fit_dryrun.py: the dry run's host constants fitted from recorded runs (pure)."""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace as NS

import pytest

from benchmarks.fit_dryrun import DATA, MAX_HOST_FACTOR, _in_stages, fit, judged, markdown, shipped

SHIPPED = shipped()


def _row(run_id: str, host: float, truth: dict[str, float], extra: float) -> dict:
    """A run whose stages took exactly what `truth` prices, plus `extra` seconds of storage."""
    def stage(*consts: tuple[str, float]) -> dict:
        terms = [{"what": c, "seconds": truth[c] * u * host, "const": c, "coef": u * host}
                 for c, u in consts] + [{"what": "read", "seconds": extra, "const": "", "coef": 0.0}]
        return {"measured": sum(t["seconds"] for t in terms), "terms": terms}

    stages = {"convert": stage(("STAGE_OVERHEAD_S", 1), ("PROCESS_START_S", 2)),
              "finetune": stage(("TRAIN_SETUP_S", 1), ("PROCESS_START_S", 1), ("STEP_OVERHEAD_S", 400)),
              "deploy": stage(("STAGE_OVERHEAD_S", 1), ("PROCESS_START_S", 1), ("SMOKE_S", 3))}
    wall = sum(s["measured"] for s in stages.values()) + truth["PIPELINE_START_S"] * host
    return {"run_id": run_id, "config": "demo", "host_factor": host, "stages": stages,
            "critical_path": list(stages), "pipeline": {"measured": wall, "estimated": wall}}


# the constants as a file no run has fitted yet: every one assumed, saying what it is
UNFITTED = dict(SHIPPED, constants={k: {"value": v["value"], "basis": "assumed", "how": v.get("what", v["how"])}
                                    for k, v in SHIPPED["constants"].items()})


def test_fit_recovers_the_constants_that_made_the_runs_on_hosts_of_different_speed():
    truth = {k: v["value"] for k, v in UNFITTED["constants"].items()}
    truth.update(PROCESS_START_S=6.5, TRAIN_SETUP_S=11.0, SMOKE_S=0.8, PIPELINE_START_S=3.0)
    rows = [_row("r1", 1.0, truth, 0.5), _row("r2", 2.4, truth, 1.0), _row("r3", 0.7, truth, 0.2)]
    got = fit(rows, UNFITTED)
    for name in ("PROCESS_START_S", "TRAIN_SETUP_S", "SMOKE_S", "PIPELINE_START_S"):
        assert got[name]["value"] == pytest.approx(truth[name], abs=1e-3), name
        assert got[name]["basis"] == "fitted" and got[name]["runs"] == ["r1", "r2", "r3"]
        assert got[name]["what"] == UNFITTED["constants"][name]["how"]  # what it is stays said
    # no run measures these apart from another term: kept as they were, and labelled so
    for name in ("STAGE_OVERHEAD_S", "STEP_OVERHEAD_S", "COMPILE_WARMUP_S", "CALIBRATE_S"):
        assert got[name] == UNFITTED["constants"][name]
        assert got[name]["basis"] == "assumed"
    # runs of a held-out config never reach the fit
    assert fit(rows, UNFITTED, held_out=("demo",)) == UNFITTED["constants"]


def test_a_run_on_a_host_too_busy_for_its_probe_is_left_out():
    truth = {k: v["value"] for k, v in SHIPPED["constants"].items()}
    busy = {**truth, "PROCESS_START_S": 1.0, "SMOKE_S": 0.0}  # what an over-reading probe fits
    rows = [_row("quiet", 1.2, truth, 0.5), _row("busy", MAX_HOST_FACTOR * 6, busy, 0.5)]
    got = fit(rows, UNFITTED)
    assert got["PROCESS_START_S"]["runs"] == ["quiet"]
    assert got["PROCESS_START_S"]["value"] == pytest.approx(truth["PROCESS_START_S"], abs=1e-3)


def test_a_run_marked_left_out_is_neither_fitted_nor_judged_but_keeps_its_reason():
    from benchmarks.fit_dryrun import held_out

    truth = {k: v["value"] for k, v in SHIPPED["constants"].items()}
    stale = {**truth, "PROCESS_START_S": 30.0, "SMOKE_S": 20.0}  # what an older, loaded run fits
    rows = [_row("kept", 1.0, truth, 0.5), _row("old", 1.0, stale, 0.5)]
    assert fit(rows, UNFITTED)["PROCESS_START_S"]["value"] != pytest.approx(truth["PROCESS_START_S"], abs=1e-3)
    rows[1]["left_out"] = "before contention was recorded"
    got = fit(rows, UNFITTED)
    assert got["PROCESS_START_S"]["runs"] == ["kept"]
    assert got["PROCESS_START_S"]["value"] == pytest.approx(truth["PROCESS_START_S"], abs=1e-3)
    held = [dict(r, config="demo-heldout") for r in rows]
    assert [line.split()[2] for line in held_out(held, got)] == ["kept"]
    table = markdown(rows, got, set())
    assert "Left out (before contention was recorded): old." in table and "old (" not in table


def test_the_shipped_constants_are_what_the_committed_runs_fit():
    """`python benchmarks/fit_dryrun.py --check`: the shipped file is the committed runs' fit, and
    a fitted constant names runs that are in the data set."""
    rows = json.loads(DATA.read_text())
    assert fit(rows, SHIPPED) == SHIPPED["constants"]
    ids = {r["run_id"] for r in rows}
    for name, c in SHIPPED["constants"].items():
        assert c["basis"] in ("fitted", "assumed") and c["how"], name
        if c["basis"] == "fitted":
            assert c["runs"] and set(c["runs"]) <= ids, name
            edited = copy.deepcopy(SHIPPED)
            edited["constants"][name]["value"] *= 2  # a hand edit of a fitted value
            assert fit(rows, edited)[name] == c


def test_a_held_out_run_is_judged_per_stage_and_on_the_pipeline():
    """The out-of-sample verdict: every stage within 2x of its re-priced estimate, the pipeline
    within 1.5x; one stage off by more fails the run, and the table says so."""
    truth = {k: v["value"] for k, v in SHIPPED["constants"].items()}
    row = _row("held", 1.3, truth, 0.4)
    pairs, ok = judged(row, SHIPPED["constants"])
    assert ok and set(pairs) == {"convert", "finetune", "deploy", "pipeline"}
    assert all(e == pytest.approx(m) for e, m in pairs.values())
    slow = copy.deepcopy(row)
    slow["stages"]["deploy"]["measured"] *= 2.2  # one stage past 2x: the pipeline barely moves
    slow["pipeline"]["measured"] += row["stages"]["deploy"]["measured"] * 1.2
    pairs, ok = judged(slow, SHIPPED["constants"])
    assert not ok and pairs["pipeline"][1] / pairs["pipeline"][0] < 1.5
    table = markdown([row, slow], SHIPPED["constants"], {"demo"})
    assert table.splitlines()[-1] == "| targets met | yes | no |" and "held out" in table


def test_the_pipeline_overhead_is_the_time_no_stage_ran():
    """PIPELINE_START_S is fitted on the parent's time outside every stage run (their union),
    not on the estimate's critical path: stages the runner orders one after another that the
    estimate puts side by side must not show up as parent-run overhead."""
    def run(start, end, status="FINISHED"):
        return NS(info=NS(start_time=start * 1e3, end_time=end * 1e3, status=status))

    # convert 0-10, then finetune 10-40 beside calibrate 12-15, then a failed try and deploy 41-50
    spans = [run(0, 10), run(10, 40), run(12, 15), run(40, 41, "FAILED"), run(41, 50)]
    assert _in_stages(spans) == pytest.approx(49.0)
    truth = {k: v["value"] for k, v in UNFITTED["constants"].items()}
    row = _row("r", 1.0, truth, 0.5)
    row["critical_path"] = ["convert"]  # an estimate whose path leaves finetune and deploy out
    row["pipeline"]["in_stages"] = sum(st["measured"] for st in row["stages"].values())
    assert fit([row], UNFITTED)["PIPELINE_START_S"]["value"] == pytest.approx(truth["PIPELINE_START_S"], abs=1e-3)


def test_a_run_that_met_contention_is_fitted_and_judged_at_the_time_it_would_have_taken_alone():
    """bench_dryrun.py records each stage's contention factor on the run; the fit and the
    verdict read measured / factor. A run whose every stage (and the pipeline) took 2.5x as
    long beside other work, with factor 2.5 recorded, fits the quiet run's constants and
    meets the targets; without the factor it fits them over 2x too large (not 2.5x: the
    assumed STAGE_OVERHEAD_S beside them stays as it is)."""
    truth = {k: v["value"] for k, v in UNFITTED["constants"].items()}
    truth.update(PROCESS_START_S=6.5, TRAIN_SETUP_S=11.0, SMOKE_S=0.8, PIPELINE_START_S=3.0)
    quiet = _row("quiet", 1.0, truth, 0.0)
    busy = copy.deepcopy(quiet)
    busy["run_id"] = "busy"
    for part in [*busy["stages"].values(), busy["pipeline"]]:
        part["measured"] *= 2.5
        part["contention"] = 2.5
    got = fit([busy], UNFITTED)
    for name in ("PROCESS_START_S", "TRAIN_SETUP_S", "SMOKE_S", "PIPELINE_START_S"):
        assert got[name]["value"] == pytest.approx(truth[name], abs=1e-3), name
    assert judged(busy, got)[1]
    assert "| contention (pipeline) | x2.50 |" in markdown([busy], got, set())
    unrecorded = copy.deepcopy(busy)
    for part in [*unrecorded["stages"].values(), unrecorded["pipeline"]]:
        del part["contention"]
    blind = fit([unrecorded], UNFITTED)
    for name in ("PROCESS_START_S", "TRAIN_SETUP_S", "SMOKE_S", "PIPELINE_START_S"):
        assert blind[name]["value"] > 2 * truth[name], name
    assert not judged(unrecorded, got)[1]
