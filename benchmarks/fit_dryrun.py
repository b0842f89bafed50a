"""Fit the dry run's host-measured constants from recorded pipeline runs.

    python benchmarks/fit_dryrun.py --collect sqlite:///PATH/mlflow.db   # add its runs to the data set
    python benchmarks/fit_dryrun.py            # refit from the data set, print the table
    python benchmarks/fit_dryrun.py --write    # ... and write moeflow/parallel/estimate_constants.py
    python benchmarks/fit_dryrun.py --check    # exit 1 when the shipped constants are not the refit's

The data set is the MLflow store: every pipeline run records the dry run's estimate
(`estimate.json`: each stage's terms; a host term names the constant it is built from and its
coefficient, units x the run's host factor) beside what each stage measured (`<stage>.seconds`,
`pipeline.seconds`). `--collect` copies the runs in which every estimated stage ran (none
reused) into benchmarks/data/dryrun_runs.json, the committed rows the fit reads, so the
shipped constants can be re-created from them. `--host-factor F` prices each collected run by a
dry run of its own recorded config (config.yaml, its stages) at host factor F instead: the
probe a run records is a 0.6 s sample, and beside another pipeline's Ray starting or shutting
down it reads several times the host's speed (docs/dryrun.md, "Status of the fit").

The fit: runs whose host probe read more than MAX_HOST_FACTOR x the anchor's are left out
(on a host that busy one probe does not measure its speed). Each stage has one constant of
its own (FITTED). One run gives one sample of it: the stage's measured seconds minus its other
terms (host terms re-priced at the constants' current values), divided by its coefficient --
seconds on the anchor host at the anchor's probe time.
The constant is the median over runs. Stages are fitted in DAG order, so PROCESS_START_S,
fitted on convert (two starts), prices the later stages' starts. PIPELINE_START_S is the
pipeline's measured wall time during which no stage's run was open (the union of the child
runs' intervals taken out), so a critical path that is not the one the stages took shows as a
miss of the pipeline's estimate, not as parent-run overhead. Every
other constant is kept as it is and labelled assumed: no stage measures it apart from another.
Serving's search term (its budget, or two deployments) is taken as recorded.

Contention: the estimate is a run's time with the host to itself (the probe reads the core's
speed, not how many processes share it), so a run on a shared host is slower than its estimate
by the contention it met. `benchmarks/bench_dryrun.py` measures that factor per stage (the
threads running beside the demo's) and records it on the run (`<stage>.contention`,
`pipeline.contention`); `--collect` keeps it, and the fit and the verdicts read each stage's
measured seconds over its factor (1 where a run recorded none), i.e. the time it would have
taken alone, the quantity the estimate is for.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
DATA = REPO / "benchmarks" / "data" / "dryrun_runs.json"
CONSTANTS = REPO / "moeflow" / "parallel" / "estimate_constants.py"
HEADER = '''"""The dry run's host-measured constants (moeflow/parallel/estimate.py), each with its provenance.

Seconds on the anchor host (cpu-local) at its probe time ANCHOR_PROBE_S; a dry run on a host of
that kind scales them by its own probe. Written by benchmarks/fit_dryrun.py --write from the
pipeline runs in benchmarks/data/dryrun_runs.json (each run's estimate.json beside its measured
<stage>.seconds): basis "fitted" names the stage whose residual fits it and the runs; "assumed"
is a figure no recorded run measures on its own. ANCHOR_PROBE_HOW says where ANCHOR_PROBE_S
came from. Not edited by hand: tests/test_fit_dryrun.py refits the committed runs and fails
when a fitted value differs.
"""

from typing import Any

'''


def shipped() -> dict:
    """The constants module as committed: {"anchor_probe_s", "constants"}."""
    scope: dict = {}
    exec(compile(CONSTANTS.read_text(), str(CONSTANTS), "exec"), scope)  # noqa: S102 - our own file
    return {"anchor_probe_s": scope["ANCHOR_PROBE_S"], "anchor_how": scope.get("ANCHOR_PROBE_HOW", ""),
            "constants": scope["CONSTANTS"]}


def anchor(host_factor: float, readings: int = 5) -> dict:
    """ANCHOR_PROBE_S from this host: the median of `readings` probe_host() calls here over
    `host_factor` (the factor this host's runs in the data set are priced at), with how."""
    import datetime

    from moeflow.parallel.estimate import probe_host

    got = sorted(probe_host() for _ in range(readings))
    med = got[len(got) // 2]
    day = datetime.date.today().isoformat()
    return {"anchor_probe_s": round(med / host_factor, 4),
            "anchor_how": f"probe_host() read {med:.4f} s (median of {readings}, {got[0]:.4f}-{got[-1]:.4f}) on "
                          f"{day} on the host of the data set's runs priced at host x{host_factor:g}: "
                          f"{med:.4f} / {host_factor:g} (benchmarks/fit_dryrun.py --anchor {host_factor:g})"}


def write(data: dict) -> None:
    """The constants module: a Python literal, one constant per entry."""
    import pprint

    body = pprint.pformat(data["constants"], width=110, sort_dicts=False)
    how = pprint.pformat(data["anchor_how"], width=100)
    CONSTANTS.write_text(f"{HEADER}ANCHOR_PROBE_S = {data['anchor_probe_s']!r}\n"
                         f"ANCHOR_PROBE_HOW = {how}\n\n"
                         f"CONSTANTS: dict[str, dict[str, Any]]\nCONSTANTS = {body}\n")
# a run whose probe read more than this times the anchor's is kept in the data set but left out
# of the fit: on a host that busy the probe is a point sample of a load that changes by the
# second (docs/dryrun.md: at load 15-40 it read 18.9x and 75x while the demo ran 10x and 6.5x
# slower than on a quiet host)
MAX_HOST_FACTOR = 3.0
# configs whose runs check the fit out of sample: never fitted, always judged (sizes the demo's
# runs never had: finetune.max_steps 500, calibrate.samples 16, serving.budget_s 30,
# operators.max_calibration 32, named demo-heldout)
HELD_OUT = ("demo-heldout",)
FITTED = {"convert": "PROCESS_START_S", "plan": "CHART_S", "operators": "EPLB_S",
          "calibrate": "CALIBRATE_S", "finetune": "TRAIN_SETUP_S", "regress": "EVAL_MODEL_S",
          "serving": "SERVING_TAIL_S", "deploy": "SMOKE_S"}


def priced_at(client, run, host_factor: float) -> dict:
    """The dry run of a recorded run's own config (its config.yaml, its stages) with the host
    factor given instead of probed: estimate.json's shape."""
    import dataclasses

    import yaml

    from moeflow.core import tracking as T
    from moeflow.core.config import validate
    from moeflow.parallel.estimate import ANCHOR_PROBE_S, estimate
    from workflows.dag import registry
    from workflows.dryrun import gather

    cfg = validate(yaml.safe_load(T.download_text(client, run.info.run_id, "config.yaml")))
    names = run.data.tags.get("moeflow.stages", "").split(",")
    stages = {n: s for n, s in registry().items() if n in names}
    inp = dataclasses.replace(gather(cfg, stages), host_probe_s=ANCHOR_PROBE_S * host_factor)
    return estimate(inp).as_dict()


def collect(uri: str, host_factor: float | None = None) -> list[dict]:
    """The pipeline runs of a store whose every estimated stage ran: one row each, priced by
    the estimate the run recorded, or, with `host_factor`, by the dry run of its recorded
    config at that host factor (the probe the run recorded is kept beside it)."""
    from moeflow.core import tracking as T

    client = T.client_for(uri)
    rows = []
    for exp in client.search_experiments():
        for run in client.search_runs([exp.experiment_id], f"tags.`{T.KIND}` = 'pipeline'"):
            m = run.data.metrics
            if "pipeline.seconds" not in m or "pipeline.est_seconds" not in m:
                continue  # no estimate, or a stage failed or was reused
            est = json.loads(T.download_text(client, run.info.run_id, "estimate.json"))
            extra = {}
            if host_factor is not None:
                extra = {"probe_host_factor": est.get("host_factor", 1.0),
                         "estimate": f"its config.yaml priced at host x{host_factor:g} (given, not probed)"}
                est = priced_at(client, run, host_factor)
            stages = {s["stage"]: {"measured": m[f"{s['stage']}.seconds"],
                                   "terms": [{k: t.get(k, "") for k in ("what", "seconds", "const", "coef")}
                                             for t in s["terms"]],
                                   **_contention(m, s["stage"])}
                      for s in est["stages"] if s["terms"]}
            rows.append({"run_id": run.info.run_id, "config": run.data.tags.get("moeflow.config_name"),
                         "host_factor": est.get("host_factor", 1.0), **extra, "stages": stages,
                         "critical_path": est["critical_path"], "pipeline": {
                             "measured": m["pipeline.seconds"], "estimated": est["wall_s"],
                             "in_stages": _in_stages(T.child_runs(client, run)), **_contention(m, "pipeline")}})
    return rows


def _contention(metrics: dict, name: str) -> dict:
    """{"contention": F} when the run recorded `<name>.contention` (bench_dryrun.py), else {}."""
    f = metrics.get(f"{name}.contention")
    return {"contention": f} if f else {}


def alone(part: dict, seconds: float | None = None) -> float:
    """A stage's (or the pipeline's) measured seconds, or `seconds`, over the contention its run
    recorded: the time it would have taken with the host to itself."""
    return (part["measured"] if seconds is None else seconds) / part.get("contention", 1.0)


def _in_stages(children: list) -> float:
    """Seconds of the pipeline during which at least one stage's run was open (the union of
    the finished stage runs' intervals): the rest is the parent run's own time."""
    spans = sorted((r.info.start_time / 1e3, r.info.end_time / 1e3) for r in children
                   if r.info.status == "FINISHED" and r.info.end_time)
    total, reach = 0.0, float("-inf")
    for start, end in spans:
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def _residual(stage: dict, name: str, values: dict[str, float]) -> tuple[float, float]:
    """(measured - every term not built from `name`, the coefficient of `name` in it)."""
    other, coef = 0.0, 0.0
    for t in stage["terms"]:
        if t["const"] == name:
            coef += t["coef"]
        elif t["const"]:
            other += values[t["const"]] * t["coef"]
        else:
            other += t["seconds"]
    return alone(stage) - other, coef


def fit(rows: list[dict], shipped: dict, held_out: tuple[str, ...] = HELD_OUT) -> dict[str, dict]:
    """Every constant with its value and provenance (estimate_constants.py's CONSTANTS), from
    the rows of configs not `held_out`."""
    out = {k: dict(v) for k, v in shipped["constants"].items()}
    values = {k: v["value"] for k, v in out.items()}
    rows = [r for r in rows if r["host_factor"] <= MAX_HOST_FACTOR and r["config"] not in held_out
            and not r.get("left_out")]
    for stage, name in [*FITTED.items(), ("pipeline", "PIPELINE_START_S")]:
        samples, runs = [], []
        for row in rows:
            if stage == "pipeline":  # the time no stage ran (rows collected before: off the path)
                ran = row["pipeline"].get("in_stages")
                if ran is None:
                    ran = sum(row["stages"][s]["measured"] for s in row["critical_path"])
                rest, coef = alone(row["pipeline"], row["pipeline"]["measured"] - ran), row["host_factor"]
            elif stage in row["stages"]:
                rest, coef = _residual(row["stages"][stage], name, values)
            else:
                continue
            if coef > 0:
                samples.append(rest / coef)
                runs.append(row["run_id"])
        if not samples:
            continue  # no run measured it: stays as shipped (assumed)
        med = statistics.median(samples)
        values[name] = round(max(0.0, med), 3)
        was = shipped["constants"][name]
        out[name] = {"value": values[name], "basis": "fitted",
                     "what": was.get("what") or was["how"].split("; fitted on")[0],
                     "how": f"{stage}: measured minus its other terms, per run / coefficient; the "
                            f"median of {len(samples)} run(s), {min(samples):.3g} to {max(samples):.3g}"
                            + (" (negative: the other terms over-price it; held at 0)" if med < 0 else ""),
                     "runs": runs}
    return out


def reprice(row: dict, constants: dict[str, dict]) -> dict[str, float]:
    """A recorded run's estimate with `constants`: each host term re-priced (value x its
    coefficient), every other term as recorded; the pipeline along the recorded critical path."""
    values = {k: v["value"] for k, v in constants.items()}
    est = {name: sum(values[t["const"]] * t["coef"] if t["const"] else t["seconds"] for t in st["terms"])
           for name, st in row["stages"].items()}
    est["pipeline"] = (sum(est[s] for s in row["critical_path"])
                       + values["PIPELINE_START_S"] * row["host_factor"])
    return est


STAGE_TARGET, PIPELINE_TARGET = 2.0, 1.5  # measured / estimated, either way (issue 50)


def judged(row: dict, constants: dict[str, dict]) -> tuple[dict[str, tuple[float, float]], bool]:
    """A recorded run against `constants`: {stage or "pipeline": (estimated, measured) s} and
    whether every stage is within STAGE_TARGET and the pipeline within PIPELINE_TARGET."""
    est = reprice(row, constants)
    measured = {**{n: alone(s) for n, s in row["stages"].items()}, "pipeline": alone(row["pipeline"])}
    pairs = {n: (est[n], measured[n]) for n in est}

    def within(n: str, target: float) -> bool:
        e, m = pairs[n]
        return e > 0 and 1 / target <= m / e <= target

    ok = all(within(n, STAGE_TARGET) for n in pairs if n != "pipeline") and within("pipeline", PIPELINE_TARGET)
    return pairs, ok


def held_out(rows: list[dict], constants: dict[str, dict]) -> list[str]:
    """Measured / estimated per stage of runs the fit did not see (targets: 2x, pipeline 1.5x)."""
    lines = []
    for row in rows:
        if row.get("left_out"):
            continue  # shown in --markdown with its reason, not a verdict on this fit
        pairs, ok = judged(row, constants)
        lines.append(f"held out {row['run_id']} ({row['config']}, host x{row['host_factor']:.2f}): "
                     + ", ".join(f"{n} {e:.1f}/{m:.1f} s = {m / e:.2f}" if e > 0 else f"{n} 0/{m:.1f} s"
                                 for n, (e, m) in pairs.items())
                     + f" -> {'PASS' if ok else 'FAIL'} (every stage within {STAGE_TARGET:g}x, "
                       f"the pipeline within {PIPELINE_TARGET:g}x)")
    return lines


def markdown(rows: list[dict], constants: dict[str, dict], held: set[str]) -> str:
    """Every run against `constants` as one markdown table (docs/dryrun.md): estimated /
    measured seconds (over the contention the run recorded) and their ratio per stage, one
    column per run; runs marked left out are listed under it with their reasons."""
    gone = [r for r in rows if r.get("left_out")]
    judged_rows = [(r, *judged(r, constants)) for r in rows if not r.get("left_out")]
    head = ["stage"] + [f"{r['run_id'][:8]} ({r['config']}{', held out' if r['config'] in held else ''}"
                        f"{', left out: busy host' if r['host_factor'] > MAX_HOST_FACTOR else ''}"
                        f"; host x{r['host_factor']:.2f})" for r, _, _ in judged_rows]
    names = list(dict.fromkeys(n for _, pairs, _ in judged_rows for n in pairs))
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for n in names:
        cells = []
        for _, pairs, _ in judged_rows:
            e, m = pairs.get(n, (0.0, 0.0))
            cells.append(f"{e:.1f} / {m:.1f} s = {m / e:.2f}" if e > 0 else (f"0 / {m:.1f} s" if n in pairs else "-"))
        out.append(f"| {n} | " + " | ".join(cells) + " |")
    if any("contention" in r["pipeline"] for r, _, _ in judged_rows):
        out.append("| contention (pipeline) | " + " | ".join(
            f"x{r['pipeline']['contention']:.2f}" if "contention" in r["pipeline"] else "not recorded"
            for r, _, _ in judged_rows) + " |")
    out.append("| targets met | " + " | ".join("yes" if ok else "no" for _, _, ok in judged_rows) + " |")
    reasons: dict[str, list[str]] = {}
    for r in gone:
        reasons.setdefault(r["left_out"], []).append(r["run_id"][:8])
    out += [""] + [f"Left out ({why}): {', '.join(ids)}." for why, ids in reasons.items()] if gone else []
    return "\n".join(out)


def table(constants: dict[str, dict], shipped: dict) -> str:
    lines = [f"{'constant':28} {'shipped':>9} {'fit':>9}  basis"]
    for name, c in constants.items():
        lines.append(f"{name:28} {shipped['constants'][name]['value']:9.3f} {c['value']:9.3f}  "
                     f"{c['basis']}: {c['how'][:90]}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--collect", metavar="TRACKING_URI", action="append", default=[],
                    help="add this store's complete pipeline runs to the data set first")
    ap.add_argument("--host-factor", type=float, default=None, metavar="F",
                    help="--collect prices each run by a dry run of its recorded config at host factor F "
                         "instead of the estimate it recorded (whose probe read a moment of contention)")
    ap.add_argument("--data", type=Path, default=DATA, help=f"the rows (default: {DATA.relative_to(REPO)})")
    ap.add_argument("--exclude-config", action="append", default=list(HELD_OUT),
                    help=f"leave runs of this config name out of the fit and judge them against it "
                         f"(an out-of-sample check; always: {', '.join(HELD_OUT)})")
    ap.add_argument("--leave-out", action="append", default=[], metavar="RUN_ID",
                    help="mark this run (an id or its prefix) in the data set as left out of the fit and the "
                         "verdicts, with --why; it stays in the data set and in --markdown with the reason")
    ap.add_argument("--why", default=None, help="the reason --leave-out records")
    ap.add_argument("--write", action="store_true", help="write the fitted constants")
    ap.add_argument("--check", action="store_true", help="exit 1 unless the shipped constants are the fit's")
    ap.add_argument("--anchor", type=float, default=None, metavar="F",
                    help="with --write: ANCHOR_PROBE_S from probe_host() on this host, whose runs are "
                         "priced at host factor F")
    ap.add_argument("--markdown", action="store_true",
                    help="print every run against the fit as a markdown table (docs/dryrun.md)")
    args = ap.parse_args()
    rows = json.loads(args.data.read_text()) if args.data.is_file() else []
    for uri in args.collect:
        have = {r["run_id"] for r in rows}
        new = [r for r in collect(uri, args.host_factor) if r["run_id"] not in have]
        rows += new
        print(f"{uri}: {len(new)} new run(s)")
    if args.leave_out and not args.why:
        ap.error("--leave-out needs --why (the reason kept beside the run)")
    for prefix in args.leave_out:
        hit = [r for r in rows if r["run_id"].startswith(prefix)]
        if len(hit) != 1:
            ap.error(f"--leave-out {prefix}: matches {len(hit)} run(s) in {args.data}")
        hit[0]["left_out"] = args.why
    if args.collect or args.leave_out:
        args.data.parent.mkdir(parents=True, exist_ok=True)
        args.data.write_text(json.dumps(rows, indent=1) + "\n")
    current = shipped()
    used = [r for r in rows if r["config"] not in args.exclude_config]
    fitted = fit(used, current, tuple(args.exclude_config))
    busy = [r["run_id"] for r in used if r["host_factor"] > MAX_HOST_FACTOR and not r.get("left_out")]
    marked = [r["run_id"] for r in rows if r.get("left_out")]
    print(f"{len(used) - len(busy) - len([r for r in used if r.get('left_out')])} run(s) fitted "
          f"({len([r for r in rows if r not in used and not r.get('left_out')])} held out; {len(busy)} on a host "
          f"over {MAX_HOST_FACTOR:g}x the anchor's probe left out: {', '.join(busy) or '-'}; "
          f"{len(marked)} marked left out)")
    print(table(fitted, current))
    for line in held_out([r for r in rows if r["config"] in args.exclude_config], fitted):
        print(line)
    if args.markdown:
        print(markdown(rows, fitted, set(args.exclude_config)))
    if args.write:
        write(dict(current, **(anchor(args.anchor) if args.anchor else {}), constants=fitted))
        print(f"wrote {CONSTANTS.relative_to(REPO)}")
    if args.check and fitted != current["constants"]:
        print("the shipped constants are not what these runs fit", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
