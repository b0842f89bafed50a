"""Evaluation suites: a YAML file naming tasks; a task is a JSONL file plus a type.

Suite YAML (paths relative to the YAML file)::

    name: golden
    target_tasks: [reverse_nll]        # what a fine-tune is meant to improve
    tasks:
      - name: reverse_nll
        type: perplexity               # multiple_choice | generation | perplexity | multimodal
        file: reverse_heldout.jsonl
        abs_tol: 0.05                  # a metric fails when it worsens by more than
        k_stderr: 2.0                  #   max(abs_tol, k_stderr * baseline stderr)

Record shapes per task type (one JSON object per line):

- multiple_choice: {"context": str, "choices": [str, ...], "gold": int}
- generation: {"prompt": str, "target": str | [str, ...]} ("completion" is
  accepted for "target", so a fine-tuning eval file is a task as it is)
- perplexity: {"text": str} (whole text) or {"prompt": str, "completion": str}
  (the completion given the prompt)
- multimodal: {"image": "<path beside the JSONL>", "question": str,
  "choices": [str, ...], "gold": int}
- lm_eval: no `file`; `task_dir` (lm-eval task YAML + local data), `task`
  (lm-eval task name), `metric` (the gated one, e.g. acc); endpoint runner
  only (see lmeval.py)

Every file a task reads (the JSONL and its images) is hashed with SHA-256; the
hashes travel with every result so a baseline recorded on other data is refused.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import ErrorDetails

from moeflow.core.config import read_yaml
from moeflow.core.errors import UserError

TaskType = Literal["multiple_choice", "generation", "perplexity", "multimodal", "lm_eval"]
GOLDEN_SUITE = Path(__file__).resolve().parents[2] / "configs" / "suites" / "golden.yaml"
# settings that change what a metric means; a baseline must agree on them
_MEANINGFUL = ("type", "match", "max_new_tokens", "stop", "limit")


class TaskSpec(BaseModel):
    """One task of a suite (a YAML list entry)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")  # part of MLflow metric names
    type: TaskType
    file: str | None = None  # JSONL, relative to the suite YAML (all types but lm_eval)
    task_dir: str | None = None  # lm_eval: dir of lm-eval task YAML + data, relative
    task: str | None = None  # lm_eval: lm-eval task name in task_dir
    metric: str = "acc"  # lm_eval: the metric that gates (others are informational)
    num_fewshot: int | None = Field(default=None, ge=0)  # lm_eval: None = the YAML's
    tokenizer: str | None = None  # lm_eval: served model's local HF tokenizer dir
    match: Literal["exact", "contains", "regex"] = "exact"  # generation scoring
    max_new_tokens: int = Field(default=16, ge=1)  # generation budget
    stop: list[str] = Field(default_factory=lambda: ["\n"])  # generation ends at these
    limit: int | None = Field(default=None, ge=1)  # first N records only
    abs_tol: float = Field(default=0.02, ge=0)  # absolute tolerance of the gate
    k_stderr: float = Field(default=2.0, ge=0)  # tolerance in baseline standard errors
    required: bool = False  # True: a model that cannot run this task is an error, not a skip
    description: str = ""

    @model_validator(mode="after")
    def _fields_of_type(self):
        if self.type == "lm_eval":
            missing = [k for k in ("task_dir", "task") if not getattr(self, k)]
            if missing or self.file:
                raise ValueError(f"an lm_eval task needs {' and '.join(missing) or 'no file'}"
                                 + ("" if not self.file else " (not `file`)"))
        elif not self.file:
            raise ValueError(f"a {self.type} task needs `file`")
        return self


class SuiteSpec(BaseModel):
    """A suite YAML file."""

    model_config = ConfigDict(extra="forbid")

    name: str
    version: int | str = 1
    description: str = ""
    target_tasks: list[str] = Field(default_factory=list)  # a fine-tune must improve these
    tasks: list[TaskSpec] = Field(min_length=1)


@dataclass
class Task:
    """A loaded task: its spec, validated records and the hashes of its files."""

    spec: TaskSpec
    path: Path  # the JSONL
    records: list[dict]
    files: dict[str, str]  # path relative to the suite dir -> sha256
    sha256: str  # over every file above

    @property
    def name(self) -> str:
        return self.spec.name

    def identity(self) -> dict:
        """What a baseline must share with a candidate for their metrics to compare."""
        spec = self.spec.model_dump(mode="json")
        if spec["type"] == "lm_eval":
            return {"sha256": self.sha256, "files": dict(self.files),
                    **{k: spec[k] for k in ("type", "task", "metric", "num_fewshot", "limit")}}
        return {"sha256": self.sha256, "files": dict(self.files),
                **{k: spec[k] for k in _MEANINGFUL}}


@dataclass
class Suite:
    """A loaded suite."""

    spec: SuiteSpec
    path: Path
    tasks: list[Task] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def sha256(self) -> str:
        """Hash of every task's identity: equal suites give equal hashes."""
        blob = json.dumps({t.name: t.identity() for t in self.tasks}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()

    def task(self, name: str) -> Task:
        for task in self.tasks:
            if task.name == name:
                return task
        raise UserError(f"{self.path}: no task named {name!r}; "
                        f"tasks: {', '.join(t.name for t in self.tasks)}")


def sha256_file(path: Path) -> str:
    """SHA-256 of a file, streamed in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def shipped_suites_version() -> str:
    """Hash of the shipped suite files (configs/suites/): stages that read them use it as
    their StageSpec.version, so editing the golden data reruns them (a custom suite YAML
    is fingerprinted by the DAG's cache key)."""
    root = GOLDEN_SUITE.parent
    files = sorted(p for p in root.rglob("*") if p.is_file())
    return "1-" + hashlib.sha256("".join(f"{p.relative_to(root)}:{sha256_file(p)}\n"
                                         for p in files).encode()).hexdigest()[:12]


def load_suite(path: str | Path | None = None) -> Suite:
    """Load and validate a suite YAML and every task file it names.

    Args:
        path: suite YAML; None loads the shipped golden suite.

    Returns:
        The loaded `Suite`.

    Raises:
        UserError: malformed YAML, unknown key, missing file, bad record, missing image.
    """
    path = Path(path) if path is not None else GOLDEN_SUITE
    raw = read_yaml(path, "suite file")
    try:
        spec = SuiteSpec.model_validate(raw)
    except ValidationError as exc:
        raise UserError(f"{path}: " + "; ".join(_describe(e) for e in exc.errors())) from None
    names = [t.name for t in spec.tasks]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise UserError(f"{path}: duplicate task names: {', '.join(dupes)}")
    for name in spec.target_tasks:
        if name not in names:
            raise UserError(f"{path}: target_tasks names {name!r}, which is not a task here")
    suite = Suite(spec=spec, path=path.resolve())
    suite.tasks = [load_task(t, suite.path.parent) for t in spec.tasks]
    return suite


def _describe(err: ErrorDetails) -> str:
    key = ".".join(str(p) for p in err["loc"]) or "<root>"
    if err["type"] == "extra_forbidden":
        return f"unknown key `{key}`"
    if err["type"] == "missing":
        return f"missing required key `{key}`"
    return f"`{key}`: {err['msg']} (got {err.get('input')!r})"


def load_task(spec: TaskSpec, root: Path) -> Task:
    """Read, validate and hash one task's JSONL (and its images)."""
    if spec.type == "lm_eval":
        return _load_lm_eval_task(spec, root)
    assert spec.file is not None  # TaskSpec requires `file` for every type but lm_eval
    path = (root / spec.file).resolve()
    if not path.is_file():
        raise UserError(f"task {spec.name}: file not found: {path}")
    records: list[dict] = []
    with open(path, "rb") as fh:  # line by line; every line is checked, `limit` are kept
        for lineno, raw in enumerate(fh, start=1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise UserError(f"{where}: not UTF-8") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UserError(f"{where}: invalid JSON: {exc.msg}") from None
            record = _check_record(spec.type, record, where, path.parent)
            if not spec.limit or len(records) < spec.limit:
                records.append(record)
    if not records:
        raise UserError(f"{path}: task {spec.name} has no records")
    files = {_rel(path, root): sha256_file(path)}
    for record in records:
        if "image_path" in record:
            image = Path(record["image_path"])
            files.setdefault(_rel(image, root), sha256_file(image))
    blob = json.dumps(sorted(files.items())).encode()
    return Task(spec=spec, path=path, records=records, files=files,
                sha256=hashlib.sha256(blob).hexdigest())


def _load_lm_eval_task(spec: TaskSpec, root: Path) -> Task:
    """An lm_eval task: its dir's files hashed; records come from lm-eval at run time."""
    assert spec.task_dir is not None  # TaskSpec requires it for an lm_eval task
    task_dir = (root / spec.task_dir).resolve()
    if not task_dir.is_dir():
        raise UserError(f"task {spec.name}: task_dir not found: {task_dir}")
    if spec.tokenizer and not Path(spec.tokenizer).is_absolute():
        spec = spec.model_copy(update={"tokenizer": str((root / spec.tokenizer).resolve())})
    files = hash_task_dir(task_dir, root)
    return Task(spec=spec, path=task_dir, records=[], files=files, sha256=task_sha256(files))


def hash_task_dir(task_dir: Path, root: Path) -> dict[str, str]:
    """SHA-256 of every file under an lm-eval task dir, keyed relative to `root`."""
    files = sorted(p for p in task_dir.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    if not any(p.suffix in (".yaml", ".yml") for p in files):
        raise UserError(f"lm_eval task_dir has no task YAML: {task_dir}")
    return {_rel(p, root): sha256_file(p) for p in files}


def task_sha256(files: dict[str, str]) -> str:
    """Hash over the files of a task (same rule as load_task)."""
    return hashlib.sha256(json.dumps(sorted(files.items())).encode()).hexdigest()


def _rel(path: Path, root: Path) -> str:
    try:
        return str(path.relative_to(root))
    except ValueError:
        return str(path)


def _check_record(kind: str, rec: Any, where: str, base: Path) -> dict:
    """Validate one record of a task type; returns it normalised."""
    if not isinstance(rec, dict):
        raise UserError(f"{where}: a record must be a JSON object")

    def text(key: str, alias: str | None = None, nonempty: bool = False) -> str:
        value = rec.get(key, rec.get(alias) if alias else None)
        if not isinstance(value, str) or (nonempty and not value):
            raise UserError(f"{where}: field `{key}` must be a {'non-empty ' * nonempty}"
                            f"string (got {value!r})")
        return value

    if kind == "generation":
        target = rec.get("target", rec.get("completion"))
        targets = [target] if isinstance(target, str) else target
        if not (isinstance(targets, list) and targets and all(isinstance(t, str) for t in targets)):
            raise UserError(f"{where}: field `target` must be a string or a list of strings")
        return {"prompt": text("prompt", nonempty=True), "targets": targets}
    if kind == "perplexity":  # an empty scored text has no bytes: bits per byte is 0 / 0
        if "text" in rec:
            return {"prompt": "", "completion": text("text", nonempty=True)}
        return {"prompt": text("prompt"), "completion": text("completion", nonempty=True)}
    if kind == "multimodal":
        out = _choices(rec, where) | {"question": text("question")}
        image = base / text("image")
        if not image.is_file():
            raise UserError(f"{where}: image not found: {image}")
        return out | {"image_path": str(image.resolve())}
    return _choices(rec, where) | {"context": text("context", "prompt")}


def _choices(rec: dict, where: str) -> dict:
    choices, gold = rec.get("choices"), rec.get("gold")
    if not (isinstance(choices, list) and len(choices) >= 2
            and all(isinstance(c, str) and c for c in choices)):
        raise UserError(f"{where}: field `choices` must list at least 2 non-empty strings")
    if not (isinstance(gold, int) and not isinstance(gold, bool) and 0 <= gold < len(choices)):
        raise UserError(f"{where}: field `gold` must be an index into `choices` "
                        f"(0..{len(choices) - 1}), got {gold!r}")
    return {"choices": choices, "gold": gold}
