"""Synthetic fine-tuning data for the demo: a task a tiny model visibly learns.

The task is letter reversal of short random words ("reverse: kqzm" ->
"mzqk"). A random base model scores ~0% exact match; a LoRA adapter on
attention learns it within a few hundred CPU steps, so the fine-tune's effect
is unmistakable on held-out words (disjoint from the training words).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

LETTERS = "abcdefghijklmnopqrstuvwxyz"


def make_example(word: str) -> dict:
    """One record; letters are space-separated so each is one token."""
    return {"prompt": f"reverse: {' '.join(word)}\nanswer:",
            "completion": " " + " ".join(word[::-1])}


def _words(rng: random.Random, n: int, min_len: int = 3, max_len: int = 5) -> list[str]:
    seen: set[str] = set()
    while len(seen) < n:
        seen.add("".join(rng.choice(LETTERS) for _ in range(rng.randint(min_len, max_len))))
    return sorted(seen)


def make_dataset(out_dir: str | Path, n_train: int = 2000, n_eval: int = 200,
                 seed: int = 0) -> tuple[Path, Path]:
    """Write `train.jsonl` and `eval.jsonl` (held-out words) under `out_dir`."""
    rng = random.Random(seed)
    words = _words(rng, n_train + n_eval)
    rng.shuffle(words)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, chunk in (("train", words[:n_train]), ("eval", words[n_train:])):
        path = out_dir / f"{name}.jsonl"
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(make_example(w)) + "\n" for w in chunk))
        tmp.replace(path)
        paths.append(path)
    return paths[0], paths[1]


def corpus(n: int = 3000, seed: int = 1) -> list[str]:
    """Text the demo tokenizer is trained on: task prompts plus chat markup."""
    rng = random.Random(seed)
    lines = []
    for word in _words(rng, n):
        ex = make_example(word)
        lines.append(ex["prompt"] + ex["completion"])
    lines += ["system user assistant", "Hello, how are you? I am fine."] * 10
    return lines
