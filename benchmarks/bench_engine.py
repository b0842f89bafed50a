"""Local engine speed against transformers `generate`, ratios measured in one run.

    .venv/bin/python benchmarks/bench_engine.py                 # in-process + HTTP, demo model
    .venv/bin/python benchmarks/bench_engine.py --no-http --repeat 5

The anchor is what a user would otherwise run: `model.generate` on the same
prompts, greedy, exactly `--output-len` new tokens. Scenarios (demo model,
float32 on CPU, `--num-prompts` prompts of `--input-len` random tokens):

1. static batch: `generate` on all prompts as one left-padded batch vs the
   engine with every request submitted at once (in-process, its own thread);
2. one at a time: `generate` at batch 1 vs the engine with one request in
   flight at a time (in-process);
3. TTFT: one request at a time, time to its first token vs `generate`'s
   prefill of the same prompt (`max_new_tokens=1`), in-process and over HTTP;
   the ratio is prefill time / TTFT (1 / 1.3 = 0.77: TTFT within 1.3x);
4. HTTP: the same prompts as concurrent streamed completions through Ray
   Serve (`moeflow serve`'s app, one replica) vs the static-batch `generate`,
   once per `--stream-intervals` value (`deploy.stream_interval`, vLLM's
   `--stream-interval`: tokens per streamed chunk after the first), per
   `--engine` (`deploy.engine_process`: the engine on a thread of the replica,
   or its core in its own process, moeflow/serving/core.py) and per
   `--ingress` (`deploy.ingress`: HAProxy with the replica serving HTTP itself,
   the default, or Serve's Python proxy). Each ingress runs in a child process
   with its own Ray (Ray reads the ingress from the environment when it
   starts); the child measures its own `generate` anchor, alternating, as above.

5. HTTP vs peer: the same streamed round against `transformers serve
   --continuous-batching` on the same model and prompts, started beside the
   apps in the same child (benchmarks/peer_tf_serve.py: what it is fed and how
   exactly `--output-len` tokens are enforced); `--no-peer` skips it.

Every scenario runs once per `--decode` mode: decode steps eager, or through
torch.compile (`deploy.compile`; the engine's warm-up compiles before the
first request, outside the timings). Each mode is measured against `generate`
of its own kind: eager `generate` for the eager engine; for the compiled one,
`generate` with a static cache, under which transformers compiles the model's
forward itself (`anchor_kwargs`; its first call, outside the timings, compiles), over
the model as the compiled engine sets it up (`anchor_model`: the same experts kernel).
The peer row compares with `transformers serve`, which does not compile.

Each scenario alternates anchor and engine `--repeat` times (HTTP rows:
`--http-repeat` times, 15 by default: a pair takes a fraction of a second, and
on this kind of shared 2-core host one pair in five is off by half) and reports the
median ratio (output tokens/s engine / anchor; for TTFT prefill s / TTFT s).
Targets (issues 17, 33): static batch >= 0.8, one at a time >= 0.8, TTFT >=
0.77 (within 1.3x of the prefill), HTTP streaming >= 0.8, HTTP vs peer >= 1.5.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from engine_rates import (  # noqa: E402
    Client,
    engine_tps,
    engine_ttft_rate,
    http_tps,
    http_ttft_rate,
    prompts,
    round_args,
)

TARGETS = {"static batch": 0.8, "one at a time": 0.8, "TTFT": 0.77, "HTTP TTFT": 0.77, "HTTP streaming": 0.8,
           "HTTP vs peer": 1.5}


def _sync(model) -> None:
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)


def anchor_model(path: str, dtype, device, decode: str):
    """The model `generate` runs for a `decode` mode's anchor: for `compiled`, with the experts
    kernel the compiled engine switches to (ModelRunner: transformers' `grouped_mm` experts
    compute through moeflow's grouped GEMM op, which compiles on CPU in float32, where
    transformers' own falls back to a Python loop per expert), so both sides compile the same
    model; an earlier version compiled `generate` over transformers' kernel."""
    from moeflow.model.models import load_model

    model = load_model(path, dtype).to(device).eval()
    if decode == "compiled":
        from moeflow.serving.runner import _compilable_experts  # the compiled engine's own switch

        _compilable_experts(model)
    return model


def anchor_kwargs(decode: str) -> dict:
    """`generate`'s arguments for the anchor of a `decode` mode: eager for the eager engine; for
    the compiled engine, transformers' own compiled generation (a static cache, under which
    `generate` compiles the model's forward; on CPU only when the config allows every device), so
    each engine mode is compared with `generate` of the same kind."""
    if decode != "compiled":
        return {}
    from transformers import CompileConfig

    config = CompileConfig(mode="default")  # reduce-overhead's CUDA graphs do not apply on CPU
    config._compile_all_devices = True
    return {"cache_implementation": "static", "compile_config": config}


def generate_tps(model, batch: list[list[int]], new: int, **kw) -> float:
    """Output tokens/s of greedy `generate` on `batch` as one batch (equal lengths: no padding)."""
    ids = torch.tensor(batch, device=model.device)
    t0 = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                   do_sample=False, pad_token_id=0, **kw)
    _sync(model)
    return len(batch) * new / (time.perf_counter() - t0)


def generate_serial_tps(model, batch: list[list[int]], new: int, **kw) -> float:
    t0 = time.perf_counter()
    for p in batch:
        ids = torch.tensor([p], device=model.device)
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                       do_sample=False, pad_token_id=0, **kw)
    _sync(model)
    return len(batch) * new / (time.perf_counter() - t0)


def prefill_rate(model, prompt: list[int], **kw) -> float:
    """1 / seconds of `generate`'s prefill of one prompt (one new token)."""
    ids = torch.tensor([prompt], device=model.device)
    t0 = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, min_new_tokens=1,
                   do_sample=False, pad_token_id=0, **kw)
    _sync(model)
    return 1 / (time.perf_counter() - t0)


def ratios(anchor, engine, repeat: int) -> tuple[float, list[tuple[float, float]]]:
    anchor(), engine()  # warm-up
    pairs = [(anchor(), engine()) for _ in range(repeat)]
    return statistics.median(e / a for a, e in pairs), pairs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    round_args(p, str(REPO / "assets" / "demo-base"))
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--http-repeat", type=int, default=15,
                   help="HTTP rows: anchor/server pairs per row (a pair takes well under a second; "
                        "on a noisy host one pair in five can be off by half)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (the serve replica's default is 1)")
    p.add_argument("--device", default="cpu", help="cpu, or cuda (bf16; benchmarks/gpu_check.sh)")
    p.add_argument("--no-http", action="store_true")
    p.add_argument("--stream-intervals", type=int, nargs="+", default=[8],
                   help="HTTP: deploy.stream_interval values to measure (tokens per streamed chunk)")
    p.add_argument("--engine", nargs="+", choices=["thread", "process"], default=["thread", "process"],
                   help="HTTP: the replica's engine on its own thread, or its core in its own process "
                        "(deploy.engine_process)")
    p.add_argument("--ingress", nargs="+", choices=["proxy", "haproxy"], default=["haproxy"],
                   help="HTTP: deploy.ingress values to measure (haproxy: the default where installed)")
    p.add_argument("--decode", nargs="+", choices=["eager", "compiled"], default=["eager", "compiled"],
                   help="decode steps eager, or through torch.compile (deploy.compile; compiled at start)")
    p.add_argument("--no-peer", action="store_true",
                   help="HTTP: skip the `transformers serve --continuous-batching` peer rows")
    p.add_argument("--peer", choices=["tf", "vllm"], default="tf",
                   help="vllm: vLLM's offline LLM.generate and OpenAI server against ours instead "
                        "(benchmarks/peer_vllm.py; needs `make setup-vllm`)")
    p.add_argument("--http-rows", choices=["proxy", "haproxy"], help=argparse.SUPPRESS)  # child process
    args = p.parse_args()
    if args.peer == "vllm":  # its own rows and model: vLLM's CPU attention refuses the demo's head_dim 16
        import peer_vllm

        given = args.model != p.get_default("model")
        for interval in args.stream_intervals:  # like for like: vLLM gets the same --stream-interval
            peer_vllm.run(argparse.Namespace(
                model=args.model if given else None, num_prompts=args.num_prompts, input_len=args.input_len,
                output_len=args.output_len, repeat=args.repeat, http_repeat=args.http_repeat,
                threads=args.threads, decode=args.decode, stream_interval=interval))
        return
    if not args.no_http and not args.no_peer and args.device == "cpu":
        from transformers.utils.import_utils import is_serve_available

        if not is_serve_available():  # checked before minutes of in-process rows, not after them
            sys.exit("bench_engine: the peer row runs `transformers serve`, which needs the OpenAI client "
                     "(`make setup-test` installs it); or pass --no-peer")

    from transformers import AutoTokenizer

    from moeflow.core.devices import resolve_dtype
    from moeflow.model.models import load_model
    from moeflow.serving.engine import Engine, EngineConfig

    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    device = torch.device(args.device)
    dtype = resolve_dtype("auto", device)  # bf16 on GPU, float32 on CPU, as deploy serves
    # the anchor of each engine mode's own kind: eager generate, or generate compiling the same model
    models = {decode: anchor_model(args.model, dtype, device, decode) for decode in args.decode}
    tok = AutoTokenizer.from_pretrained(args.model)
    batch = prompts(args.num_prompts, args.input_len, next(iter(models.values())).config.vocab_size, 0)
    new, rows = args.output_len, []
    if args.http_rows:  # child: this ingress's HTTP rows as JSON on the last line
        print(json.dumps(_http(args, models, tok, batch, new, args.http_rows)))
        return
    for decode in args.decode:
        engine = Engine(load_model(args.model, dtype).to(device), tok,
                        EngineConfig(max_num_seqs=args.num_prompts, compile=decode == "compiled"))
        engine.warm_up()
        engine.start()
        m, kw = models[decode], anchor_kwargs(decode)
        try:
            rows.append(("static batch", f"{decode} generate, one batch", *ratios(
                lambda m=m, kw=kw: generate_tps(m, batch, new, **kw),
                lambda e=engine: engine_tps(e, batch, new, True), args.repeat)))
            rows.append(("one at a time", f"{decode} generate, batch 1", *ratios(
                lambda m=m, kw=kw: generate_serial_tps(m, batch[:4], new, **kw),
                lambda e=engine: engine_tps(e, batch[:4], new, False), args.repeat)))
            rows.append(("TTFT", f"{decode} generate's prefill, 1 prompt", *ratios(
                lambda m=m, kw=kw: prefill_rate(m, batch[0], **kw),
                lambda e=engine: engine_ttft_rate(e, batch[0], new), 2 * args.repeat)))
        finally:
            engine.stop()
    if not args.no_http and device.type == "cpu":  # on GPU: gpu_check.py serve measures HTTP
        for ingress in args.ingress:
            rows += _http_child(args, ingress)
    print(f"\n{'scenario':16} {'anchor':58} {'anchor':>10} {'engine':>10} {'ratio':>6} {'target':>8}"
          "   (tok/s; TTFT rows: ms)")
    for name, anchor, ratio, pairs in rows:
        a = statistics.median(x for x, _ in pairs)
        e = statistics.median(y for _, y in pairs)
        if "TTFT" in name:  # rates (1/s) shown as milliseconds
            a, e = 1000 / a, 1000 / e
        ok = "PASS" if ratio >= TARGETS[name] else "MISS"
        print(f"{name:16} {anchor:58} {a:10.1f} {e:10.1f} {ratio:6.2f} {'>= ' + str(TARGETS[name]):>8} {ok}")


def _http_child(args, ingress: str) -> list:
    """Run this script again for one ingress's HTTP rows (its own process, its own Ray)."""
    argv = ["--model", args.model, "--num-prompts", str(args.num_prompts), "--input-len",
            str(args.input_len), "--output-len", str(args.output_len), "--repeat", str(args.repeat),
            "--http-repeat", str(args.http_repeat),
            "--threads", str(args.threads), "--device", args.device,
            "--stream-intervals", *map(str, args.stream_intervals), "--engine", *args.engine,
            "--decode", *args.decode,
            *(["--no-peer"] if args.no_peer else [])]
    out = subprocess.run([sys.executable, __file__, *argv, "--http-rows", ingress], check=True,
                         stdout=subprocess.PIPE, text=True).stdout
    return [tuple(row) for row in json.loads(out.strip().splitlines()[-1])]


def _http(args, models: dict, tok, batch, new, ingress: str) -> list:
    """HTTP rows: one Serve app per stream interval, all behind one ingress (same run)."""
    import httpx
    import ray
    from ray import serve

    from moeflow.serving.app import ServeSettings, build_app, free_port
    from moeflow.serving.ingress import ingress_environment

    with contextlib.ExitStack() as stack:  # whatever started is stopped, in reverse, on any failure
        peer = peer_client = None
        if not args.no_peer:  # started first: its load time is not the apps'
            from peer_tf_serve import PeerClient, TransformersServe

            peer = stack.enter_context(TransformersServe(args.model, threads=args.threads, device=args.device))
            peer_client = PeerClient(len(batch) + 4)
            stack.callback(peer_client.close)
        client = Client(len(batch) + 4)
        stack.callback(client.close)
        temp = tempfile.mkdtemp(prefix="/tmp/mfbench")
        stack.callback(shutil.rmtree, temp, True)  # Ray's session, last: after Ray has stopped
        with ingress_environment(ingress, temp):
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=temp)
        stack.callback(ray.shutdown)
        stack.callback(serve.shutdown)
        rows = []
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        apps = [(i, e, d) for i in args.stream_intervals for e in args.engine for d in args.decode]
        for interval, mode, decode in apps:
            settings = ServeSettings(base_dir=args.model, served_model_name="demo", stream_interval=interval,
                                     engine={"max_num_seqs": args.num_prompts, "compile": decode == "compiled"},
                                     engine_process=mode == "process")
            # the replicas share Ray's 2 CPUs (one each would leave a third app waiting forever);
            # each computes on its own torch thread whatever Ray's count
            serve.run(build_app(settings, max_ongoing_requests=4 * args.num_prompts,
                                num_cpus=2 / len(apps)), name=f"si{interval}{mode}{decode}",
                      route_prefix=f"/si{interval}{mode}{decode}", blocking=False)
        for interval, mode, decode in apps:
            url = f"http://127.0.0.1:{port}/si{interval}{mode}{decode}"
            httpx.get(f"{url}/v1/models", timeout=600).raise_for_status()
            m, kw = models[decode], anchor_kwargs(decode)  # the server's own kind of generate
            rows.append(("HTTP streaming", f"{decode} generate ({ingress}, interval {interval}, {mode})", *ratios(
                lambda m=m, kw=kw: generate_tps(m, batch, new, **kw), lambda u=url: http_tps(client, u, batch, new),
                args.http_repeat)))
            rows.append(("HTTP TTFT", f"{decode} prefill ({ingress}, {mode})", *ratios(
                lambda m=m, kw=kw: prefill_rate(m, batch[0], **kw),
                lambda u=url: http_ttft_rate(client, u, batch[0], new), args.http_repeat)))
            if peer is not None:
                rows.append(("HTTP vs peer", f"transformers serve --cb ({ingress}, {interval}, {mode}, {decode})",
                             *ratios(lambda: peer_tps(peer, peer_client, tok, batch, new),
                                     lambda u=url: http_tps(client, u, batch, new), args.http_repeat)))
        return rows


def peer_tps(peer, peer_client, tok, batch: list[list[int]], new: int) -> float:
    """The peer's output tokens/s on the same prompts (benchmarks/peer_tf_serve.py), each request
    checked to have produced exactly `new` tokens."""
    from peer_tf_serve import peer_round

    streams, wall = peer_round(peer.url, peer.model_id, batch, new, tok, peer_client)
    short = [s.completion_tokens for s in streams if s.completion_tokens != new]
    if short:
        raise RuntimeError(f"transformers serve produced {short} tokens, not {new}")
    return sum(s.completion_tokens for s in streams) / wall


if __name__ == "__main__":
    main()
