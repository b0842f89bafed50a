"""vLLM as a measured peer of moeflow's engine: offline and served, same model, same prompts.

    .venv/bin/python benchmarks/bench_engine.py --peer vllm         # hands over to this module
    .venv/bin/python benchmarks/peer_vllm.py [--model DIR] [--decode eager] [--http-repeat 5]

Needs the vLLM environment (`make setup-vllm`: vLLM's CPU build on a CPU host). Two rows per
`--decode` mode, all measured in this one run, on `--num-prompts` prompts of `--input-len`
random token ids (bench_engine.prompts), greedy, exactly `--output-len` new tokens each
(ignore_eos). Like for like: `eager` runs vLLM with `enforce_eager` against moeflow's eager
engine; `compiled` runs vLLM as it starts by default (its forward through torch.compile)
against moeflow with `deploy.compile`.

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
   replica, behind the ingress `moeflow serve` uses by default: HAProxy where installed, the
   replica serving HTTP itself, as vLLM's server does): the same concurrent streamed
   completions from the same client (bench_engine.Client), alternating, `--http-repeat`
   pairs; the median ratio. Both stream `--stream-interval` tokens per chunk after the first
   (vLLM's `--stream-interval`, moeflow's `deploy.stream_interval`; 8 is moeflow's default,
   1 vLLM's).

Default model: a tiny Qwen3-MoE (hidden 64, head_dim 32, 8 experts top-2, float32) built in a
temporary directory: vLLM's CPU attention refuses the demo model's head_dim 16. Both sides run
float32 on CPU. Compute threads: vLLM's CPU build, on a 2-core host, binds its engine's OpenMP
threads to the cores left after reserving one for its front end (`VLLM_CPU_OMP_THREADS_BIND=
auto`: one thread here); moeflow's replica computes on `--threads` torch threads (1 by default,
as a replica has).
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
# after a round, vLLM's worker keeps polling its shared-memory queue for 1 s before it sleeps
# (vllm/distributed/device_communicators/shm_broadcast.py: SpinCondition, busy_loop_s=1): a round
# of ours started at once was timed beside it, which on a shared 2-core host took most of a core
# from ours. Every round, either side's, is followed by this pause, and each side's CPU is counted
# over its round and the pause after it (its idle polling is its own cost).
SETTLE_S = 1.5
# vLLM's processes get a process group of their own (stopped as one) but stay in this session: a new
# session (setsid) is also a new scheduling autogroup on Linux, whose CPU share on a loaded host is
# that of the whole session the other side runs in; in one session both sides share one
# (/proc/PID/autogroup)
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def offline_child(model: str, prompts_file: str, new: int, eager: bool) -> None:
    """(vLLM venv) `LLM.generate` of every prompt at once, one round per `round` line on stdin
    (after a warm-up round; READY first): its tok/s as one JSON line each. Until stdin closes."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    batch = json.loads(Path(prompts_file).read_text())
    llm = LLM(model=model, dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_seqs=len(batch),
              seed=0, enforce_eager=eager)
    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    inputs = [TokensPrompt(prompt_token_ids=p) for p in batch]
    llm.generate(inputs, params, use_tqdm=False)  # warm-up
    print(MARK + "READY", flush=True)  # vLLM's engine may print to stdout too: marked lines only
    for line in sys.stdin:
        if line.strip() != "round":
            break
        t0 = time.perf_counter()
        outs = llm.generate(inputs, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        made = [len(o.outputs[0].token_ids) for o in outs]
        if any(n != new for n in made):
            raise RuntimeError(f"vLLM produced {made} tokens, not {new}")
        print(MARK + json.dumps(sum(made) / wall), flush=True)


def vllm_python() -> str:
    from moeflow.serving.vllm_run import vllm_missing, vllm_python

    if why := vllm_missing():
        sys.exit(f"peer_vllm: {why}")
    return str(vllm_python())


class VllmOffline:
    """The offline child (vLLM's `LLM`, in the vLLM venv), kept running so its rounds alternate
    with ours: one round's (tok/s, CPU s of its process tree) per `round()`. The child runs in
    its own process group; on leaving, the group is stopped (what outlives the child -- seen:
    vLLM's engine core -- would otherwise compute beside the rows that follow)."""

    def __init__(self, model: str, batch: list[list[int]], new: int, eager: bool):
        self.prompts = tempfile.NamedTemporaryFile("w", suffix=".json")
        json.dump(batch, self.prompts)
        self.prompts.flush()
        self.proc = subprocess.Popen([vllm_python(), __file__, "--offline-child", "--model", model, "--prompts-file",
                                      self.prompts.name, "--output-len", str(new), *(["--eager"] if eager else [])],
                                     env={**os.environ, **VLLM_ENV}, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, process_group=0)
        self._answer()  # READY: loaded and warmed up

    def _answer(self) -> str:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(MARK):
                return line[len(MARK):].strip()
        raise RuntimeError(f"vLLM's offline child exited with {self.proc.wait()}")

    def round(self) -> tuple[float, float]:
        """(tok/s, CPU s of the child's processes over the round and the SETTLE_S after it)."""
        from engine_rates import tree_cpu

        assert self.proc.stdin is not None
        cpu = tree_cpu(self.proc.pid)
        self.proc.stdin.write("round\n")
        self.proc.stdin.flush()
        rate = float(json.loads(self._answer()))
        time.sleep(SETTLE_S)
        return rate, tree_cpu(self.proc.pid) - cpu

    def close(self) -> None:
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.prompts.close()


@contextlib.contextmanager
def vllm_server(model: str, num_seqs: int, eager: bool, interval: int):
    """vLLM's OpenAI server on 127.0.0.1 in its own process group; yields its URL once /health answers.
    `eager`: `--enforce-eager`; `interval`: `--stream-interval`."""
    import httpx

    from moeflow.serving.app import free_port

    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="vllm-serve-", suffix=".log", delete=False)
    cmd = [vllm_python(), "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--served-model-name",
           "demo", "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", str(num_seqs),
           "--host", "127.0.0.1", "--port", str(port), "--disable-log-stats", "--stream-interval", str(interval),
           *(["--enforce-eager"] if eager else [])]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env={**os.environ, **VLLM_ENV}, process_group=0)
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
        yield url, proc.pid
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def our_settings(model_dir: str, num_seqs: int, threads: int, compiled: bool, interval: int):
    """What moeflow's replica serves in the served row; the offline row builds its engine from
    the same settings, as a replica does (moeflow.serving.service / core.load_served)."""
    from moeflow.serving.app import ServeSettings

    return ServeSettings(base_dir=model_dir, served_model_name="demo", dtype="float32", torch_threads=threads,
                         stream_interval=interval, engine={"max_num_seqs": num_seqs, "compile": compiled})


def offline(settings, model: str, batch: list[list[int]], new: int, repeat: int, eager: bool) -> list[tuple]:
    """(vLLM tok/s, ours tok/s, vLLM CPU s, ours CPU s) per round, alternating: vLLM's `LLM`
    (VllmOffline) and moeflow's Engine with every request submitted at once, in this process,
    built as a replica builds it (the same settings: torch threads, dtype, experts kernel,
    engine knobs). Built bare (an Engine over `load_model`, this process's default torch
    threads: every core), it ran under half the served row's rate on a loaded 2-core host: the
    tiny model's ops on two OpenMP threads wait on each other, where the replica computes on one.
    An earlier version ran all of vLLM's rounds, then all of ours: on a shared host whose load
    swings by minutes the two sides were timed under different loads."""
    import torch
    from engine_rates import engine_tps
    from transformers import AutoTokenizer

    from moeflow.serving.core import load_served
    from moeflow.serving.engine import Engine, EngineConfig

    peer = VllmOffline(model, batch, new, eager)  # first: its start-up is not timed beside ours
    before = torch.get_num_threads()
    torch.set_num_threads(settings.torch_threads)
    engine = Engine(load_served(settings, {}), AutoTokenizer.from_pretrained(settings.base_dir),
                    EngineConfig(**settings.engine))
    try:
        engine.warm_up()
        engine.start()
        engine_tps(engine, batch, new, True)  # warm-up
        time.sleep(SETTLE_S)

        def ours() -> tuple[float, float]:
            cpu = time.process_time()  # this process: the engine's thread and the submitting one
            rate = engine_tps(engine, batch, new, True)
            time.sleep(SETTLE_S)
            return rate, time.process_time() - cpu
        rounds = []
        for _ in range(repeat):
            (p, p_cpu), (o, o_cpu) = peer.round(), ours()
            rounds.append((p, o, p_cpu, o_cpu))
        return rounds
    finally:
        engine.stop()
        torch.set_num_threads(before)
        peer.close()


def served(settings, batch: list[list[int]], new: int, repeat: int) -> list[tuple]:
    """(vLLM tok/s, ours tok/s, vLLM CPU s, ours CPU s) of the same streamed round, alternating;
    the CPU of each side's processes on a request's path (vLLM: its server and engine core;
    ours: the Serve replica, its engine core and HAProxy -- not Ray's daemons and Serve's
    controller, which tick along beside either side's rounds; not the client, the same for
    both). Ours
    behind `moeflow serve`'s default ingress (an earlier version measured it behind Serve's
    Python proxy, which streams at about half HAProxy's rate: docs/serving.md)."""
    import httpx
    import ray
    from engine_rates import Client, http_tps, tree_cpu
    from ray import serve

    from moeflow.serving.app import build_app, free_port
    from moeflow.serving.ingress import ingress_environment

    eager = not settings.engine.get("compile")
    with contextlib.ExitStack() as stack:
        # first: its load is not ours
        peer, peer_pid = stack.enter_context(vllm_server(settings.base_dir, len(batch), eager,
                                                         settings.stream_interval))
        client = Client(len(batch) + 4)
        stack.callback(client.close)
        temp = tempfile.mkdtemp(prefix="/tmp/mfbench")
        # deploy.ingress auto, as `moeflow serve`: Ray reads it from the environment when it starts
        stack.enter_context(ingress_environment("auto", temp))
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=temp)
        stack.callback(ray.shutdown)
        stack.callback(serve.shutdown)
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(settings, max_ongoing_requests=4 * len(batch)), name="ours", route_prefix="/ours",
                  blocking=False)
        ours = f"http://127.0.0.1:{port}/ours"
        httpx.get(f"{ours}/v1/models", timeout=600).raise_for_status()
        http_tps(client, peer, batch, new), http_tps(client, ours, batch, new)  # warm-up
        time.sleep(SETTLE_S)
        path = request_path()

        def timed(url: str, cpu_of) -> tuple[float, float]:
            cpu = cpu_of()
            rate = http_tps(client, url, batch, new)
            time.sleep(SETTLE_S)
            return rate, cpu_of() - cpu
        rounds = []
        for _ in range(repeat):
            (p, p_cpu) = timed(peer, lambda: tree_cpu(peer_pid))
            (o, o_cpu) = timed(ours, lambda: sum(tree_cpu(pid) for pid in path))
            rounds.append((p, o, p_cpu, o_cpu))
        return rounds


def request_path() -> list[int]:
    """Pids of our served request path: the Serve replica (its engine core is its child) and
    HAProxy, found by the titles Ray and HAProxy run under (this run's Ray is the only one
    whose processes descend from this one)."""
    me, found = os.getpid(), []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        cmd = _cmdline(int(name))
        if ("ServeReplica:ours" in cmd or "haproxy -db" in cmd) and _descends(int(name), me):
            found.append(int(name))
    if not any("ServeReplica" in _cmdline(p) for p in found):
        raise RuntimeError("peer_vllm: our Serve replica's process was not found (its CPU is reported)")
    return found


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _descends(pid: int, ancestor: int) -> bool:
    while pid > 1:
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            return False
        if pid == ancestor:
            return True
    return False


def default_model(root: Path) -> str:
    from moeflow_testing.tiny import build_debug_model

    return str(build_debug_model("qwen3_moe", root / "tiny-moe-hd32", head_dim=32, dtype="float32"))


def run(args: argparse.Namespace) -> None:
    """Both rows per decode mode, printed as bench_engine prints its rows (ratio: ours / vLLM)."""
    from engine_rates import prompts

    from moeflow.model.params import load_config_json

    vllm_python()  # a clear line now, not after minutes of our rows
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or default_model(Path(tmp))
        cfg = load_config_json(model)
        batch = prompts(args.num_prompts, args.input_len, cfg["vocab_size"], 0)
        new = args.output_len
        for decode in args.decode:
            eager = decode == "eager"
            settings = our_settings(model, len(batch), args.threads, not eager, args.stream_interval)
            off = offline(settings, model, batch, new, args.repeat, eager)
            pairs = served(settings, batch, new, args.http_repeat)
            peer, ours = ("vLLM --enforce-eager", "moeflow eager") if eager else \
                ("vLLM compiled (its default)", "moeflow deploy.compile")
            for kind, what, got in (("offline", "LLM.generate vs Engine", off),
                                    ("served", "OpenAI server vs serve", pairs)):
                rows.append((f"{kind}, {decode}", f"{peer} vs {ours}: {what}", got))
                print(f"peer_vllm: {kind} {decode} rounds (vLLM, moeflow tok/s; CPU s): "
                      f"{[(round(p), round(o), round(pc, 2), round(oc, 2)) for p, o, pc, oc in got]}",
                      file=sys.stderr)
    print(f"\nmodel {model if args.model else 'tiny Qwen3-MoE, head_dim 32'}; {args.num_prompts} prompts x "
          f"{args.input_len} in x {new} out, float32, CPU; stream interval {args.stream_interval}")
    print("tok/s: medians of the rounds; ratio: median of ours / vLLM per alternated pair; CPU: median CPU "
          "seconds of each side's processes per round (ratio vLLM / ours: above 1, ours spends less)")
    print(f"{'scenario':18} {'what':78} {'vLLM':>7} {'moeflow':>7} {'ratio':>6} {'CPU s vLLM':>10} {'moeflow':>7} "
          f"{'ratio':>6}")
    for name, what, got in rows:
        med = [statistics.median(r[i] for r in got) for i in range(4)]
        ratio = statistics.median(o / p for p, o, _, _ in got)
        cpu_ratio = statistics.median(pc / oc for _, _, pc, oc in got if oc > 0) if any(r[3] > 0 for r in got) \
            else float("nan")
        print(f"{name:18} {what:78} {med[0]:7.1f} {med[1]:7.1f} {ratio:6.2f} {med[2]:10.3f} {med[3]:7.3f} "
              f"{cpu_ratio:6.2f}")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="model dir (default: a tiny Qwen3-MoE with head_dim 32)")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--http-repeat", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="moeflow's torch threads, both rows (a replica's default: 1)")
    p.add_argument("--decode", nargs="+", choices=["eager", "compiled"], default=["eager", "compiled"],
                   help="eager: vLLM --enforce-eager vs moeflow eager; compiled: vLLM's default (torch.compile) "
                        "vs moeflow deploy.compile")
    p.add_argument("--stream-interval", type=int, default=8,
                   help="tokens per streamed chunk after the first, both servers (moeflow's default 8, vLLM's 1)")
    p.add_argument("--eager", action="store_true", help=argparse.SUPPRESS)  # offline child
    p.add_argument("--offline-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--prompts-file", help=argparse.SUPPRESS)
    return p


if __name__ == "__main__":
    a = parser().parse_args()
    if a.offline_child:
        offline_child(a.model, a.prompts_file, a.output_len, a.eager)
    else:
        run(a)
