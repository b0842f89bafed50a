"""Fine-tuning data: JSONL -> tokenised examples -> packed rows of `seq_len`.

Two record shapes per line, as LLaMA-Factory / torchtune accept them:
  {"prompt": "...", "completion": "..."}
  {"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}
Chat records are rendered with the tokenizer's own chat template; the last
message must be the assistant's and is the completion. Loss is taken on the
completion tokens only (labels -100 elsewhere).

Packing puts several whole examples in one row and restarts `position_ids` at
each example, so transformers' packed-sequence detection (masking_utils.
find_packed_sequence_indices) builds a block-diagonal causal mask: examples in
one row never attend to each other. Axis letters: R rows, S seq_len.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

from moeflow.core.errors import UserError

IGNORE = -100  # label of tokens that carry no loss (prompt, padding)


@dataclass
class Example:
    """One tokenised example: prompt ids then completion ids (+ eos)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    prompt: str  # text, kept for generation-based evaluation
    completion: str
    task: str | None = None  # optional `task` tag of the record (exact match per task)


def _check_record(obj: Any, where: str) -> dict:
    """Validate one parsed line; returns it or raises UserError naming `where`."""
    if not isinstance(obj, dict):
        raise UserError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if "messages" in obj:
        msgs = obj["messages"]
        if not isinstance(msgs, list) or len(msgs) < 2:
            raise UserError(f"{where}: `messages` must be a list of at least 2 messages")
        for i, m in enumerate(msgs):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                    and isinstance(m.get("content"), str)):
                raise UserError(f"{where}: messages[{i}] needs string `role` and `content`")
        if msgs[-1]["role"] != "assistant" or not msgs[-1]["content"].strip():
            raise UserError(f"{where}: the last message must be a non-empty assistant reply")
        return obj
    missing = [k for k in ("prompt", "completion") if k not in obj]
    if missing:
        raise UserError(f"{where}: missing field(s) {', '.join(missing)} "
                        "(expected prompt/completion or messages)")
    for key in ("prompt", "completion"):
        if not isinstance(obj[key], str) or not obj[key].strip():
            raise UserError(f"{where}: `{key}` must be a non-empty string")
    return obj


class JsonlFile:
    """A JSONL data file, validated and read line by line (never whole in memory).

    Iterating yields (`file:line`, record) for every valid line; each pass
    re-reads the file and recounts `skipped`.

    Args:
        path: the file.
        on_bad_line: "error" raises at the first bad line; "skip" skips it.

    Raises:
        UserError: missing file (at construction); a bad line (file:line and why)
            or no usable record (while iterating).
    """

    def __init__(self, path: str | Path, on_bad_line: str = "error"):
        self.path = Path(path)
        if not self.path.is_file():
            raise UserError(f"data file not found: {self.path}")
        self.on_bad_line = on_bad_line
        self.skipped = 0

    def __iter__(self) -> Iterator[tuple[str, dict]]:
        self.skipped, good = 0, 0
        with self.path.open("rb") as fh:
            for lineno, raw in enumerate(fh, start=1):
                where = f"{self.path}:{lineno}"
                try:
                    record = _parse_line(raw, where)
                except UserError as exc:
                    self.bad_line(exc)
                    continue
                good += 1
                yield where, record
        if not good:
            raise UserError(f"{self.path}: no usable records")

    def bad_line(self, exc: UserError) -> None:
        """Count a bad line in skip mode; otherwise raise its error with the hint."""
        if self.on_bad_line != "skip":
            raise UserError(f"{exc} (set data.on_bad_line: skip to skip bad lines)") from None
        self.skipped += 1


def _parse_line(raw: bytes, where: str) -> dict:
    try:
        text = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise UserError(f"{where}: not UTF-8") from None
    if not text:
        raise UserError(f"{where}: empty line")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"{where}: not valid JSON ({exc.msg})") from None
    return _check_record(obj, where)


def read_jsonl(path: str | Path, on_bad_line: str = "error") -> tuple[list[dict], int]:
    """Read and validate a whole JSONL file (small files; `JsonlFile` streams).

    Returns:
        (records, number of skipped lines).

    Raises:
        UserError: missing file, bad line (file:line and why), or no records.
    """
    src = JsonlFile(path, on_bad_line)
    records = [record for _, record in src]
    return records, src.skipped


def validate_jsonl(path: str | Path, on_bad_line: str = "error") -> tuple[int, int]:
    """Check every line of a JSONL file, streaming; returns (records, skipped lines)."""
    src = JsonlFile(path, on_bad_line)
    return sum(1 for _ in src), src.skipped


def file_sha256(*paths: str | Path | None) -> str:
    """sha256 over the bytes of the given files (in order); the dataset hash."""
    digest = hashlib.sha256()
    for p in paths:
        if p is None:
            continue
        with open(p, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


def _split_chat(tokenizer, messages: list[dict]) -> tuple[str, str]:
    """Render a chat with the tokenizer's template; return (prompt text, completion text)."""
    if not getattr(tokenizer, "chat_template", None):
        raise UserError("chat `messages` data needs a tokenizer with a chat template")
    prefix = tokenizer.apply_chat_template(messages[:-1], tokenize=False,
                                           add_generation_prompt=True)
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    if not full.startswith(prefix):
        raise UserError("the tokenizer's chat template does not render the conversation "
                        "as prompt + reply; use prompt/completion records")
    return prefix, full[len(prefix):]


def tokenize_one(rec: dict, tokenizer, keep_text: bool = True) -> Example:
    """Tokenise one record (prompt and completion separately, as generation sees them).

    Args:
        keep_text: keep the prompt/completion strings (generation-based
            evaluation needs them; training rows do not).

    Returns:
        An Example whose completion ends with the tokenizer's eos token.
    """
    if "messages" in rec:
        prompt, completion = _split_chat(tokenizer, rec["messages"])
    else:
        prompt, completion = rec["prompt"], rec["completion"]
    eos = tokenizer.eos_token_id
    p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    c_ids = tokenizer(completion, add_special_tokens=False)["input_ids"]
    task = rec.get("task") if isinstance(rec.get("task"), str) else None
    return Example(p_ids, c_ids + ([eos] if eos is not None else []),
                   prompt if keep_text else "", completion if keep_text else "", task)


def tokenize(records: list[dict], tokenizer) -> list[Example]:
    """Tokenise records (see `tokenize_one`)."""
    return [tokenize_one(rec, tokenizer) for rec in records]


def held_out(n: int, fraction: float, seed: int) -> set[int]:
    """Indices of the records held out for evaluation (seeded shuffle of 0..n-1).

    Raises:
        UserError: the fraction leaves no training record.
    """
    if fraction <= 0:
        return set()
    idx = list(range(n))
    random.Random(seed).shuffle(idx)
    n_eval = max(1, int(round(n * fraction)))
    if n_eval >= n:
        raise UserError(f"data.eval_fraction={fraction} leaves no training records "
                        f"({n} in total)")
    return set(idx[:n_eval])


def pack(examples: Iterable[Example], seq_len: int, pad_id: int) -> dict[str, torch.Tensor]:
    """Greedily pack whole examples into rows of `seq_len` tokens.

    An example longer than `seq_len` is cut to its first `seq_len` tokens.
    `examples` may be a generator: it is consumed one example at a time, and
    memory holds only the packed rows (one [S] tensor per row, then stacked).

    Returns:
        {"input_ids", "labels", "position_ids"}: LongTensors [R, S]; padding
        is a segment of its own with labels IGNORE; "real": BoolTensor [R, S],
        False on padding (routing statistics skip it).
    """
    done: dict[str, list[torch.Tensor]] = {"input_ids": [], "labels": [], "position_ids": []}
    lengths: list[int] = []
    cur: tuple[list[int], list[int], list[int]] = ([], [], [])

    def close_row() -> None:
        k = len(cur[0])
        done["input_ids"].append(torch.tensor(cur[0] + [pad_id] * (seq_len - k)))  # [S]
        done["labels"].append(torch.tensor(cur[1] + [IGNORE] * (seq_len - k)))  # [S]
        # padding: a segment of its own, positions restart at 0
        done["position_ids"].append(torch.tensor(cur[2] + list(range(seq_len - k))))  # [S]
        lengths.append(k)

    for ex in examples:
        ids = (ex.prompt_ids + ex.completion_ids)[:seq_len]
        labels = ([IGNORE] * len(ex.prompt_ids) + ex.completion_ids)[:seq_len]
        if len(cur[0]) + len(ids) > seq_len:
            close_row()
            cur = ([], [], [])
        cur[0].extend(ids)
        cur[1].extend(labels)
        cur[2].extend(range(len(ids)))
    if cur[0]:
        close_row()
    out = {}
    for key in list(done):  # one key at a time, its rows dropped: peak ~ result + one key
        rows = done.pop(key)
        out[key] = torch.stack(rows) if rows else torch.zeros((0, seq_len), dtype=torch.long)
        rows.clear()  # [R, S] above
    lens = torch.tensor(lengths, dtype=torch.long)  # [R]
    out["real"] = torch.arange(seq_len)[None, :] < lens[:, None]  # [R, S]
    return out


def micro_batches(rows: dict[str, torch.Tensor], batch_size: int, rank: int, world: int,
                  seed: int):
    """Endless iterator of this rank's micro-batches; reshuffled every epoch.

    Every rank sees the same number of batches per epoch (rows are trimmed to a
    multiple of world * batch_size), so data-parallel ranks stay in lockstep.

    Yields:
        (epoch, {"input_ids", "labels", "position_ids"} each [B, S]).
    """
    n = rows["input_ids"].shape[0]
    per_rank = n // world
    if per_rank < 1:
        raise UserError(f"only {n} packed rows of data for {world} data-parallel workers; "
                        "add data or lower data.seq_len")
    epoch = 0
    while True:
        g = torch.Generator().manual_seed(seed + epoch)
        order = torch.randperm(n, generator=g)[: per_rank * world]  # [R']
        mine = order[rank::world]  # [per_rank]
        for start in range(0, per_rank - batch_size + 1 if per_rank >= batch_size else 1,
                           batch_size):
            idx = mine[start:start + batch_size]
            yield epoch, {k: v[idx] for k, v in rows.items()}
        epoch += 1


@dataclass
class Dataset:
    """Everything the workers need, built once by the driver (cheap, picklable)."""

    train_rows: dict[str, torch.Tensor]
    eval_rows: dict[str, torch.Tensor] | None
    eval_examples: list[Example]
    n_train: int
    n_eval: int
    skipped: int
    sha256: str
    train_tokens: int  # completion (loss) tokens in the training set


def _examples(items: Iterable[tuple[str, dict]], src: JsonlFile, tokenizer, seq_len: int,
              keep_text: bool, kept: list[int]) -> Iterator[Example]:
    """Tokenised examples of (where, record) pairs; an example whose prompt leaves
    no completion token inside `seq_len` is a bad line (it would carry no loss:
    a row of only such examples gives a NaN loss)."""
    for where, rec in items:
        try:
            ex = tokenize_one(rec, tokenizer, keep_text)
        except UserError as exc:
            raise UserError(f"{where}: {exc}") from None
        if len(ex.prompt_ids) >= seq_len:
            src.bad_line(UserError(
                f"{where}: the prompt is {len(ex.prompt_ids)} tokens, data.seq_len is "
                f"{seq_len}: no completion token is left to learn from"))
            continue
        kept[0] += 1
        yield ex


def build_dataset(data_cfg, tokenizer, seed: int) -> Dataset:
    """Read, validate, split, tokenise and pack the configured data, streaming.

    Memory: the packed training rows plus the evaluation examples; the JSONL
    lines are read one at a time (the split needs one counting pass first).

    Args:
        data_cfg: the `data:` config section.
        tokenizer: the base model's tokenizer.
        seed: split seed.

    Returns:
        A Dataset.

    Raises:
        UserError: a bad line (file:line), or no usable training/eval example.
    """
    if not data_cfg.train_file:
        raise UserError("data.train_file is not set")
    seq_len = data_cfg.seq_len
    train_src = JsonlFile(data_cfg.train_file, data_cfg.on_bad_line)
    held_records: list[tuple[str, dict]] = []
    if data_cfg.eval_file:
        eval_src = JsonlFile(data_cfg.eval_file, data_cfg.on_bad_line)
        train_items: Iterable[tuple[str, dict]] = train_src
    else:
        eval_src = train_src
        fraction = data_cfg.eval_fraction
        held = held_out(sum(1 for _ in train_src), fraction, seed) if fraction > 0 else set()

        def split() -> Iterator[tuple[str, dict]]:
            for i, item in enumerate(train_src):
                if i in held:
                    held_records.append(item)
                else:
                    yield item

        train_items = split()
    n_train, n_eval = [0], [0]
    train_rows = pack(_examples(train_items, train_src, tokenizer, seq_len, False, n_train),
                      seq_len, _pad_id(tokenizer))
    skipped = train_src.skipped
    if not n_train[0]:
        raise UserError(f"{data_cfg.train_file}: no usable training example "
                        f"({skipped} bad line(s) skipped)")
    if data_cfg.eval_file:
        eval_ex = list(_examples(eval_src, eval_src, tokenizer, seq_len, True, n_eval))
        skipped += eval_src.skipped
    else:
        before = train_src.skipped
        eval_ex = list(_examples(held_records, train_src, tokenizer, seq_len, True, n_eval))
        skipped += train_src.skipped - before
    return Dataset(
        train_rows=train_rows,
        eval_rows=pack(eval_ex, seq_len, _pad_id(tokenizer)) if eval_ex else None,
        eval_examples=eval_ex, n_train=n_train[0], n_eval=len(eval_ex), skipped=skipped,
        sha256=file_sha256(data_cfg.train_file, data_cfg.eval_file),
        train_tokens=int((train_rows["labels"] != IGNORE).sum()))


def _pad_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
