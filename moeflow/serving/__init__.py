"""Serving: continuous-batching engine, LoRA adapters, OpenAI API on Ray Serve.

- engine_core.py the engine core: scheduler + KV cache + mixed-adapter forwards (transformers + PEFT), token ids out
- client.py   the front end (queue limits, output processor) over a core in process (engine.py) or not (core.py)
- adapters.py adapter registry (path safety, compatibility) and LRU residency (max_loras)
- lora_batch.py per-row and per-token LoRA deltas for mixed-adapter batches, padded or packed
- api.py      FastAPI routes: /v1/models, /v1/completions, /v1/chat/completions, ...
              (their errors: api_errors.py; API key and body limit: middleware.py)
- metrics.py  Prometheus metrics with vLLM's names (moeflow_ prefix), expert load
- app.py      ServeSettings, the replica's Service, the Ray Serve deployment
- fixtures.py random PEFT adapters for tests and benchmarks
"""
