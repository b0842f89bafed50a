"""Convert reading a release from an S3-compatible store by byte ranges (moto's server mode on
127.0.0.1): the shard headers first, then only the tensors it converts; the result is the
local-disk convert's, byte for byte."""

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from moeflow.checkpoint.convert import convert_checkpoint
from moeflow.core import storage as S
from moeflow.core.errors import UserError
from moeflow.core.storage import ranged
from moeflow_testing.tiny import build_debug_model
from tests.s3server import BUCKET, s3_server

MTP_BYTES = 4 << 20  # DeepSeek-V3's MTP layer (model.layers.61.*): transformers drops it


@pytest.fixture(scope="module")
def s3():
    saved = dict(os.environ)
    with s3_server() as env:
        os.environ.update(env)
        yield env
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture()
def scratch(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEFLOW_SCRATCH", str(tmp_path / "scratch"))
    return tmp_path / "scratch"


def _release(tmp_path: Path) -> Path:
    """A tiny DeepSeek-V3 whose one shard also holds an MTP layer convert drops."""
    src = build_debug_model("deepseek_v3", tmp_path / "src", dtype="float32")
    shards = sorted(src.glob("*.safetensors"))
    tensors = load_file(shards[0])
    tensors["model.layers.61.eh_proj.weight"] = torch.randn(MTP_BYTES // 4 // 256, 256)
    save_file(tensors, shards[0], metadata={"format": "pt"})
    index = src / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"]["model.layers.61.eh_proj.weight"] = shards[0].name
        index.write_text(json.dumps(data))
    return src


def _upload(src: Path, uri: str) -> None:
    """A release as `aws s3 sync` leaves it: plain objects, no moeflow manifest."""
    fs, root = S.filesystem(uri)
    files = sorted(p for p in src.iterdir() if p.is_file())
    fs.put([str(p) for p in files], [f"{root}/{p.name}" for p in files])


def _disk_bytes(root: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in root.rglob("*.safetensors"))


def test_convert_from_the_store_reads_ranges_and_equals_the_local_convert(s3, scratch, tmp_path,
                                                                          monkeypatch):
    monkeypatch.setattr(ranged, "HEAD", 4096)  # tiny shards: a header read must not cover them
    src = _release(tmp_path)
    local = convert_checkpoint(src, tmp_path / "local", workers=1)
    uri = f"s3://{BUCKET}/releases/ds"
    _upload(src, uri)
    said = []
    got = convert_checkpoint(uri, tmp_path / "stored", workers=1, progress=said.append)
    assert got["source_dir"] == uri and got["report"]["passed"]
    shard = sorted(src.glob("*.safetensors"))[0]
    copy = next((scratch / "cache").glob("ranged-*"))
    held = sum(b - a for a, b in json.loads((copy / ".ranges" / f"{shard.name}.json").read_text()))
    # the header and the converted tensors: everything but the dropped MTP layer
    assert shard.stat().st_size - MTP_BYTES <= held < shard.stat().st_size - MTP_BYTES + (1 << 20)
    assert _disk_bytes(copy) < shard.stat().st_size - MTP_BYTES // 2  # sparse: never the whole shard
    reads = [line for line in said if line.startswith("read ")]
    assert len(reads) == 1 and uri in reads[0] and not reads[0].startswith("read 0.0 MB"), said
    mine, theirs = (json.loads((Path(r["output_dir"]) / "manifest.json").read_text())
                    for r in (local, got))
    assert theirs["source_dir"] == uri and theirs["tensors"] == mine["tensors"]
    for f in sorted(Path(local["output_dir"]).glob("*.safetensors")):
        assert (Path(got["output_dir"]) / f.name).read_bytes() == f.read_bytes(), f.name
    again = convert_checkpoint(uri, tmp_path / "again", workers=1, progress=said.append)
    assert again["manifest_sha256"] == got["manifest_sha256"]
    assert [m for m in said if m.startswith("read ")][1].startswith("read 0.0 MB")  # nothing twice


def test_ranges_already_held_are_not_fetched_again(s3, scratch, tmp_path):
    uri = f"s3://{BUCKET}/ranges/one"
    data = os.urandom(3 << 20)
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "x.safetensors").write_bytes((16).to_bytes(8, "little") + b"{}".ljust(16) + data)
    _upload(tmp_path / "w", uri)
    copy = ranged.sparse_copy(uri)
    path = copy / "x.safetensors"
    assert path.stat().st_size == 24 + len(data)
    assert ranged.fill({path: [(100, 200), (150, 1 << 20)]}) == (1 << 20) - ranged.HEAD  # head held
    assert ranged.fill({path: [(0, 1 << 20)]}) == 0  # the header and 100..1 MiB are held
    assert ranged.fill({path: [(0, (2 << 20) + 5)]}) == (1 << 20) + 5
    with open(path, "rb") as fh:
        fh.seek(24)
        assert fh.read((2 << 20) - 19) == data[:(2 << 20) - 19]
    assert ranged.fill({tmp_path / "w" / "x.safetensors": [(0, 10)]}) == 0  # a local file: as is


def test_a_store_release_that_is_not_there_is_one_line(s3, scratch, tmp_path):
    with pytest.raises(UserError, match=r"s3://moeflow/releases/none: no such checkpoint"):
        convert_checkpoint(f"s3://{BUCKET}/releases/none", tmp_path / "out", workers=1)


def test_the_runner_hands_convert_a_sparse_copy_and_maps_it_back(s3, scratch, tmp_path):
    from moeflow.core.storage.stage import StageIO

    (tmp_path / "rel").mkdir()
    save_file({"w": torch.zeros(1 << 18)}, tmp_path / "rel" / "model.safetensors")  # 1 MiB
    (tmp_path / "rel" / "config.json").write_text('{"model_type": "x"}')
    uri = f"s3://{BUCKET}/releases/handed"
    _upload(tmp_path / "rel", uri)
    io = StageIO(f"s3://{BUCKET}/w/run/convert-1", f"s3://{BUCKET}/w")
    cfg, _ = io.localize({"model": {"path": uri}}, {}, model_by_ranges=True)
    local = Path(cfg["model"]["path"])
    assert ranged.is_sparse_copy(local) and local.is_relative_to(scratch)
    assert (local / "config.json").read_text() == '{"model_type": "x"}'
    have, total = ranged.held(local)
    assert have == ranged.HEAD < total == (local / "model.safetensors").stat().st_size  # headers only
    assert io.to_uri(str(local / "config.json")) == f"{uri}/config.json"
