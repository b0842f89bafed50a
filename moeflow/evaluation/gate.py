"""Continuous regression: every model a pipeline produces, gated in one table.

Models (each a result dict of record.assemble, keyed by a label):
`adapter` (the fine-tune), `adapter '<name>'` (tenant adapters), `calibrated`
(the quantised checkpoint of the calibrate stage), and `base`. Each is gated

- against the base: adapters on task metrics (their target tasks must
  improve, the rest must not regress; paired deltas), the quantised model on
  task metrics and output agreement with its own looser tolerances;
- against the last baseline of the suite: the same model's results recorded
  then (`models` in the baseline artifact). Output agreement is gated when the
  model is the one recorded ("same model": same base manifest, adapter
  checksum, checkpoint fingerprint) — an unchanged model must reproduce its
  outputs — and reported only when it "changed" (retrained adapter, new
  base), whose task metrics are gated as usual.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from moeflow.evaluation.baseline import Agreement, Row, check_gain, compare


@dataclass
class Section:
    """Rows of one model against one reference."""

    model: str  # adapter | adapter 'x' | calibrated | base
    reference: str  # base | baseline 'demo'
    rows: list[Row]

    @property
    def failed(self) -> bool:
        return any(r.failed for r in self.rows)

    @property
    def title(self) -> str:
        return f"{self.model} vs {self.reference}"


def identity(*parts: str | None) -> str:
    """A model's identity from what it is made of (checksums), for 'same model?'."""
    return hashlib.sha256(":".join(p or "-" for p in parts).encode()).hexdigest()


def against_base(base: dict, models: dict[str, dict], targets: dict[str, list[str]],
                 calibrated: Agreement, min_gain: float = 0.0) -> list[Section]:
    """Every non-base model against the base.

    Args:
        base: the base's result.
        models: label -> result (adapters, `calibrated`).
        targets: label -> the tasks that adapter must improve (absent: none).
        calibrated: the agreement rule of the quantised model.
    """
    out = []
    for label, result in models.items():
        if label == "calibrated":
            rows = compare(base, result, label="base", agreement=calibrated)
        else:
            own = targets.get(label, [])
            rows = check_gain(base, result, own, min_gain) if own else []
            rows += compare(base, result, label="base", exclude=tuple(own))
        out.append(Section(label, "base", rows))
    return out


def against_baseline(reference: dict, label: str, models: dict[str, dict],
                     identities: dict[str, str], rule: Agreement) -> list[Section]:
    """Every model against its own results in the last baseline.

    Args:
        reference: the baseline artifact (the adapter's result at top level;
            other models under `models`, their identities under `identities`).
        label: the baseline's name for messages ("baseline 'demo'").
        models: label -> current result (including `base`).
        identities: label -> current identity.
        rule: tolerances of the output agreement (gated for an unchanged model).
    """
    recorded = dict(reference.get("models") or {})
    recorded.setdefault("adapter", reference)
    ref_ids = reference.get("identities") or {}
    out = []
    for name, result in models.items():
        if name not in recorded:
            continue
        same = ref_ids.get(name) is not None and ref_ids.get(name) == identities.get(name)
        agree = Agreement("gate" if same else "report", rule.max_kl, rule.min_token_agreement,
                          rule.tie_margin)
        rows = compare(recorded[name], result, label=label, agreement=agree)
        out.append(Section(name, f"{label} ({'same model' if same else 'changed'})", rows))
    return out
