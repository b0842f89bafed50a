"""Peak memory of each vLLM worker process, as moeflow.core.memmeter measures a stage process:
the resident-set high-water mark above the level the process had just before it read its
first tensor; and where that memory goes.

vLLM imports the class named by its `worker_extension_cls` engine argument in every worker
process (vllm.v1.worker.worker_base.WorkerWrapperBase.init_worker), before the worker sets up
its device and loads its model. Imported there (MOEFLOW_VLLM_METER_DIR set), this module wraps
the worker's `load_model` so that a PeakMemory meter starts just before it (VmHWM reset through
/proc/self/clear_refs, the resident set noted), and writes the worker's pid, that level and its
parts (anonymous, file-backed, shared) to $MOEFLOW_VLLM_METER_DIR/<pid>.json; the same file
gains the level and high-water mark after the model is loaded (its weights repacked for the CPU
kernels) and after the KV cache is allocated (`phases`). The rehearsal
(benchmarks/rehearse_serving.py) reads each worker's VmHWM from /proc/<pid>/status once its
completions are served: the peak of building the model, reading its share of the weights,
repacking them for the CPU kernels, the KV cache and every forward since.

Run as a script (in the vLLM environment) it brings up vLLM's offline engine on a checkpoint
with the engine settings given, runs greedy prompts that fill the step's token budget, and
prints each worker's peak and its parts (`WorkerMeter.meter_report`, asked of every worker
through vLLM's collective_rpc): parameters, KV cache, the model runner's persistent buffers,
and glibc's heap (in use / free but kept) -- the terms the vLLM plan
(moeflow/parallel/vllm_plan.py) must cover:

    .venv-vllm/bin/python benchmarks/vllm_worker_meter.py MODEL_DIR --tp 2 --tokens 512 --seqs 2

Why a wrapped method: an extension class is appended to the worker's bases, so it cannot
override load_model, and vLLM has no hook before it that a plugin could use without being
installed into vLLM's environment (an entry point). The wrap changes nothing the worker does.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from the vLLM environment
    sys.path.insert(0, str(ROOT))

from moeflow.core.memmeter import PeakMemory  # noqa: E402  (after the path above)

METER_DIR = "MOEFLOW_VLLM_METER_DIR"
KINDS = ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem")


def resident() -> dict[str, int]:
    """This process's resident set, its high-water mark and the resident parts, bytes."""
    text = Path("/proc/self/status").read_text()
    return {k: int(m.group(1)) * 1024 for k in KINDS if (m := re.search(rf"^{k}:\s+(\d+) kB", text, re.M))}


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]


def heap() -> dict[str, int]:
    """glibc's allocator (mallinfo2, all arenas): bytes its heaps span (arena), in use there
    (uordblks), free there but kept from the system (fordblks), and in mmapped chunks (hblkhd)."""
    try:
        f = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):  # not glibc (>= 2.33)
        return {}
    f.restype = _MallInfo2
    m = f()
    return {"arena": m.arena, "in_use": m.uordblks, "free_kept": m.fordblks, "mmapped": m.hblkhd}


def _note(phase: str) -> None:
    path = Path(os.environ[METER_DIR], f"{os.getpid()}.json")
    rec = json.loads(path.read_text())
    rec.setdefault("phases", {})[phase] = {**resident(), "heap": heap()}
    path.write_text(json.dumps(rec))


def _wrap_worker() -> None:
    # lazy: vLLM is there only where vLLM imports this module (its worker processes)
    from vllm.v1.worker.gpu_worker import Worker  # CPUWorker's load_model is this one

    load, init_kv = Worker.load_model, Worker.initialize_from_config

    def load_model(self, *args, **kwargs):
        parts = resident()
        meter = PeakMemory().start()
        Path(os.environ[METER_DIR], f"{os.getpid()}.json").write_text(json.dumps(
            {"pid": os.getpid(), "base_bytes": meter.base, "measure": meter.how, "at_start": parts}))
        out = load(self, *args, **kwargs)
        _note("loaded")
        return out

    def initialize_from_config(self, *args, **kwargs):
        out = init_kv(self, *args, **kwargs)
        _note("kv_cache")
        return out

    Worker.load_model = load_model  # type: ignore[method-assign]
    Worker.initialize_from_config = initialize_from_config  # type: ignore[method-assign]


if os.environ.get(METER_DIR):  # only where vLLM imports it as its worker extension
    _wrap_worker()
    # the meter replaces the extension the vllm backend names (one class per engine): its fix too
    import moeflow.serving.vllm_worker  # noqa: E402,F401  (wraps vLLM's CPU warm-up on import)


def _tensor_bytes(tensors) -> int:
    """Bytes of the distinct storages under `tensors` (views of one storage count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


class WorkerMeter:
    """The extension class itself: its import is the hook; `meter_report` is asked of every
    worker by the script (collective_rpc) and changes nothing."""

    def meter_report(self) -> dict:
        """Where this worker's memory is: its meter record, its resident set now, parameters
        (as the CPU kernels hold them, repacked), KV cache, the runner's persistent buffers."""
        import torch  # lazy: a worker has it loaded

        runner = self.model_runner  # type: ignore[attr-defined]
        model = runner.get_model()
        buffers = []
        for v in list(vars(runner).values()) + list(vars(runner.input_batch).values()):
            if isinstance(v, torch.Tensor):
                buffers.append(v)
            elif hasattr(v, "cpu") and isinstance(v.cpu, torch.Tensor):  # CpuGpuBuffer
                buffers.append(v.cpu)
        kv = [t for t in runner.kv_caches if isinstance(t, torch.Tensor)]
        path = Path(os.environ[METER_DIR], f"{os.getpid()}.json")
        return {"pid": os.getpid(), "meter": json.loads(path.read_text()), "now": resident(), "heap": heap(),
                "param_bytes": _tensor_bytes(list(model.parameters()) + list(model.buffers())),
                "kv_bytes": _tensor_bytes(kv), "runner_buffer_bytes": _tensor_bytes(buffers)}


    def meter_probe(self, sizes: list[int]) -> list[dict]:
        """Each of vLLM's own dummy forwards (`_dummy_run`, attention included) of `sizes` tokens
        in turn, then its dummy sampler run: the growth of the resident set at its highest
        (VmHWM reset before each) and after, bytes -- which memory a forward adds, once or per
        token."""
        out = []
        runner = self.model_runner  # type: ignore[attr-defined]
        for n in sizes:
            before = PeakMemory().start()
            result = runner._dummy_run(n, force_attention=True)
            now = resident()
            out.append({"tokens": n, "peak": now["VmHWM"] - before.base, "kept": now["VmRSS"] - before.base,
                        "anon_now": now["RssAnon"], "file_now": now["RssFile"]})
        hidden = result[0] if isinstance(result, tuple) else result
        before = PeakMemory().start()
        runner._dummy_sampler_run(hidden[: runner.scheduler_config.max_num_seqs])
        now = resident()
        out.append({"sampler_rows": runner.scheduler_config.max_num_seqs, "peak": now["VmHWM"] - before.base,
                    "kept": now["VmRSS"] - before.base})
        return out


def main() -> int:
    import argparse
    import tempfile

    parser = argparse.ArgumentParser(description="vLLM workers' peaks and their parts (module docstring)")
    parser.add_argument("model")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=512, help="max_num_batched_tokens")
    parser.add_argument("--seqs", type=int, default=2, help="max_num_seqs")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--kv-bytes", type=int, default=6_291_456, help="kv_cache_memory_bytes per worker")
    parser.add_argument("--probe", type=int, nargs="*", help="dummy forwards of these token counts first")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    from moeflow.serving.vllm_run import BIND_ENV, cpu_binding

    tmp = tempfile.mkdtemp(prefix="vllm-meter-")
    os.environ[METER_DIR] = tmp
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if bind := cpu_binding(args.tp * args.pp):
        os.environ[BIND_ENV] = bind
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=args.model, dtype="float32", tensor_parallel_size=args.tp, pipeline_parallel_size=args.pp,
              distributed_executor_backend="mp",
              enforce_eager=True, worker_extension_cls="benchmarks.vllm_worker_meter.WorkerMeter",
              kv_cache_memory_bytes=args.kv_bytes, max_num_seqs=args.seqs, max_num_batched_tokens=args.tokens,
              max_model_len=args.max_model_len, seed=0)
    probes = llm.collective_rpc("meter_probe", args=(args.probe,)) if args.probe else []
    for i, steps in enumerate(probes):
        print(f"worker {i} dummy runs: " + "; ".join(
            f"{s.get('tokens', 'sampler')}: peak +{s['peak'] / 1e6:.1f} kept +{s['kept'] / 1e6:.1f} MB" for s in steps))
    # prompts that fill the step: max_num_seqs of them, each as long as a step holds, so one step
    # carries max_num_batched_tokens tokens (the largest forward the settings allow)
    long = min(args.tokens, args.max_model_len - 8)
    prompts = [TokensPrompt(prompt_token_ids=[(7 * i + 3 * j) % 500 + 10 for j in range(long)])
               for i in range(args.seqs)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    reports = llm.collective_rpc("meter_report")
    for r in reports:
        status = Path(f"/proc/{r['pid']}/status").read_text()
        r["hwm_end"] = int(re.search(r"^VmHWM:\s+(\d+) kB", status, re.M).group(1)) * 1024
        r["peak_bytes"] = r["hwm_end"] - r["meter"]["base_bytes"]
    rec = {"args": vars(args) | {"json": None, "model": args.model}, "workers": reports, "probes": probes}
    mb = 1e6
    for r in reports:
        ph = r["meter"].get("phases", {})
        print(f"worker {r['pid']}: peak {r['peak_bytes'] / mb:.1f} MB above {r['meter']['base_bytes'] / mb:.0f}; "
              f"params {r['param_bytes'] / mb:.1f}, KV {r['kv_bytes'] / mb:.1f}, runner buffers "
              f"{r['runner_buffer_bytes'] / mb:.1f} MB; HWM after load "
              f"{(ph.get('loaded', {}).get('VmHWM', 0) - r['meter']['base_bytes']) / mb:.1f}, after KV "
              f"{(ph.get('kv_cache', {}).get('VmHWM', 0) - r['meter']['base_bytes']) / mb:.1f}; heap now "
              + ", ".join(f"{k} {v / mb:.1f}" for k, v in r["heap"].items())
              + "; resident now " + ", ".join(f"{k} {v / mb:.1f}" for k, v in r["now"].items()))
    if args.json:
        args.json.write_text(json.dumps(rec, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
