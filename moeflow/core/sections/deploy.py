"""`deploy:` section — Ray Serve application options (engine knobs use vLLM's names)."""

from typing import Annotated, Literal

from pydantic import Field, model_validator

from moeflow.core.sections import ExistingPath, Section


class DeploySection(Section):
    host: str = "127.0.0.1"  # beyond loopback needs an API key (or allow_unauthenticated)
    port: int = Field(default=8000, ge=0, le=65535)  # 0: pick a free port
    num_replicas: int | None = Field(default=None, ge=1)  # None: the plan's inference DP degree, else 1
    max_ongoing_requests: int = Field(default=32, ge=1)  # per replica, before Serve queues
    num_cpus: float = Field(default=1, gt=0)  # per replica; also its torch threads
    served_model_name: str | None = None  # default: model.path's directory name
    merge: bool = False  # merged mode: fine-tuned adapter folded into the base, no LoRA overhead
    adapters: dict[str, str] = Field(default_factory=dict)  # more adapters: name -> dir or models:/URI
    adapter_root: ExistingPath | None = None  # runtime load_lora_adapter may only read under here
    max_loras: int = Field(default=4, ge=1)  # resident adapters; LRU evicted
    # adapters whose weights stay in host memory (vLLM's name), LRU evicted: making one resident is
    # then a copy, not a read from disk / the registry / the store. None: 4 x max_loras. vllm: its
    # engine's max_cpu_loras, and Ray Serve LLM's adapters per replica
    max_cpu_loras: int | None = Field(default=None, ge=1)
    # adapters never evicted, resident from the start (served adapters; at most max_loras). vllm:
    # refused for an adapter served as LoRA (Ray Serve LLM cannot pin); one served merged is resident
    pinned_adapters: list[str] = Field(default_factory=list)
    max_num_seqs: int = Field(default=16, ge=1)  # running requests per engine step
    # tokens per step (chunked prefill budget): decodes first, one token each, then prompt chunks in
    # what is left. vLLM counts tokens only; the local engine charges a chunk its attention too
    # (prefill_keys_per_token), so a long prompt's chunks shrink as its context grows
    max_num_batched_tokens: int = Field(default=512, ge=1)
    enable_chunked_prefill: bool = True  # off: long prompts stall running decodes
    # per-prompt chunk cap; None: 64, at most half the budget. The local engine caps a chunk's charge
    # (tokens + attention) with it: a step carrying one then costs ~1.1-1.5x a decode step of 16
    # streams on the demo model, at any context up to ~4k (docs/serving.md, "Chunked prefill"). In a
    # step with no decodes, None lets a prompt take the whole budget (no stream to stall); a set value
    # still caps it
    long_prefill_token_threshold: int | None = Field(default=None, ge=1)
    max_long_partial_prefills: int = Field(default=1, ge=1)  # long prompts per step; short ones jump ahead
    # local backend: a prompt chunk's attention in budget tokens, one per this many query-key pairs
    # it computes, beside a token each for its own work; None: tokens only (vLLM's count: vLLM has no
    # such argument, and the vllm backend never passes it). Measured: benchmarks/bench_long_prompt.py
    # --step-costs. The same default as the engine's EngineConfig (a test checks)
    prefill_keys_per_token: int | None = Field(default=512, ge=1)
    max_model_len: int | None = Field(default=None, ge=2)  # default: the model's context
    # proxy: Serve's Python proxy (Ray's default); haproxy: Ray Serve's high-throughput mode (HAProxy +
    # the replica serving HTTP itself) on a Ray moeflow starts; auto: haproxy where its binary is
    # installed (ray[serve] on Linux), else proxy -- see moeflow/serving/ingress.py
    ingress: Literal["auto", "proxy", "haproxy"] = "auto"
    # tokens per streamed chunk after the first (vLLM's --stream-interval, whose default is 1): the
    # first token goes at once; 8 roughly doubles 16 concurrent streams' tokens/s on a busy replica
    # (benchmarks/bench_engine.py); 1 sends every token as it is made
    stream_interval: int = Field(default=8, ge=1)
    # true: each replica runs its engine core (scheduling, forwards) in its own process beside it
    # (vLLM V1's split, moeflow/serving/core.py): HTTP, tokenising and detokenising stop taking turns
    # with the forwards under one GIL (16 streams through HAProxy: 0.67-0.74x of `generate` against
    # 0.55-0.63x in the replica's thread, docs/serving.md). Image inputs need the in-process engine
    # (false). auto: the core process for a model whose config shows no vision part
    engine_process: bool | Literal["auto"] = "auto"
    # local backend: forwards (decode steps, plain prompts) through torch.compile, compiled at
    # replica start before it reports ready (the dry run prices that as COMPILE_WARMUP_S, timed by
    # benchmarks/bench_compile_warmup.py; what it gains: docs/serving.md). vLLM compiles unless enforce_eager;
    # off by default here: on CPU the start-up outweighs short jobs and tests. Adapters
    # resident: those forwards stay eager
    compile: bool = False
    # local backend: prompts whose leading 16-token blocks were computed before start from their cached
    # keys and values (vLLM's enable_prefix_caching, on the paged KV cache; models whose cache cannot
    # be paged -- sliding windows, linear attention -- prefill every prompt)
    enable_prefix_caching: bool = False

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: bf16 on GPU, fp32 on CPU
    # per local replica; auto: 1 if the cluster has GPUs
    num_gpus: Annotated[float, Field(ge=0)] | Literal["auto"] = "auto"
    # local: moeflow's engine on Ray Serve, the whole model on one device per replica; vllm: a Ray
    # Serve LLM app (vLLM, TP/PP/EP from the plan); auto: local where one replica fits one device
    # of the hardware spec, else vllm (the plan stage decides and records why)
    backend: Literal["auto", "local", "vllm"] = "auto"
    # vllm: s3/gs/abfss/azure prefix holding <adapter name>/ dirs (Ray Serve LLM loads LoRA only from these)
    lora_uri: str | None = None
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)  # vllm: KV cache share of HBM
    dry_run: bool = False  # vllm: write serve_config.yaml (for serve deploy / KubeRay) without deploying
    api_key_env: str = "MOEFLOW_API_KEY"  # env var holding the API key (keys never go in YAML)
    allow_unauthenticated: bool = False  # serve a non-loopback host without a key
    serving_config: str | None = None  # serving.yaml (serving stage): engine knobs override these
    expert_balance_threshold: float = Field(default=0.3, ge=0, le=1)  # warn below mean/max
    smoke_max_tokens: int = Field(default=4, ge=1)  # per model in the stage's smoke test
    weights: Literal["converted", "calibrated"] = "converted"  # calibrated: the calibrate stage's quantised checkpoint

    @model_validator(mode="after")
    def _adapter_tiers(self) -> "DeploySection":
        if len(set(self.pinned_adapters)) > self.max_loras:
            raise ValueError(f"pinned_adapters: {len(set(self.pinned_adapters))} adapters pinned, "
                             f"but max_loras is {self.max_loras}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        return self
