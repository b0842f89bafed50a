"""Convert a Hugging Face MoE checkpoint to the runtime layout, streaming.

    .venv/bin/moeflow convert SRC OUT [--dtype bf16|fp32|keep|fp8] [--workers N]
                                      [--checksum xxh3_128|sha256]

Output: one safetensors file per decoder layer (plus embeddings/head, vision
tower, projector) holding fused expert tensors under the runtime module names,
`model.safetensors.index.json`, config.json (quantisation section matching
the output), tokenizer/processor files, and `manifest.json` (every tensor's
shape, dtype, checksum (digest.py) and the source tensors and transform it
came from).

Two paths per plan group: groups whose output bytes are source bytes
rearranged (renames, per-expert tensors stacked into fused ones, same dtype)
are copied range by range without torch (bytecopy.py); the rest (casts, FP8,
transposes) run transformers' converter on torch slices (engine.py).

Parallelism: one task per output file. When a Ray runtime is up (the pipeline
runs this stage inside a Ray task; the CLI starts a local one for
--workers > 1) the files are converted by `ray.remote` tasks, at most
`workers` in flight; otherwise in this process, threads() files at a time.

Atomicity: everything is written under `.<OUT>.partial/` next to OUT and
renamed to OUT only after verification. A rerun after an interruption keeps
the output files whose recorded plan and checksums still match (re-hashed).
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import shutil
import sys
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from importlib.metadata import version
from pathlib import Path
from typing import Callable

from moeflow.checkpoint import bytecopy, digest, formats, keep
from moeflow.checkpoint.engine import Loader, block_size, run_step
from moeflow.checkpoint.families import load_family
from moeflow.checkpoint.manifest import FORMAT, MANIFEST, publish
from moeflow.checkpoint.parse import INDEX, read_checkpoint, tensor_kind
from moeflow.checkpoint.plan import plan_conversion, steps
from moeflow.checkpoint.st_io import DTYPES, StreamWriter, single_thread, tensor_bytes
from moeflow.checkpoint.verify import here_if_node_local, verify_converted
from moeflow.core.errors import UserError
from moeflow.core.memmeter import PeakMemory
from moeflow.core.storage import is_uri, ranged
from moeflow.model import remote_code
from moeflow.model.remote_code import activate, activate_task


def file_tasks(ckpt, plan: dict, policy: str, checksum: str = digest.DEFAULT) -> dict[str, dict]:
    """Group the plan by output file: {file: task} (JSON/pickle-friendly)."""
    tasks: dict[str, dict] = {}
    for group in plan["groups"]:
        task = tasks.setdefault(group["file"], {"file": group["file"], "groups": [], "sources": {}})
        task["groups"].append(group)
        for key in [k for ks in group["sources"].values() for k in ks] + list(group["scales"].values()):
            task["sources"][key] = ckpt.tensors[key]

    code = activate(ckpt.path)  # {}: transformers' own class; else the digests workers hold it to
    for task in tasks.values():
        task["config"] = ckpt.config
        if code:
            task["remote_code"] = code
        task["checksum"] = checksum
        task["key"] = _task_key(task, policy)
    return tasks


def _task_key(task: dict, policy: str) -> str:
    """Fingerprint of a file task: its plan and the exact source byte ranges."""
    # a release format's logical tensor is read from all its parts (formats.Packed)
    stored = {k: [p for _, p in v.parts] if isinstance(v, formats.Packed) else [v]
              for k, v in task["sources"].items()}
    mtimes = {f: os.stat(f).st_mtime_ns for f in {p.file for ps in stored.values() for p in ps}}
    src = {k: [v.dtype, list(v.shape)] + [[Path(p.file).name, p.dtype, list(p.shape), p.start, p.end,
                                           mtimes[p.file]] for p in stored[k]]
           for k, v in sorted(task["sources"].items())}
    blob = json.dumps([task["groups"], src, policy, task["checksum"]], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def convert_file(task: dict, out_dir: str, metered: bool = False) -> dict:
    """Write one output file of the plan and return its manifest entries.

    Args:
        metered: the file runs alone in this process: measure its peak (memmeter).

    Returns:
        {"file", "key", "checksum", "tensors": {name: entry},
         "nonfinite": {source key: count}, "peak_bytes": int | None}.
    """
    with single_thread():
        return _convert_file(task, out_dir, metered)


def _convert_file(task: dict, out_dir: str, metered: bool) -> dict:
    activate_task(task)
    fam = load_family(task["config"])
    meter = PeakMemory().start() if metered else None  # after the imports: before the first tensor
    loader = Loader(task["sources"], block_size(task["config"]))
    specs = sorted((n, DTYPES[g["dtype"]], tuple(s)) for g in task["groups"]
                   for n, s in g["targets"].items())
    layouts = [bytecopy.layout(fam, g, task["sources"]) for g in task["groups"]]
    writer = StreamWriter(Path(out_dir) / task["file"], specs)
    algorithm = task.get("checksum", digest.DEFAULT)
    hashers = {n: digest.hasher(algorithm) for n, _, _ in specs}
    shapes = {k: v.shape for k, v in task["sources"].items()}
    nonfinite: dict[str, int] = {}
    # Torch path: two background threads, one hashing and one writing (pwrite),
    # both releasing the GIL, while this one reads and converts the next slice.
    # Each is FIFO, so a tensor's slices are hashed in row order; at most
    # IN_FLIGHT slices wait, which bounds memory.
    hash_pool, write_pool = ThreadPoolExecutor(max_workers=1), ThreadPoolExecutor(max_workers=1)
    pending: collections.deque = collections.deque()
    try:
        for group, lay in zip(task["groups"], layouts):
            if lay is not None:  # source bytes rearranged: copied range by range (bytecopy.py)
                bytecopy.copy_group(group, lay, task["sources"], writer, hashers, loader.fd, nonfinite)
                continue
            for selection, row0 in steps(group, shapes):
                for name, t in run_step(fam, group, loader, selection).items():  # [rows, ...]
                    offset = row0 * (t[0].numel() * t.element_size() if t.dim() else 0)
                    pending.append((hash_pool.submit(hashers[name].update, tensor_bytes(t)),
                                    write_pool.submit(writer.write, name, offset, t)))
                    while len(pending) > IN_FLIGHT:
                        [f.result() for f in pending.popleft()]
        while pending:
            [f.result() for f in pending.popleft()]
        writer.close()
        loader.close()
    except BaseException:
        loader.close()
        for pool in (hash_pool, write_pool):
            pool.shutdown(wait=True, cancel_futures=True)
        writer.abort()
        raise
    hash_pool.shutdown()
    write_pool.shutdown()
    for key, n in loader.nonfinite.items():
        nonfinite[key] = nonfinite.get(key, 0) + n
    entries = {n: _entry(task, fam, n, shape, algorithm, hashers[n].hexdigest())
               for n, _, shape in specs}
    return {"file": task["file"], "key": task["key"], "checksum": algorithm, "tensors": entries,
            "nonfinite": nonfinite, "peak_bytes": meter.peak() if meter else None}


IN_FLIGHT = 4  # output slices queued for the writer thread


def _entry(task: dict, fam, name: str, shape, algorithm: str, hexdigest: str) -> dict:
    group = next(g for g in task["groups"] if name in g["targets"])
    conv = fam.converters[group["conv"]] if group["conv"] is not None else None
    return {
        "file": task["file"], "shape": list(shape), "dtype": group["dtype"], algorithm: hexdigest,
        "kind": tensor_kind(name),
        "sources": [k for ks in group["sources"].values() for k in ks],
        "transform": {
            "converter": "rename" if conv is None else type(conv).__name__,
            "ops": [] if conv is None else [repr(op) for op in conv.operations],
            "cast": group["dtype"], "dequantized": bool(group["scales"]), "mode": group["mode"],
        },
    }


def _resume(stage: Path, task: dict) -> dict | None:
    """A finished file from an interrupted run, if its plan and bytes still match."""
    marker = stage / (task["file"] + ".done.json")
    if not marker.is_file() or not (stage / task["file"]).is_file():
        return None
    try:
        done = json.loads(marker.read_text())
    except (OSError, json.JSONDecodeError):
        return None  # unreadable: convert the file again
    if done.get("key") != task["key"]:
        return None
    algorithm = done.get("checksum", "sha256")
    digests = digest.file_digests(stage / task["file"], algorithm)
    if digests != {n: digest.entry_digest(e, algorithm) for n, e in done["tensors"].items()}:
        return None
    return done


def run_tasks(tasks: list[dict], stage: Path, workers: int | None,
              progress: Callable[[str], None] | None = None) -> list[dict]:
    """Convert every file task, as Ray tasks when Ray is up, else in process."""
    results, todo = [], []
    for task in tasks:
        done = _resume(stage, task)
        (results.append(done) if done else todo.append(task))
        if done and progress:
            progress(f"kept {task['file']} (verified from an earlier run)")
    # Ray is only used when a runtime is already up; importing it just to ask
    # costs a second or more per conversion.
    ray = sys.modules.get("ray")
    use_ray = ray is not None and ray.is_initialized() and (workers or 2) > 1 and len(todo) > 1
    if use_ray and ray is not None:
        pin = here_if_node_local(ray, stage, *_source_files(todo))  # node-local out dir or source
        remote = ray.remote(num_cpus=1, max_retries=1, **pin)(convert_file)
        limit = workers or max(1, int(ray.available_resources().get("CPU", 1)))
        pending: list = []  # Ray object refs
        queue = list(todo)
        while queue or pending:
            while queue and len(pending) < limit:
                pending.append(remote.remote(queue.pop(0), str(stage), True))
            ready, pending = ray.wait(pending, num_returns=1)
            results.append(_finish(stage, ray.get(ready[0]), progress))
    else:
        with single_thread():
            results += _run_threads(todo, stage, progress, min(threads(), workers or threads()))
    return results


def _source_files(tasks: list[dict]) -> list[str]:
    return sorted({info.file for task in tasks for info in task["sources"].values()})


def threads() -> int:
    """Files converted at once in this process: one per CPU, at most 4. The byte-copy
    path spends its time in pread/pwrite, hashing and NaN scans, which release
    the GIL, so files on different threads overlap; each thread holds at most one
    step's slices (torch path) or two 256 KB buffers (byte-copy path)."""
    return max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1))


def _run_threads(todo: list[dict], stage: Path, progress, workers: int) -> list[dict]:
    """Convert file tasks on `workers` threads. On an error (or Ctrl-C) no new file is
    started; files already running finish and are recorded for a resume, then the
    first error is raised."""
    results, error, recorded = [], None, set()
    pool = ThreadPoolExecutor(max_workers=workers)
    futures = [pool.submit(convert_file, task, str(stage), workers == 1) for task in todo]
    try:
        running = set(futures)
        while running:
            done, running = wait(running, return_when=FIRST_COMPLETED)
            for fut in done:
                recorded.add(fut)
                try:
                    results.append(_finish(stage, fut.result(), progress))
                except BaseException as e:  # noqa: B902 - re-raised below, after the others stop
                    error = error or e
                    for other in running:
                        other.cancel()
    except BaseException as e:  # Ctrl-C while waiting
        error = error or e
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    for fut in futures:  # finished while we stopped: keep them for a resume
        if fut not in recorded and fut.done() and not fut.cancelled() and fut.exception() is None:
            results.append(_finish(stage, fut.result(), progress))
    if error is not None:
        raise error
    return results


def _finish(stage: Path, result: dict, progress) -> dict:
    marker = stage / (result["file"] + ".done.json")
    tmp = marker.with_name(marker.name + ".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(marker)  # a torn marker never reads as "done"
    if progress:
        progress(f"wrote {result['file']} ({len(result['tensors'])} tensors)")
    return result


def convert_checkpoint(src: str | Path, out: str | Path, *, dtype: str = "bf16",
                       workers: int | None = None, allow_nonfinite: bool = False,
                       verify: bool = True, checksum: str = digest.DEFAULT,
                       progress: Callable[[str], None] | None = None,
                       memory_budget: float | None = None) -> dict:
    """Convert `src` to the runtime layout in `out` (see module docstring).

    Args:
        src: source checkpoint directory (safetensors only), or its store URI: then
            only the byte ranges of the tensors converted are read (moeflow.core.storage.ranged).
        out: output directory; must not exist or be empty.
        dtype: "bf16" (default), "fp32", "keep" or "fp8"; FP8 block-scaled weights
            are dequantised to the target dtype, or kept with their fused scales
            for "fp8" (then the config keeps its quantization_config). "keep" of a
            release in a quantised format (MXFP4, compressed-tensors) keeps its stored
            tensors and quantization_config, validated (moeflow.checkpoint.keep).
        workers: parallel file tasks (Ray); 1 runs in this process (on threads()
            threads).
        allow_nonfinite: accept NaN/Inf in weights (otherwise a UserError).
        verify: run the tensor-by-tensor and functional verification.
        checksum: per-tensor checksum in the manifest, "xxh3_128" (default) or
            "sha256" (see digest.py).
        progress: callback for one-line progress messages.
        memory_budget: bytes of model data one process may hold (a device's share):
            the functional verification then checks layer by layer
            (moeflow.checkpoint.verify.functional_check); None: as large as the host allows.

    Returns:
        {"output_dir", "manifest", "manifest_sha256", "family", "source_dir",
         "tensors", "files", "bytes", "report", "memory"}; memory: the peak bytes
        above the level before the first tensor of each file task that ran alone
        in its process ("convert", "verify"; None where files shared a process) and
        of the functional check ("functional").
    """
    out = Path(out).resolve()
    digest.check(checksum)
    if out.exists() and any(out.iterdir()):
        raise UserError(f"{out}: output directory exists and is not empty")
    # a store URI (or its sparse copy, handed on by the runner): read by byte ranges
    local = (ranged.sparse_copy(str(src)) if is_uri(str(src)) else Path(src)).resolve()
    source = ranged.source_uri(local) if ranged.is_sparse_copy(local) else None
    try:
        return _convert(local, source or str(local), out, dtype, workers, allow_nonfinite, verify,
                        checksum, progress, memory_budget)
    except UserError as exc:
        if source is None:
            raise
        # name the object in the store, not this node's sparse copy
        raise UserError(str(exc).replace(str(local), source)) from None


def _convert(src: Path, source: str, out: Path, dtype: str, workers: int | None, allow_nonfinite: bool,
             verify: bool, checksum: str, progress: Callable[[str], None] | None,
             memory_budget: float | None = None) -> dict:
    """convert_checkpoint from the local directory `src` (a store URI's sparse copy); the
    record and the manifest name `source`."""
    raw = read_checkpoint(src)
    fam = load_family(raw.config, str(src / "config.json"))
    ckpt = formats.logical_view(raw, fam)  # quantised release weights: decoded tensors
    _check_keep(ckpt, dtype)
    if dtype == "keep" and any(isinstance(t, formats.Packed) for t in ckpt.tensors.values()):
        # the release's own stored tensors and quantization_config: a quantised base; a store
        # source's sparse copy gets every stored tensor's bytes (all of them are kept)
        wanted: dict[str, list[tuple[int, int]]] = {}
        for info in raw.tensors.values():
            wanted.setdefault(info.file, []).append((info.start, info.end))
        ranged.fill(wanted)
        return keep.keep_release(raw, ckpt, fam, out, source=source, checksum=checksum,
                                 allow_nonfinite=allow_nonfinite,
                                 transformers_version=_version("transformers"),
                                 config_fix=lambda c: _transformers_model_type(c, fam),
                                 progress=progress)
    plan = plan_conversion(ckpt, fam, dtype)
    fetched = ranged.fill(_planned_ranges(ckpt, plan))  # a store source: only what is converted
    if ranged.is_sparse_copy(src) and progress:
        have, total = ranged.held(src)
        progress(f"read {fetched / 1e6:.1f} MB by ranges from {source} (this node holds "
                 f"{have / 1e6:.1f} MB of its {total / 1e6:.1f} MB of shards)")
    stage = out.parent / f".{out.name}.partial"
    stage.mkdir(parents=True, exist_ok=True)
    tasks = file_tasks(ckpt, plan, dtype, checksum)
    results = run_tasks(list(tasks.values()), stage, workers, progress)
    _check_nonfinite(source, results, allow_nonfinite)
    manifest = _write_outputs(ckpt, fam, plan, results, stage, dtype, checksum, source)
    report, memory = None, {}
    if verify:
        report = verify_converted(stage, src, workers=workers, progress=progress, memory_budget=memory_budget)
        memory = report.pop("memory")  # this run's measure, not the checkpoint's record
        (stage / "verification.json").write_text(json.dumps(report, indent=2))
        if not report["passed"]:
            raise UserError(f"{out}: verification failed: {report['failures'][0]}")
    for marker in stage.glob("*.done.json"):
        marker.unlink()
    record = publish(stage, out, fam, source, len(manifest["tensors"]), len(tasks), manifest["total_bytes"], report)
    return dict(record, memory={"convert": [r.get("peak_bytes") for r in results], **memory})


def _planned_ranges(ckpt, plan: dict) -> dict[str, list[tuple[int, int]]]:
    """{source file: byte ranges} of every stored tensor the plan reads (a release format's
    logical tensor: all its parts); dropped tensors are not read."""
    keys = {k for g in plan["groups"] for ks in g["sources"].values() for k in ks}
    keys |= {k for g in plan["groups"] for k in g["scales"].values()}
    wanted: dict[str, list[tuple[int, int]]] = {}
    for key in keys:
        info = ckpt.tensors[key]
        for part in ([p for _, p in info.parts] if isinstance(info, formats.Packed) else [info]):
            wanted.setdefault(part.file, []).append((part.start, part.end))
    return wanted


def _check_keep(ckpt, policy: str) -> None:
    packed = [t for t in ckpt.tensors.values() if isinstance(t, formats.Packed)]
    if packed and policy == "fp8":
        raise UserError(f"{packed[0].file}: tensor {packed[0].name} is stored {packed[0].format}; "
                        "--dtype fp8 keeps FP8 blocks only (--dtype keep keeps the release as "
                        "stored; bf16 or fp32 decode it)")


def _check_nonfinite(src: str, results: list[dict], allow: bool) -> None:
    bad = {k: n for r in results for k, n in r.get("nonfinite", {}).items()}
    if bad and not allow:
        worst = sorted(bad.items(), key=lambda kv: -kv[1])
        listed = ", ".join(f"{k}: {n}" for k, n in worst[:3])
        raise UserError(f"{src}: non-finite values (NaN/Inf) in {len(bad)} tensor(s): {listed}"
                        f"{' ...' if len(bad) > 3 else ''}; pass --allow-nonfinite to convert anyway")


def _write_outputs(ckpt, fam, plan: dict, results: list[dict], stage: Path, policy: str,
                   checksum: str, source: str) -> dict:
    tensors = {n: e for r in results for n, e in r["tensors"].items()}
    tensors = dict(sorted(tensors.items()))
    total = sum(DTYPES[e["dtype"]].itemsize * _numel(e["shape"]) for e in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": {n: e["file"] for n, e in tensors.items()}}
    (stage / INDEX).write_text(json.dumps(index, indent=2))
    config = dict(ckpt.config)
    _transformers_model_type(config, fam)
    dequantized = any(g["scales"] for g in plan["groups"]) \
        or any(isinstance(t, formats.Packed) for t in ckpt.tensors.values())
    if dequantized:
        config.pop("quantization_config", None)
    dtypes = {e["dtype"] for e in tensors.values() if DTYPES[e["dtype"]].is_floating_point}
    if len(dtypes) == 1:
        config["dtype"] = str(DTYPES[dtypes.pop()]).removeprefix("torch.")
    (stage / "config.json").write_text(json.dumps(config, indent=2))
    for name in ckpt.aux_files:
        shutil.copy2(ckpt.path / name, stage / name)
    source_tensors = {k: _source_entry(v) for k, v in ckpt.tensors.items()}
    manifest = {
        "format": FORMAT, "family": fam.model_type, "architecture": fam.architecture,
        "source_dir": source, "dtype": policy, "dequantized": dequantized, "checksum": checksum,
        "source_shards": ckpt.shards, "source_tensors": source_tensors,
        "dropped": plan["dropped"], "scales": plan["scales"], "groups": plan["groups"],
        "tensors": tensors, "total_bytes": total, "aux_files": ckpt.aux_files,
        "transformers": _version("transformers"),
    }

    if remote_code.needs_code(stage):  # the code convert ran, pinned for every later load
        manifest["remote_code"] = remote_code.pin(stage)
    tmp = stage / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    tmp.replace(stage / MANIFEST)
    return manifest


def _source_entry(info) -> dict:
    entry = {"file": Path(info.file).name, "shape": list(info.shape), "dtype": info.dtype}
    if isinstance(info, formats.Packed):  # decoded from its stored parts
        entry["format"] = info.format
        entry["parts"] = {role: {"name": p.name, "file": Path(p.file).name, "shape": list(p.shape),
                                 "dtype": p.dtype} for role, p in info.parts}
    return entry


def _transformers_model_type(config: dict, fam) -> None:
    """A model_type transformers does not know (Kimi-K2's kimi_k2, loaded as
    DeepseekV3ForCausalLM by `architectures`) becomes the class's own, and the
    remote-code hooks go: the output is a checkpoint for transformers' own
    classes, which every later stage (and AutoConfig) loads as is."""
    # lazy: transformers: heavy, loaded only when this runs
    from transformers import CONFIG_MAPPING

    if config.get("model_type") not in CONFIG_MAPPING:
        config["original_model_type"] = config.get("model_type")
        config["model_type"] = fam.config.model_type
        config.pop("auto_map", None)


def _version(package: str) -> str:
    return version(package)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
