"""Peak memory of each vLLM worker process, as moeflow.core.memmeter measures a stage process.

vLLM imports the class named by its `worker_extension_cls` engine argument in every worker
process (vllm.v1.worker.worker_base.WorkerWrapperBase.init_worker) before that worker sets up
its device (init_device: the gloo / shm groups of TP and PP) and loads its weights. Importing
this module there starts a PeakMemory meter (the resident-set high-water mark VmHWM reset
through /proc/self/clear_refs, the resident set noted) and writes the worker's pid and that
level to $MOEFLOW_VLLM_METER_DIR/<pid>.json. The rehearsal (benchmarks/rehearse_serving.py)
reads each worker's VmHWM from /proc/<pid>/status once its completions are served: the peak
above the level before the weights, the device setup, the KV cache and every forward.

vLLM has no hook between init_worker and init_device that a plugin could use without being
installed into its environment (an entry point); an extension class needs only the import path.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from moeflow.core.memmeter import PeakMemory

METER_DIR = "MOEFLOW_VLLM_METER_DIR"

if os.environ.get(METER_DIR):  # only where vLLM imports it as its worker extension
    _meter = PeakMemory().start()
    Path(os.environ[METER_DIR], f"{os.getpid()}.json").write_text(json.dumps(
        {"pid": os.getpid(), "base_bytes": _meter.base, "measure": _meter.how}))


class WorkerMeter:
    """The extension class itself: it adds nothing to the worker (its import is the hook)."""
