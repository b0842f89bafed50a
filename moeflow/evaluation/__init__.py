"""Evaluation suites, runners, baselines and the regression gate (stage `regress`).

- `suite`: suite YAML / task JSONL schema, loading, dataset hashes.
- `scoring`: per-sample scores -> metrics with standard errors (lm-eval names).
- `runners`: in-process (model + PEFT adapter, sharded over Ray tasks) and
  OpenAI-compatible endpoint runners.
- `baseline`: record / load baselines in MLflow, compare with tolerances.
- `paired`, `ties`: per-sample deltas; output agreement where a near-tie flip is
  not a regression (also calibrate's end-to-end check).
- `report`: the diff table (metric, baseline, candidate, delta, threshold, verdict).
"""
