"""Run in the vLLM environment (.venv-vllm), by tests/test_merge_kept_vllm.py and
tests/test_vllm_pipeline.py: load a checkpoint with `vllm.LLM` and print one JSON line,
{"tokens": [[ids] per prompt]} (greedy), or {"error": the last line vLLM raised}.

    .venv-vllm/bin/python tests/vllm_merged_load.py MODEL_DIR MAX_TOKENS IDS_JSON [ENGINE_KWARGS_JSON]
"""

from __future__ import annotations

import json
import sys


def main(model_dir: str, max_tokens: int, prompts: list[list[int]], engine: dict | None = None) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model_dir, dtype="float32", max_model_len=256, enforce_eager=True,
              max_num_seqs=4, seed=0, **(engine or {}))
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                        SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    return {"tokens": [list(o.outputs[0].token_ids) for o in outs]}


if __name__ == "__main__":  # vLLM's engine starts worker processes: only when run as a script
    try:
        result = main(sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]),
                      json.loads(sys.argv[4]) if len(sys.argv) > 4 else None)
    except Exception as e:  # reported to the test, which records vLLM's own words
        lines = [ln for ln in str(e).splitlines() if ln.strip()]
        result = {"error": f"{type(e).__name__}: {lines[-1] if lines else ''}"[:500]}
    print(json.dumps(result))
