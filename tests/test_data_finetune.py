"""Fine-tuning data: validation with line numbers, chat rendering, loss mask, packing."""

from __future__ import annotations

import json

import pytest
import torch

from moeflow.core.config import DataSection
from moeflow.core.errors import UserError
from moeflow.training import data as D


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from moeflow_testing.demo_data import corpus
    from moeflow_testing.tiny import build_tokenizer

    return build_tokenizer(tmp_path_factory.mktemp("tok"), corpus(300))


def _write(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


GOOD = json.dumps({"prompt": "reverse: a b\nanswer:", "completion": " b a"})


@pytest.mark.parametrize("bad, why", [
    ("{not json", "not valid JSON"),
    (json.dumps({"prompt": "x"}), "missing field(s) completion"),
    (json.dumps({"prompt": "x", "completion": ""}), "`completion` must be a non-empty"),
    (json.dumps([1, 2]), "expected a JSON object"),
    ("", "empty line"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}]}), "at least 2 messages"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"},
                              {"role": "user", "content": "x"}]}), "last message"),
])
def test_bad_line_names_file_and_line(tmp_path, bad, why):
    path = _write(tmp_path / "train.jsonl", [GOOD, GOOD, bad, GOOD])
    with pytest.raises(UserError) as err:
        D.read_jsonl(path)
    assert f"{path}:3" in str(err.value) and why in str(err.value)


def test_skip_mode_counts_bad_lines(tmp_path):
    path = _write(tmp_path / "train.jsonl", [GOOD, "{oops", GOOD, json.dumps({"a": 1})])
    records, skipped = D.read_jsonl(path, on_bad_line="skip")
    assert len(records) == 2 and skipped == 2


def test_missing_file_and_all_bad(tmp_path):
    with pytest.raises(UserError, match="not found"):
        D.read_jsonl(tmp_path / "nope.jsonl")
    path = _write(tmp_path / "bad.jsonl", ["{x"])
    with pytest.raises(UserError, match="no usable records"):
        D.read_jsonl(path, on_bad_line="skip")


def test_loss_only_on_completion_tokens(tokenizer):
    ex = D.tokenize([json.loads(GOOD)], tokenizer)[0]
    rows = D.pack([ex], seq_len=32, pad_id=tokenizer.pad_token_id)
    labels, ids = rows["labels"][0], rows["input_ids"][0]  # [S]
    n_p, n_c = len(ex.prompt_ids), len(ex.completion_ids)
    assert (labels[:n_p] == D.IGNORE).all()
    assert torch.equal(labels[n_p:n_p + n_c], ids[n_p:n_p + n_c])
    assert ex.completion_ids[-1] == tokenizer.eos_token_id
    assert (labels[n_p + n_c:] == D.IGNORE).all() and not rows["real"][0, n_p + n_c:].any()


def test_chat_messages_use_the_template(tokenizer):
    rec = {"messages": [{"role": "system", "content": "be brief"},
                        {"role": "user", "content": "reverse: a b"},
                        {"role": "assistant", "content": "b a"}]}
    ex = D.tokenize([rec], tokenizer)[0]
    assert ex.prompt.endswith("<|im_start|>assistant\n") and "be brief" in ex.prompt
    assert ex.completion.startswith("b a<|im_end|>")
    assert tokenizer.decode(ex.prompt_ids) == ex.prompt


def test_packing_restarts_positions_and_keeps_examples_whole(tokenizer):
    recs = [{"prompt": f"reverse: {w}\nanswer:", "completion": " " + w[::-1]}
            for w in ["a b c", "d e", "f g h i", "j k", "l m n"]]
    exs = D.tokenize(recs, tokenizer)
    seq = max(len(e.prompt_ids) + len(e.completion_ids) for e in exs) * 2
    rows = D.pack(exs, seq, tokenizer.pad_token_id)
    assert rows["input_ids"].shape[1] == seq and rows["input_ids"].shape[0] < len(exs)
    starts = int((rows["position_ids"][rows["real"]] == 0).sum())
    assert starts == len(exs)  # one segment per example, none split across rows
    total = sum(len(e.prompt_ids) + len(e.completion_ids) for e in exs)
    assert int(rows["real"].sum()) == total


def test_micro_batches_shard_ranks_without_overlap():
    rows = {"input_ids": torch.arange(10).unsqueeze(1)}  # [R=10, S=1]
    seen = []
    for rank in range(2):
        it = D.micro_batches(rows, 2, rank, 2, seed=0)
        seen.append(torch.cat([next(it)[1]["input_ids"] for _ in range(2)]).flatten().tolist())
    assert not set(seen[0]) & set(seen[1])
    with pytest.raises(UserError, match="packed rows"):
        next(D.micro_batches(rows, 1, 0, 11, 0))


def test_dataset_split_and_hash(tmp_path, tokenizer):
    path = _write(tmp_path / "t.jsonl", [json.dumps({"prompt": f"p{i}", "completion": f" c{i}"})
                                         for i in range(20)])
    cfg = DataSection(train_file=str(path), eval_file=None, seq_len=64,
                      eval_fraction=0.25, on_bad_line="error")
    a, b = D.build_dataset(cfg, tokenizer, seed=1), D.build_dataset(cfg, tokenizer, seed=1)
    assert (a.n_train, a.n_eval) == (15, 5)
    assert [e.prompt for e in a.eval_examples] == [e.prompt for e in b.eval_examples]
    assert a.sha256 == D.file_sha256(path)
    path.write_text(path.read_text().replace("c3", "c33"))
    assert D.build_dataset(cfg, tokenizer, seed=1).sha256 != a.sha256


def test_prompt_filling_seq_len_is_a_bad_line(tmp_path, tokenizer):
    """An example whose prompt leaves no completion token in the row carries no loss:
    a row of only such examples gave a NaN train/eval loss. It is refused by file:line."""
    long = json.dumps({"prompt": "reverse: " + "a b c d e f g h " * 8 + "\nanswer:",
                       "completion": " x"})
    path = _write(tmp_path / "t.jsonl", [GOOD] * 4 + [long] + [GOOD] * 3)
    cfg = DataSection(train_file=str(path), eval_file=None, seq_len=16,
                      eval_fraction=0.0, on_bad_line="error")
    with pytest.raises(UserError, match=rf"{path}:5: the prompt is \d+ tokens, data.seq_len is 16"):
        D.build_dataset(cfg, tokenizer, seed=0)
    cfg.on_bad_line = "skip"
    ds = D.build_dataset(cfg, tokenizer, seed=0)
    assert (ds.n_train, ds.skipped) == (7, 1)
    per_row = (ds.train_rows["labels"] != D.IGNORE).sum(-1)  # [R]
    assert (per_row > 0).all() and ds.train_tokens == int(per_row.sum())


def test_validate_jsonl_streams_and_counts(tmp_path):
    path = _write(tmp_path / "t.jsonl", [GOOD, "{oops", GOOD, GOOD])
    assert D.validate_jsonl(path, "skip") == (3, 1)
    with pytest.raises(UserError, match=rf"{path}:2: not valid JSON"):
        D.validate_jsonl(path)
    (tmp_path / "b.jsonl").write_bytes(GOOD.encode() + b"\n\xff\xfe\n")
    with pytest.raises(UserError, match=r"b.jsonl:2: not UTF-8"):
        D.validate_jsonl(tmp_path / "b.jsonl")
