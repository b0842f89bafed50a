"""vLLM as a measured peer of moeflow's engine: offline and served, same model, same prompts.

    .venv/bin/python benchmarks/bench_engine.py --peer vllm         # hands over to this module
    .venv/bin/python benchmarks/peer_vllm.py [--model DIR] [--repeat 3] [--http-repeat 5]

Needs the vLLM environment (`make setup-vllm`: vLLM's CPU build on a CPU host). Two rows,
both measured in this one run, on `--num-prompts` prompts of `--input-len` random token ids
(bench_engine.prompts), greedy, exactly `--output-len` new tokens each (ignore_eos):

1. offline: vLLM's `LLM.generate` on all prompts at once (a child process in the vLLM venv:
   `--offline-child`; `LLM` spawns its engine core, so that child is a script of its own)
   vs moeflow's Engine with every request submitted at once (in-process, its own thread),
   built from the served row's settings (one torch thread, as a replica); medians of
   `--repeat` timed rounds each, after one warm-up round. The child runs in its own process
   group, and what of it outlives it (seen: vLLM's engine core) is stopped before our row is
   timed: an earlier version timed ours beside it, and its bare engine on every core, and
   measured ours offline at 0.05-0.10x, below our own served figure.
2. served: vLLM's own OpenAI server (`vllm.entrypoints.openai.api_server`, vLLM venv, its own
   process group on 127.0.0.1) vs moeflow's app on Ray Serve (`moeflow serve`'s, one
   replica): the same concurrent streamed completions from the same client
   (bench_engine.Client), alternating, `--http-repeat` pairs; the median ratio.

Default model: a tiny Qwen3-MoE (hidden 64, head_dim 32, 8 experts top-2, float32) built in a
temporary directory: vLLM's CPU attention refuses the demo model's head_dim 16. Both sides run
float32 on CPU. vLLM computes on every core it is given (its OpenMP threads); moeflow's
replica on `--threads` torch threads (1 by default, as a replica has).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(BENCH))
MAX_MODEL_LEN = 512
MARK = "peer_vllm rates: "
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def offline_child(model: str, prompts_file: str, new: int, repeat: int) -> None:
    """(vLLM venv) `LLM.generate` tok/s of every prompt at once, `repeat` rounds: one JSON line."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    batch = json.loads(Path(prompts_file).read_text())
    llm = LLM(model=model, dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_seqs=len(batch),
              seed=0)
    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    inputs = [TokensPrompt(prompt_token_ids=p) for p in batch]
    llm.generate(inputs, params, use_tqdm=False)  # warm-up
    rates = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        outs = llm.generate(inputs, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        made = [len(o.outputs[0].token_ids) for o in outs]
        if any(n != new for n in made):
            raise RuntimeError(f"vLLM produced {made} tokens, not {new}")
        rates.append(sum(made) / wall)
    print(MARK + json.dumps(rates), flush=True)  # vLLM's engine may print after it


def vllm_python() -> str:
    from moeflow.serving.vllm_run import vllm_missing, vllm_python

    if why := vllm_missing():
        sys.exit(f"peer_vllm: {why}")
    return str(vllm_python())


def vllm_offline(model: str, batch: list[list[int]], new: int, repeat: int) -> list[float]:
    """The offline child's rates. It runs in its own process group, and whatever of that group
    outlives it (vLLM's engine core, its OpenMP threads spinning) is stopped before our rows
    are timed, and said: a straggler would be measured as our slowness."""
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(batch, f)
        f.flush()
        proc = subprocess.Popen([vllm_python(), __file__, "--offline-child", "--model", model, "--prompts-file",
                                 f.name, "--output-len", str(new), "--repeat", str(repeat)],
                                env={**os.environ, **VLLM_ENV}, stdout=subprocess.PIPE, text=True,
                                start_new_session=True)
        stdout, _ = proc.communicate()
    try:
        os.killpg(proc.pid, signal.SIGKILL)
        print("peer_vllm: the offline child's process group outlived it: stopped", file=sys.stderr)
    except ProcessLookupError:
        pass
    if proc.returncode != 0:
        raise RuntimeError(f"vLLM's offline child exited with {proc.returncode}")
    return json.loads(next(ln for ln in stdout.splitlines() if ln.startswith(MARK))[len(MARK):])


@contextlib.contextmanager
def vllm_server(model: str, num_seqs: int):
    """vLLM's OpenAI server on 127.0.0.1 in its own process group; yields its URL once /health answers."""
    import httpx

    from moeflow.serving.app import free_port

    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="vllm-serve-", suffix=".log", delete=False)
    cmd = [vllm_python(), "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--served-model-name",
           "demo", "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", str(num_seqs),
           "--host", "127.0.0.1", "--port", str(port), "--disable-log-stats"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env={**os.environ, **VLLM_ENV}, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM's server exited with {proc.returncode} (log {log.name})")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM's server not answering after 600 s (log {log.name})")
            time.sleep(1)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def our_settings(model_dir: str, num_seqs: int, threads: int):
    """What moeflow's replica serves in the served row; the offline row builds its engine from
    the same settings, as a replica does (moeflow.serving.service / core.load_served)."""
    from moeflow.serving.app import ServeSettings

    return ServeSettings(base_dir=model_dir, served_model_name="demo", dtype="float32", torch_threads=threads,
                         engine={"max_num_seqs": num_seqs})


def ours_offline(settings, batch: list[list[int]], new: int, repeat: int) -> list[float]:
    """moeflow's Engine with every request submitted at once, in this process, built as a replica
    builds it (the same settings: torch threads, dtype, experts kernel, engine knobs). Built bare
    (an Engine over `load_model`, this process's default torch threads: every core), it ran
    under half the served row's rate on a loaded 2-core host: the tiny model's ops on two
    OpenMP threads wait on each other, where the replica computes on one."""
    import torch
    from engine_rates import engine_tps
    from transformers import AutoTokenizer

    from moeflow.serving.core import load_served
    from moeflow.serving.engine import Engine, EngineConfig

    before = torch.get_num_threads()
    torch.set_num_threads(settings.torch_threads)
    engine = Engine(load_served(settings, {}), AutoTokenizer.from_pretrained(settings.base_dir),
                    EngineConfig(**settings.engine))
    engine.warm_up()
    engine.start()
    try:
        engine_tps(engine, batch, new, True)  # warm-up
        return [engine_tps(engine, batch, new, True) for _ in range(repeat)]
    finally:
        engine.stop()
        torch.set_num_threads(before)


def served(settings, batch: list[list[int]], new: int, repeat: int) -> list[tuple[float, float]]:
    """(vLLM server tok/s, ours tok/s) pairs of the same streamed round, alternating."""
    import httpx
    import ray
    from engine_rates import Client, http_tps
    from ray import serve

    from moeflow.serving.app import build_app, free_port

    with contextlib.ExitStack() as stack:
        peer = stack.enter_context(vllm_server(settings.base_dir, len(batch)))  # first: its load is not ours
        client = Client(len(batch) + 4)
        stack.callback(client.close)
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
                 _temp_dir=tempfile.mkdtemp(prefix="/tmp/mfbench"))
        stack.callback(ray.shutdown)
        stack.callback(serve.shutdown)
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(settings, max_ongoing_requests=4 * len(batch)), name="ours", route_prefix="/ours",
                  blocking=False)
        ours = f"http://127.0.0.1:{port}/ours"
        httpx.get(f"{ours}/v1/models", timeout=600).raise_for_status()
        http_tps(client, peer, batch, new), http_tps(client, ours, batch, new)  # warm-up
        return [(http_tps(client, peer, batch, new), http_tps(client, ours, batch, new)) for _ in range(repeat)]


def default_model(root: Path) -> str:
    from moeflow_testing.tiny import build_debug_model

    return str(build_debug_model("qwen3_moe", root / "tiny-moe-hd32", head_dim=32, dtype="float32"))


def run(args: argparse.Namespace) -> None:
    """Both rows, printed as bench_engine prints its rows (ratio: ours / vLLM)."""
    from engine_rates import prompts

    from moeflow.model.params import load_config_json

    vllm_python()  # a clear line now, not after minutes of our rows
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or default_model(Path(tmp))
        cfg = load_config_json(model)
        batch = prompts(args.num_prompts, args.input_len, cfg["vocab_size"], 0)
        new = args.output_len
        settings = our_settings(model, len(batch), args.threads)
        vllm_off = vllm_offline(model, batch, new, args.repeat)
        ours_off = ours_offline(settings, batch, new, args.repeat)
        pairs = served(settings, batch, new, args.http_repeat)
    rows = [("offline", "vLLM LLM.generate vs moeflow Engine", statistics.median(vllm_off),
             statistics.median(ours_off), statistics.median(ours_off) / statistics.median(vllm_off)),
            ("served", "vLLM OpenAI server vs moeflow serve", statistics.median(p for p, _ in pairs),
             statistics.median(o for _, o in pairs), statistics.median(o / p for p, o in pairs))]
    print(f"\nmodel {model if args.model else 'tiny Qwen3-MoE, head_dim 32'}; {args.num_prompts} prompts x "
          f"{args.input_len} in x {new} out, float32, CPU")
    print(f"{'scenario':10} {'what':40} {'vLLM':>10} {'moeflow':>10} {'ratio':>6}   (output tok/s)")
    for name, what, peer, ours, ratio in rows:
        print(f"{name:10} {what:40} {peer:10.1f} {ours:10.1f} {ratio:6.2f}")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="model dir (default: a tiny Qwen3-MoE with head_dim 32)")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--http-repeat", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="moeflow's torch threads, both rows (a replica's default: 1)")
    p.add_argument("--offline-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--prompts-file", help=argparse.SUPPRESS)
    return p


if __name__ == "__main__":
    a = parser().parse_args()
    if a.offline_child:
        offline_child(a.model, a.prompts_file, a.output_len, a.repeat)
    else:
        run(a)
