"""Dotted-key lookups with `*` (cache keys over tenant adapters' data files)."""

from workflows.dag import lookup_all


def test_lookup_all_wildcards_in_key_order():
    data = {"finetune": {"adapters": {"b": {"train_file": "/b"}, "a": {"train_file": "/a", "eval_file": None}}},
            "data": {"train_file": "/t"}}
    assert lookup_all(data, "data.train_file") == ["/t"]
    assert lookup_all(data, "finetune.adapters.*.train_file") == ["/a", "/b"]
    assert lookup_all(data, "finetune.adapters.*.eval_file") == [None]
    assert lookup_all(data, "finetune.missing.*.x") == []
    assert lookup_all(data, "data.train_file.deeper") == []
