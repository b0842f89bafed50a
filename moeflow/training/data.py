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
from typing import Any

import torch

from moeflow.errors import UserError

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


def read_jsonl(path: str | Path, on_bad_line: str = "error") -> tuple[list[dict], int]:
    """Read and validate a JSONL file.

    Args:
        path: the file.
        on_bad_line: "error" raises at the first bad line; "skip" skips it.

    Returns:
        (records, number of skipped lines).

    Raises:
        UserError: missing file, bad line (file:line and why), or no records.
    """
    path = Path(path)
    if not path.is_file():
        raise UserError(f"data file not found: {path}")
    records, skipped = [], 0
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            where = f"{path}:{lineno}"
            try:
                text = raw.decode("utf-8").strip()
                if not text:
                    raise UserError(f"{where}: empty line")
                try:
                    obj = json.loads(text)
                except json.JSONDecodeError as exc:
                    raise UserError(f"{where}: not valid JSON ({exc.msg})") from None
                records.append(_check_record(obj, where))
            except (UserError, UnicodeDecodeError) as exc:
                if on_bad_line != "skip":
                    msg = exc if isinstance(exc, UserError) else f"{where}: not UTF-8"
                    raise UserError(f"{msg} (set data.on_bad_line: skip to skip bad lines)") \
                        from None
                skipped += 1
    if not records:
        raise UserError(f"{path}: no usable records")
    return records, skipped


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


def tokenize(records: list[dict], tokenizer) -> list[Example]:
    """Tokenise records (prompt and completion separately, as generation sees them).

    Returns:
        Examples whose completion ends with the tokenizer's eos token.
    """
    eos = tokenizer.eos_token_id
    out = []
    for rec in records:
        if "messages" in rec:
            prompt, completion = _split_chat(tokenizer, rec["messages"])
        else:
            prompt, completion = rec["prompt"], rec["completion"]
        p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        c_ids = tokenizer(completion, add_special_tokens=False)["input_ids"]
        task = rec.get("task") if isinstance(rec.get("task"), str) else None
        out.append(Example(p_ids, c_ids + ([eos] if eos is not None else []),
                           prompt, completion, task))
    return out


def split_eval(records: list[dict], fraction: float, seed: int) -> tuple[list[dict], list[dict]]:
    """Deterministic train/eval split (seeded shuffle of record indices)."""
    if fraction <= 0:
        return records, []
    idx = list(range(len(records)))
    random.Random(seed).shuffle(idx)
    n_eval = max(1, int(round(len(records) * fraction)))
    if n_eval >= len(records):
        raise UserError(f"data.eval_fraction={fraction} leaves no training records "
                        f"({len(records)} in total)")
    held = set(idx[:n_eval])
    return ([r for i, r in enumerate(records) if i not in held],
            [r for i, r in enumerate(records) if i in held])


def pack(examples: list[Example], seq_len: int, pad_id: int) -> dict[str, torch.Tensor]:
    """Greedily pack whole examples into rows of `seq_len` tokens.

    An example longer than `seq_len` is cut to its first `seq_len` tokens.

    Returns:
        {"input_ids", "labels", "position_ids"}: LongTensors [R, S]; padding
        is a segment of its own with labels IGNORE; "real": BoolTensor [R, S],
        False on padding (routing statistics skip it).
    """
    rows: list[tuple[list[int], list[int], list[int]]] = []
    cur: tuple[list[int], list[int], list[int]] = ([], [], [])
    for ex in examples:
        ids = (ex.prompt_ids + ex.completion_ids)[:seq_len]
        labels = ([IGNORE] * len(ex.prompt_ids) + ex.completion_ids)[:seq_len]
        if len(cur[0]) + len(ids) > seq_len:
            rows.append(cur)
            cur = ([], [], [])
        cur[0].extend(ids)
        cur[1].extend(labels)
        cur[2].extend(range(len(ids)))
    if cur[0]:
        rows.append(cur)
    n = len(rows)
    input_ids = torch.full((n, seq_len), pad_id, dtype=torch.long)  # [R, S]
    labels_t = torch.full((n, seq_len), IGNORE, dtype=torch.long)  # [R, S]
    pos = torch.zeros((n, seq_len), dtype=torch.long)  # [R, S]
    real = torch.zeros((n, seq_len), dtype=torch.bool)  # [R, S]
    for r, (ids, labels, positions) in enumerate(rows):
        k = len(ids)
        input_ids[r, :k] = torch.tensor(ids)
        labels_t[r, :k] = torch.tensor(labels)
        pos[r, :k] = torch.tensor(positions)
        pos[r, k:] = torch.arange(seq_len - k)  # padding: its own segment
        real[r, :k] = True
    return {"input_ids": input_ids, "labels": labels_t, "position_ids": pos, "real": real}


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


def build_dataset(data_cfg, tokenizer, seed: int) -> Dataset:
    """Read, validate, split, tokenise and pack the configured data.

    Args:
        data_cfg: the `data:` config section.
        tokenizer: the base model's tokenizer.
        seed: split seed.

    Returns:
        A Dataset.
    """
    if not data_cfg.train_file:
        raise UserError("data.train_file is not set")
    train, skipped = read_jsonl(data_cfg.train_file, data_cfg.on_bad_line)
    if data_cfg.eval_file:
        evals, skipped_eval = read_jsonl(data_cfg.eval_file, data_cfg.on_bad_line)
        skipped += skipped_eval
    else:
        train, evals = split_eval(train, data_cfg.eval_fraction, seed)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    train_ex, eval_ex = tokenize(train, tokenizer), tokenize(evals, tokenizer)
    return Dataset(
        train_rows=pack(train_ex, data_cfg.seq_len, pad),
        eval_rows=pack(eval_ex, data_cfg.seq_len, pad) if eval_ex else None,
        eval_examples=eval_ex, n_train=len(train_ex), n_eval=len(eval_ex), skipped=skipped,
        sha256=file_sha256(data_cfg.train_file, data_cfg.eval_file),
        train_tokens=sum(len(e.completion_ids) for e in train_ex))
