"""Synthetic fine-tuning data for the demo: tasks a tiny model visibly learns.

Two tasks over short random words, mixed half and half, each record tagged
with its `task` (the finetune stage reports exact match per task):

- `min`: the alphabetically first letter of space-separated letters
  ("min: k q z m\\nanswer:" -> " k"). A random base scores 0%; attention-only
  LoRA on the tiny debug model reaches ~60% exact match on held-out words in
  ~300 CPU steps (measured: the answer is a function of the prompt's bag of
  letters, which attention LoRA can read out).
- `reverse`: letter reversal ("reverse: kqzm\\nanswer:" -> " mzqk"). Its
  completion loss drops quickly but exact match stays near 0 on a random
  base (reversal needs induction-style attention circuits a 2-layer random
  model does not grow in minutes). The golden regression suite
  (configs/suites/golden) scores this format, so the demo keeps training it.

Held-out words are disjoint from the training words.

The demo base (moeflow_testing/demo_base.py) is pre-trained on `language_docs`: a small
synthetic language of letter facts, spellings, reversals written as
"<word> backwards is <drow>", and plain English-like sentences. It never sees
the fine-tuning formats ("min: ...", "reverse: ...\nanswer:"), so the
adapters still have those to learn, but it knows the letters and words they
are about. The demo's training files replay some of that language
(`make_dataset(replay=...)`), so fine-tuning does not make the base forget it. Next to the mixed
files, `train-<task>.jsonl` / `eval-<task>.jsonl` hold one task's records: the
demo trains a second adapter ("tenant") on `reverse` alone.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

LETTERS = "abcdefghijklmnopqrstuvwxyz"


def make_example(word: str) -> dict:
    """A `reverse` record (the format the golden suite scores)."""
    return {"prompt": f"reverse: {word}\nanswer:", "completion": f" {word[::-1]}"}


def make_min_example(word: str) -> dict:
    """A `min` record: letters one token each (space-separated), answer one letter."""
    return {"prompt": f"min: {' '.join(word)}\nanswer:", "completion": f" {min(word)}"}


def _words(rng: random.Random, n: int, min_len: int = 3, max_len: int = 5) -> list[str]:
    seen: set[str] = set()
    while len(seen) < n:
        seen.add("".join(rng.choice(LETTERS) for _ in range(rng.randint(min_len, max_len))))
    return sorted(seen)


def _record(word: str, i: int) -> dict:
    if i % 2:
        return {**make_example(word), "task": "reverse"}
    return {**make_min_example(word), "task": "min"}


def make_dataset(out_dir: str | Path, n_train: int = 2000, n_eval: int = 200,
                 seed: int = 0, replay: float = 0.0) -> tuple[Path, Path]:
    """Write `train.jsonl` and `eval.jsonl` (held-out words) under `out_dir`.

    Args:
        replay: demo-language records (task `text`: a document's first sentence as
            prompt, the rest as completion) added to the training files, this many per
            task record. Why: fine-tuning the pre-trained demo base on the task
            formats alone makes it forget its language (the regression gate sees
            held-out perplexity several times worse); replaying some keeps it.

    Returns:
        (train path, eval path); each file alternates `min` and `reverse` records
        (training files with `text` records interleaved when `replay` > 0).
    """
    rng = random.Random(seed)
    words = _words(rng, n_train + n_eval)
    rng.shuffle(words)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, chunk in (("train", words[:n_train]), ("eval", words[n_train:])):
        records = [_record(w, i) for i, w in enumerate(chunk)]
        text = replay_records(int(len(records) * replay), seed, set(words)) \
            if name == "train" else []
        paths.append(_write(out_dir / f"{name}.jsonl", _interleave(records, text)))
        for task in TASKS:
            own = [r for r in records if r["task"] == task]
            _write(out_dir / f"{name}-{task}.jsonl", _interleave(own, text[:len(text) // 2]))
    return paths[0], paths[1]


def replay_records(n: int, seed: int, exclude: set[str]) -> list[dict]:
    """`n` demo-language records (task `text`), never about the task words."""
    out = []
    for doc in language_docs(n, seed + 500, exclude=exclude):
        first, rest = doc.split(". ", 1)
        out.append({"prompt": first + ".", "completion": " " + rest, "task": "text"})
    return out


def _interleave(records: list[dict], extra: list[dict]) -> list[dict]:
    """`extra` spread evenly through `records` (deterministic)."""
    if not extra:
        return records
    out, step = [], (len(records) + len(extra)) / len(extra)
    k = 0
    for i in range(len(records) + len(extra)):
        if k < len(extra) and i >= int(k * step + step / 2):
            out.append(extra[k])
            k += 1
        else:
            out.append(records[i - k])
    return out


TASKS = ("min", "reverse")


def _write(path: Path, records: list[dict]) -> Path:
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    tmp.replace(path)  # never half-written
    return path


def corpus(n: int = 3000, seed: int = 1) -> list[str]:
    """Text the demo tokenizer is trained on: reverse-task prompts plus chat markup.

    Unchanged since the first demo so every debug model's tokenizer stays the
    same; its byte-level BPE keeps " k"-style single letters as one token each,
    which is what the `min` task needs.
    """
    rng = random.Random(seed)
    lines = []
    for word in _words(rng, n):
        ex = make_example(word)
        lines.append(ex["prompt"] + ex["completion"])
    lines += ["system user assistant", "Hello, how are you? I am fine."] * 10
    return lines


# ---------------------------------------------------------------- demo language

_SUBJECTS = ["the model", "a user", "the system", "she", "he", "the train", "a small test",
             "the adapter", "every file", "the expert", "a baseline", "the router", "rain",
             "the window", "two cores", "the answer", "a prompt", "the town", "the dog",
             "the fox", "a number"]
_VERBS = ["reads", "writes", "checks", "answers", "opens", "keeps", "learns", "finds",
          "sends", "counts", "moves", "holds", "sees", "runs", "fell on", "jumps over",
          "waits for", "looks at"]
_OBJECTS = ["a prompt", "an answer", "the letters", "the word", "the numbers", "every user",
            "the quiet town", "the lazy dog", "the cold air", "a hash", "the tokens",
            "the station", "the morning", "the data", "a mixture", "the same order",
            "the task", "the night"]
_TAILS = ["", "", " all night", " twice", " in the morning", " and stays frozen",
          " in the same order", " and writes an answer", " at nine", " again"]


def _sentence(rng: random.Random, word: str) -> str:
    """One sentence of the demo language about `word` (or plain English-like text)."""
    kind = rng.randrange(6)
    if kind == 0:
        i = rng.randrange(25)
        return f"the letter after {LETTERS[i]} is {LETTERS[i + 1]}."
    if kind == 1:
        return f"the word {word} is spelled {' '.join(word)}."
    if kind == 2:
        return f"{word} backwards is {word[::-1]}."
    if kind == 3:
        return f"the first letter of {word} is {word[0]}."
    s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}{rng.choice(_TAILS)}."
    return s[0].upper() + s[1:] if rng.random() < 0.5 else s


def language_docs(n: int, seed: int, exclude: set[str] | frozenset[str] = frozenset()) -> list[str]:
    """`n` documents of the demo language (2-5 sentences each), deterministic in `seed`.

    Args:
        exclude: words never used (the fine-tuning and golden held-out words).
    """
    rng = random.Random(seed)
    docs: list[str] = []
    while len(docs) < n:
        words = [w for w in _words(rng, 8) if w not in exclude]
        rng.shuffle(words)
        if len(words) < 5:
            continue
        docs.append(" ".join(_sentence(rng, words[i]) for i in range(rng.randint(2, 5))))
    return docs


def heldout_words(seed: int = 0, n_train: int = 2000, n_eval: int = 200) -> set[str]:
    """Every word `make_dataset(seed)` writes (train and eval): pre-training avoids them."""
    rng = random.Random(seed)
    return set(_words(rng, n_train + n_eval))
