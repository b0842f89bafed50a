"""`regress:` section — evaluation suite and regression gate."""

from moeflow.sections import Section


class RegressSection(Section):
    suite: str | None = None  # suite YAML; None: the shipped golden suite
    baseline: str | None = None  # compare against this recorded baseline name
