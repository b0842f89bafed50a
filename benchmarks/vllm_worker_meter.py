"""Peak memory of each vLLM worker process, as moeflow.core.memmeter measures a stage process:
the resident-set high-water mark above the level the process had just before it read its
first tensor.

vLLM imports the class named by its `worker_extension_cls` engine argument in every worker
process (vllm.v1.worker.worker_base.WorkerWrapperBase.init_worker), before the worker sets up
its device and loads its model. Imported there (MOEFLOW_VLLM_METER_DIR set), this module wraps
the worker's `load_model` so that a PeakMemory meter starts just before it (VmHWM reset through
/proc/self/clear_refs, the resident set noted), and writes the worker's pid, that level and its
parts (anonymous, file-backed, shared) to $MOEFLOW_VLLM_METER_DIR/<pid>.json. The rehearsal
(benchmarks/rehearse_serving.py) reads each worker's VmHWM from /proc/<pid>/status once its
completions are served: the peak of building the model, reading its share of the weights,
repacking them for the CPU kernels, the KV cache and every forward since.

Why a wrapped method: an extension class is appended to the worker's bases, so it cannot
override load_model, and vLLM has no hook before it that a plugin could use without being
installed into vLLM's environment (an entry point). The wrap changes nothing the worker does.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from moeflow.core.memmeter import PeakMemory

METER_DIR = "MOEFLOW_VLLM_METER_DIR"
KINDS = ("VmRSS", "RssAnon", "RssFile", "RssShmem")


def resident() -> dict[str, int]:
    """This process's resident set and its parts, bytes."""
    text = Path("/proc/self/status").read_text()
    return {k: int(m.group(1)) * 1024 for k in KINDS if (m := re.search(rf"^{k}:\s+(\d+) kB", text, re.M))}


def _wrap_load_model() -> None:
    # lazy: vLLM is there only where vLLM imports this module (its worker processes)
    from vllm.v1.worker.gpu_worker import Worker  # CPUWorker's load_model is this one

    original = Worker.load_model

    def load_model(self, *args, **kwargs):
        parts = resident()
        meter = PeakMemory().start()
        Path(os.environ[METER_DIR], f"{os.getpid()}.json").write_text(json.dumps(
            {"pid": os.getpid(), "base_bytes": meter.base, "measure": meter.how, "at_start": parts}))
        return original(self, *args, **kwargs)

    Worker.load_model = load_model  # type: ignore[method-assign]


if os.environ.get(METER_DIR):  # only where vLLM imports it as its worker extension
    _wrap_load_model()


class WorkerMeter:
    """The extension class itself: it adds nothing to the worker (its import is the hook)."""
