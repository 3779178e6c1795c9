"""`rollout-ssd serve` against the in-process engine: throughput and latency vs concurrent clients.

For each method (AR / SD / SSD, `--methods`) and each number of concurrent clients C (`--clients`,
default 1,4,16,64): C client threads each send R requests one after another (`--requests-per-client`),
a single prompt each, `max_tokens` fixed (`--max-tokens`), `ignore_eos` so every request generates
exactly that many tokens, at one temperature (`--temperature`, 0 or 1), seeded per request. Measured:

- tok/s: all generated tokens / wall time from the clients' common start to the last request's end;
- TTFT p50 / p99: from sending a request to its first token (server: the first SSE chunk carrying
  token ids, read by a streaming httpx client; engine: the first progress-listener call with a token);
- TPOT p50 / p99: per request, (time of its last token - time of its first) / (tokens - 1);
- overhead = 1 - server tok/s / engine tok/s at each C (the issue's target: < 5% at 16 clients).

The fair comparison. The engine side replays exactly what the server does with the same load: the
same C threads, the same R requests each in the same order (same prompt token ids, same seeds, same
SamplingParams), each request `engine.submit([prompt], params, listener=...)` then `.result()`, the
call the HTTP handler makes, so both sides run the same continuous-batching scheduler on the same
arrival pattern (a closed loop of C clients; a request joins the running batch at the next round).
One `sample` call per client thread would drive the loop inline from one caller and batch
differently; submitting all requests at once would be an offline batch, not what C clients do. The
difference measured is therefore only the serving layer: HTTP, JSON, SSE, asyncio, token rendering
(and the client's own parsing, which runs on the same 2 cores, as a co-located trainer's would).

Same conditions: the server and the in-process engine load the same weights (`--dtype float32` unless
`--dtype` says otherwise; the mixed workload's server takes `auto`, the engine's own pick), use
the same EngineConfig (`--max-batch-size`, default the largest C so no client waits for a slot;
max_model_len = longest prompt + max_tokens + 16) and the same torch thread count (`--threads`,
default 1; SSD's draft worker pins itself to the other core on both sides). Prompts are sent as token
ids (chat-template ids of `--prompt-set`, `common.bench_prompts`; `--tiny`: the arithmetic task's
prompts), so no tokenizer runs on either side. The two never generate at the same time: phases run
one after another, per C alternating which side goes first (and over `--repeats`), methods one after
another with one server process each; the idle side's CPU time during the other's phase is recorded
(`idle_cpu_s`, should be ~0). Both sides are warmed up first (`--warmup-clients` requests, unmeasured).
A greedy / seeded run should give both sides the same tokens (`same` = share of requests whose
tokens match; batch composition can flip float32 near-ties, so it is reported, not asserted).
Acceptance (`accept` = accepted / proposed draft tokens, from /metrics and engine.stats) shows both
sides speculated alike; `ssd rule` is what SSD's strategy rule ran (engine: batch rounds per strategy in
the phase; server: only its latest choice, all /metrics exports), since the rule times its own rounds
and may pick differently on the two sides.

The server is a subprocess (`python -m rollout_ssd.cli serve ... --port 0`) in its own session; it is
always terminated (SIGTERM, then SIGKILL of its process group) on exit, exception, Ctrl-C or SIGTERM.
Every loop is bounded in count and time (`--request-timeout`, `--phase-timeout`). Run:

    .venv/bin/python bench/bench_serve.py                      # default pair, C=1,4,16,64, AR/SD/SSD, T=0
    .venv/bin/python bench/bench_serve.py --temperature 1
    .venv/bin/python bench/bench_serve.py --tiny --clients 1,4 --requests-per-client 2 --max-tokens 8  # smoke
    .venv/bin/python bench/bench_serve.py --quick              # the same smoke run

`--workload mixed` (fairness: small requests' TTFT while n=64 requests run, admission fair vs fifo) and
`--workload soak` (2,000 random requests, disconnects, weight updates every few seconds; RSS and thread
slopes) are in serve_load.py, which describes them; each has a `--quick` smoke run:

    .venv/bin/python bench/bench_serve.py --workload mixed --methods sd
    .venv/bin/python bench/bench_serve.py --workload soak --methods sd --tiny
    .venv/bin/python bench/bench_serve.py --workload mixed --quick
    .venv/bin/python bench/bench_serve.py --workload soak --quick
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from common import (
    REPO_ROOT,
    add_prompt_set_arg,
    add_repo_to_path,
    bench_prompts,
    machine_note,
    print_json_line,
    print_table,
)

add_repo_to_path()

from rollout_ssd import EngineConfig, RolloutEngine, SamplingParams, SpecConfig  # noqa: E402

# this process's CPU set at start: the in-process SSD engine pins its creating thread to one core while
# it lives (its draft worker takes the other), and threads inherit that, so the HTTP client threads
# put it back (they are a separate process's clients, not the engine's)
FULL_AFFINITY = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
READY_PREFIX = "rollout-ssd serve: listening on "
_LIVE_SERVERS: list = []


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="= --tiny --clients 1,4 --requests-per-client 2 --max-tokens 8")
    p.add_argument("--tiny", action="store_true", help="the seeded tiny pair (rollout_ssd.rl.tiny): a seconds-long smoke run")
    p.add_argument("--model", default="smollm2-135m-instruct", help="target: built-in name or checkpoint dir")
    p.add_argument("--draft", default="default", help="draft of sd / ssd: 'default', 'target-int4' or a checkpoint dir")
    p.add_argument("--methods", default=None, help="default: ar,sd,ssd; --workload mixed / soak: sd")
    p.add_argument("--clients", default="1,4,16,64", help="numbers of concurrent clients")
    p.add_argument("--requests-per-client", type=int, default=4, help="R: requests each client sends in turn")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, choices=[0.0, 1.0])
    p.add_argument("--k", type=int, default=None, help="SpecConfig.k on both sides (default: SpecConfig's)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the server and of the engine")
    p.add_argument("--dtype", default=None,
                   help="the server's --dtype (default: float32 for the clients and soak workloads, whose in-process "
                        "side loads float32 weights; auto, the engine's own pick for the CPU, for mixed)")
    p.add_argument("--max-batch-size", type=int, default=None, help="KV slots on both sides (default: max clients)")
    p.add_argument("--repeats", type=int, default=1, help="server/engine phase pairs per C (order alternates)")
    p.add_argument("--warmup-clients", type=int, default=4, help="unmeasured requests (one per client) per side")
    p.add_argument("--no-logprobs", action="store_true", help="do not ask the server for logprobs=0")
    p.add_argument("--seed", type=int, default=0, help="request g (client i, request r: g = i*R + r) gets seed+g")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--phase-timeout", type=float, default=3600.0, help="seconds per phase (all clients)")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds for the server to listen")
    add_prompt_set_arg(p)
    _add_load_args(p)
    args = p.parse_args(argv)
    if args.quick and args.workload == "mixed":
        args.tiny, args.big_requests, args.big_n, args.big_tokens, args.small_requests = True, 2, 8, 48, 4
        args.max_batch_size = args.max_batch_size or 16
    elif args.quick and args.workload == "soak":
        args.tiny, args.soak_requests, args.update_every = True, 60, 1.0
        args.max_batch_size = args.max_batch_size or 16
    elif args.quick:
        args.tiny, args.clients, args.requests_per_client, args.max_tokens = True, "1,4", 2, 8
    if args.methods is None:
        args.methods = "ar,sd,ssd" if args.workload == "clients" else "sd"
    if args.dtype is None:
        args.dtype = "auto" if args.workload == "mixed" else "float32"
    args.client_counts = [int(c) for c in args.clients.split(",")]
    args.method_list = [m.strip() for m in args.methods.split(",")]
    for m in args.method_list:
        if m not in ("ar", "sd", "ssd"):
            p.error(f"--methods: unknown method {m!r}")
    if min(args.client_counts) < 1 or args.requests_per_client < 1 or args.max_tokens < 1 or args.repeats < 1:
        p.error("--clients, --requests-per-client, --max-tokens and --repeats must be >= 1")
    if max(args.client_counts) > 256:
        p.error("--clients: at most 256 concurrent clients (one thread each)")
    args.max_batch_size = args.max_batch_size or max(args.client_counts)
    return args


# ---------------------------------------------------------------------------------------------- stats
def _add_load_args(p) -> None:
    g = p.add_argument_group("--workload mixed / soak (serve_load.py)")
    g.add_argument("--workload", default="clients", choices=["clients", "mixed", "soak"],
                   help="clients: throughput and latency vs concurrent clients (above); mixed: fairness; soak")
    g.add_argument("--big-requests", type=int, default=2, help="mixed: big requests running at once")
    g.add_argument("--max-round-rows", type=int, default=0,
                   help="mixed: the servers' --max-round-rows (0: every running sequence steps every round)")
    g.add_argument("--big-n", type=int, default=64, help="mixed: n of each big request")
    g.add_argument("--big-tokens", type=int, default=256, help="mixed: tokens of each big sequence")
    g.add_argument("--small-tokens", type=int, default=16, help="mixed: tokens of a small request; soak: the most")
    g.add_argument("--small-clients", type=int, default=4, help="mixed / soak: concurrent clients of small requests")
    g.add_argument("--trace", default=None, metavar="DIR",
                   help="mixed: write the server's per-round trace ($ROLLOUT_SSD_ROUND_TRACE) and the small requests' "
                        "records (epoch seconds) to DIR/<admission>_rounds.jsonl and _small.jsonl "
                        "(bench/probes/serve_trace.py reads them)")
    g.add_argument("--small-requests", type=int, default=25,
                   help="mixed: small requests sent idle, and the most per client while the big ones run")
    g.add_argument("--soak-requests", type=int, default=2000, help="soak: requests in all")
    g.add_argument("--update-every", type=float, default=3.0, help="soak: seconds between weight updates")
    g.add_argument("--disconnect-rate", type=float, default=0.1, help="soak: share of requests that disconnect early")


def percentile(xs, q: float):
    """Linear-interpolated q-th percentile (q in [0, 100]); None for no data."""
    xs = sorted(xs)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(records: list[dict], wall: float) -> dict:
    tokens = sum(r["n"] for r in records)
    ttft = [r["first"] - r["send"] for r in records]
    tpot = [(r["last"] - r["first"]) / (r["n"] - 1) for r in records if r["n"] > 1]
    e2e = [r["done"] - r["send"] for r in records]
    ms = lambda v: None if v is None else 1000.0 * v  # noqa: E731
    return {"requests": len(records), "tokens": tokens, "seconds": wall, "tok_s": tokens / wall if wall > 0 else None,
            "ttft_p50_ms": ms(percentile(ttft, 50)), "ttft_p99_ms": ms(percentile(ttft, 99)),
            "tpot_p50_ms": ms(percentile(tpot, 50)), "tpot_p99_ms": ms(percentile(tpot, 99)),
            "e2e_p50_ms": ms(percentile(e2e, 50))}


def process_cpu_seconds(procs) -> float:
    import psutil

    total = 0.0
    for proc in procs:
        try:
            t = proc.cpu_times()
            total += t.user + t.system
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return total


def family(pid: int, include_self: bool):
    """psutil processes of pid (if include_self) and all its descendants."""
    import psutil

    try:
        root = psutil.Process(pid)
        return ([root] if include_self else []) + root.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


# ---------------------------------------------------------------------------------------------- server
class ServerProcess:
    """`rollout-ssd serve` in its own session; `stop()` (idempotent, also at exit) ends it and its children."""

    def __init__(self, args, target: str, draft, method: str, max_model_len: int, extra=(), env_extra=None):
        cmd = [sys.executable, "-m", "rollout_ssd.cli", "serve", "--target", target, "--method", method,
               "--dtype", args.dtype, "--port", "0", "--host", "127.0.0.1", "--max-batch-size", str(args.max_batch_size),
               "--max-model-len", str(max_model_len), "--threads", str(args.threads)]
        if draft is not None:
            cmd += ["--draft", draft]
        if args.k is not None:
            cmd += ["--k", str(args.k)]
        cmd += list(extra)
        self.cmd = cmd
        env = dict(os.environ)
        env["PYTHONPATH"] = str(REPO_ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env.update(env_extra or {})
        self.log: deque = deque(maxlen=200)
        self._ready: queue.Queue = queue.Queue()
        self.proc = subprocess.Popen(cmd, cwd=str(REPO_ROOT), env=env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1,
                                     start_new_session=True)
        _LIVE_SERVERS.append(self)
        if FULL_AFFINITY is not None:  # never let it inherit a pinned CPU set
            try:
                os.sched_setaffinity(self.proc.pid, FULL_AFFINITY)
            except OSError:
                pass
        for stream, name in ((self.proc.stdout, "out"), (self.proc.stderr, "err")):
            threading.Thread(target=self._drain, args=(stream, name), daemon=True).start()
        self.url = self._wait_ready(args.startup_timeout)

    def _drain(self, stream, name: str) -> None:
        for line in stream:  # ends when the process closes the pipe
            line = line.rstrip("\n")
            self.log.append(f"[{name}] {line}")
            if name == "out" and line.startswith(READY_PREFIX):
                self._ready.put(line[len(READY_PREFIX):].strip())

    def _wait_ready(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                url = self._ready.get(timeout=0.5)
                break
            except queue.Empty:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"the server exited with {self.proc.returncode} before listening:\n"
                                       + self.tail()) from None
        else:
            raise TimeoutError(f"the server did not listen within {timeout} s:\n" + self.tail())
        import httpx

        for _ in range(50):  # bounded: 50 tries, 0.2 s apart
            try:
                if httpx.get(url + "/health", timeout=5.0).status_code == 200:
                    return url
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{url}/health never answered 200:\n" + self.tail())

    def tail(self, lines: int = 30) -> str:
        return "\n".join(list(self.log)[-lines:])

    def cpu_seconds(self) -> float:
        return process_cpu_seconds(family(self.proc.pid, include_self=True))

    def metrics(self) -> dict:
        """The server's /metrics samples, name -> value (labelled samples keep their labels in the name)."""
        import httpx

        out = {}
        text = httpx.get(self.url + "/metrics", timeout=30.0).text
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                try:
                    out[name] = float(value)
                except ValueError:
                    pass
        return out

    def stop(self) -> None:
        if self in _LIVE_SERVERS:
            _LIVE_SERVERS.remove(self)
        proc = self.proc
        if proc.poll() is None:
            try:
                proc.send_signal(signal.SIGTERM)  # uvicorn shuts down gracefully, closing the engine and its worker
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                pass
            except ProcessLookupError:
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of its session (an SSD draft worker)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def _stop_all_servers() -> None:
    for server in list(_LIVE_SERVERS):
        server.stop()


atexit.register(_stop_all_servers)


def server_counters(server: ServerProcess) -> tuple[float, float, dict]:
    """(draft tokens proposed, accepted, {the SSD rule's latest choice: 1}) from /metrics (the server
    exports only the latest choice, not rounds per strategy)."""
    m = server.metrics()

    def get(base):
        return m.get(base + "_total", m.get(base, 0.0))

    strategy = {}
    for name in m:
        found = re.match(r'rollout_ssd:strategy_info\{.*strategy="([^"]*)"', name)
        if found:
            strategy = {f"latest:{found.group(1)}": 1}
    return get("vllm:spec_decode_num_draft_tokens"), get("vllm:spec_decode_num_accepted_tokens"), strategy


# ---------------------------------------------------------------------------------------------- clients
class HTTPClient:
    """One client: its own keep-alive connection, streaming /v1/completions requests."""

    def __init__(self, url: str, args, deadline: float):
        import httpx

        self.http = httpx.Client(base_url=url, timeout=httpx.Timeout(args.request_timeout, connect=10.0))
        self.args, self.deadline = args, deadline
        self.max_lines = 4 * args.max_tokens + 64  # events <= tokens + 2, each a data line and a blank line

    def send(self, prompt: list[int], seed: int) -> dict:
        a = self.args
        body = {"prompt": prompt, "n": 1, "max_tokens": a.max_tokens, "temperature": a.temperature, "seed": seed,
                "ignore_eos": True, "stream": True, "return_token_ids": True}
        if not a.no_logprobs:
            body["logprobs"] = 0
        ids, first, last, finish, lines = [], None, None, None, 0
        send = time.perf_counter()
        with self.http.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                resp.read()
                raise RuntimeError(f"HTTP {resp.status_code} for {body | {'prompt': '...'}}: {resp.text[:500]}")
            for line in resp.iter_lines():
                lines += 1
                if lines > self.max_lines or time.perf_counter() > self.deadline:
                    raise RuntimeError(f"stream too long ({lines} lines) or past the phase deadline")
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    raise RuntimeError(f"server error in stream: {chunk['error']}")
                for choice in chunk.get("choices", []):
                    new = choice.get("token_ids") or []
                    if new:
                        now = time.perf_counter()
                        first = now if first is None else first
                        last = now
                        ids.extend(new)
                    finish = choice.get("finish_reason") or finish
        done = time.perf_counter()
        return {"send": send, "first": first, "last": last, "done": done, "n": len(ids), "ids": ids, "finish": finish}

    def close(self) -> None:
        self.http.close()


class _Progress:
    """Listener of one engine request: when its first token and its last one arrived (driver thread)."""

    def __init__(self):
        self.first = self.last = None
        self.tokens = 0

    def __call__(self, request, finished: bool) -> None:
        n = request.num_tokens
        if n > self.tokens:
            now = time.perf_counter()
            self.first = now if self.first is None else self.first
            self.last, self.tokens = now, n


class EngineClient:
    """One client of the in-process engine: `submit` + `result`, the HTTP handler's own call."""

    def __init__(self, engine: RolloutEngine, args, deadline: float):
        self.engine, self.args, self.deadline = engine, args, deadline

    def send(self, prompt: list[int], seed: int) -> dict:
        a = self.args
        params = SamplingParams(n=1, temperature=a.temperature, max_new_tokens=a.max_tokens, seed=seed, ignore_eos=True)
        progress = _Progress()
        send = time.perf_counter()
        request = self.engine.submit([prompt], params, listener=progress)
        timeout = max(0.1, min(a.request_timeout, self.deadline - time.perf_counter()))
        try:
            rollout = request.result(timeout=timeout)[0]
        except TimeoutError:
            request.cancel()
            raise
        done = time.perf_counter()
        return {"send": send, "first": progress.first, "last": progress.last, "done": done,
                "n": len(rollout.token_ids), "ids": list(rollout.token_ids), "finish": rollout.finish_reason}

    def close(self) -> None:
        pass


def run_phase(make_client, clients: int, per_client: int, prompts: list[list[int]], args, http: bool):
    """`clients` threads, each sending `per_client` requests in turn; (records keyed by g, wall seconds)."""
    deadline = time.perf_counter() + args.phase_timeout
    barrier = threading.Barrier(clients + 1, timeout=120.0)
    stop = threading.Event()

    def client(i: int) -> list:
        if http and FULL_AFFINITY is not None:
            os.sched_setaffinity(0, FULL_AFFINITY)  # this thread only (Linux)
        c = make_client(deadline)
        try:
            barrier.wait()
            out = []
            for r in range(per_client):
                if stop.is_set() or time.perf_counter() > deadline:
                    raise TimeoutError("phase stopped or past its deadline")
                g = i * per_client + r
                rec = c.send(prompts[g % len(prompts)], args.seed + g)
                if rec["n"] != args.max_tokens or rec["first"] is None:
                    raise RuntimeError(f"request {g}: {rec['n']} tokens (finish {rec['finish']!r}), "
                                       f"expected {args.max_tokens} with ignore_eos")
                rec["g"] = g
                out.append(rec)
            return out
        finally:
            c.close()

    pool = ThreadPoolExecutor(max_workers=clients, thread_name_prefix="bench-client")
    try:
        futures = [pool.submit(client, i) for i in range(clients)]
        barrier.wait()
        t0 = time.perf_counter()
        records = []
        for f in futures:
            records += f.result(timeout=max(1.0, deadline - time.perf_counter()))
    except BaseException:
        stop.set()
        barrier.abort()
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown(wait=True)
    wall = max(r["done"] for r in records) - t0
    return {r["g"]: r for r in records}, wall


# ---------------------------------------------------------------------------------------------- setup
def load_models(args, methods, tmp: Path):
    """(target path/name, draft path/name or None, target LoadedModel, draft LoadedModel or None, prompts)."""
    from rollout_ssd.models.loader import load_draft, load_pretrained
    from rollout_ssd.models.registry import resolve_draft

    needed = max(args.client_counts) * args.requests_per_client
    if args.tiny:
        from rollout_ssd.rl.tasks import ALPHABET, arithmetic_dataset
        from rollout_ssd.rl.tiny import build_tiny_pair

        target_dir, draft_dir = build_tiny_pair(tmp / "tiny", ALPHABET)
        target_name, draft_name = str(target_dir), str(draft_dir)
    else:
        target_name = args.model
        draft_name = resolve_draft(args.draft, args.model) if any(m != "ar" for m in methods) else None
    target = load_pretrained(target_name, dtype=args.dtype)  # the server's dtype: both sides run the same weights
    draft = None
    if any(m != "ar" for m in methods):
        draft = load_draft(draft_name, target, target_name, dtype=args.dtype)
    if args.tiny:
        texts = arithmetic_dataset(min(needed, 256), seed=0)["prompt"]
        prompts = [list(target.tokenizer(t).input_ids) for t in texts]
    else:
        count = min(needed, 100 if args.prompt_set == "unseen" else 256)
        prompts = bench_prompts(target.tokenizer, args.prompt_set, count)
    return target_name, draft_name, target, draft, prompts


def spec_for(args, method: str) -> SpecConfig:
    return SpecConfig(method=method, **({} if args.k is None else {"k": args.k}))


def engine_counters(engine: RolloutEngine) -> tuple[float, float, dict]:
    """(draft tokens proposed, accepted, SSD batch rounds per strategy so far)."""
    return float(engine.stats.proposed), float(engine.stats.accepted), dict(engine.stats.ssd_strategy_rounds)


def strategy_delta(before: dict, after: dict) -> dict:
    if any(k.startswith("latest:") for k in after):
        return after
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)

    def on_signal(signum, _frame):
        raise SystemExit(128 + signum)  # unwinds through the finally blocks that stop the server

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal)
    if args.workload != "clients":
        import serve_load

        with tempfile.TemporaryDirectory(prefix="bench_serve_") as tmp:
            (serve_load.mixed if args.workload == "mixed" else serve_load.soak)(args, Path(tmp))
        return

    rows, pairs = [], []
    with tempfile.TemporaryDirectory(prefix="bench_serve_") as tmp:
        target_name, draft_name, target, draft, prompts = load_models(args, args.method_list, Path(tmp))
        max_len = max(map(len, prompts)) + args.max_tokens + 16
        max_len = min(max_len, target.model.cfg.max_position_embeddings)
        cfg = EngineConfig(max_batch_size=args.max_batch_size, max_model_len=max_len)
        note = None
        for method in args.method_list:
            server = engine = None
            try:
                # the server first, so that it never inherits the CPU set an in-process SSD engine pins
                server = ServerProcess(args, target_name, draft_name if method != "ar" else None, method, max_len)
                engine = RolloutEngine(target, spec_for(args, method), cfg, draft=draft if method != "ar" else None)
                own_pid = os.getpid()
                sides = {
                    "server": (lambda d, s=server: HTTPClient(s.url, args, d), True),
                    "engine": (lambda d, e=engine: EngineClient(e, args, d), False),
                }
                if args.warmup_clients > 0:
                    for make, http in sides.values():
                        run_phase(make, args.warmup_clients, 1, prompts[::-1], args, http)
                for ci, clients in enumerate(args.client_counts):
                    results = {"server": [], "engine": []}
                    for rep in range(args.repeats):
                        order = ("server", "engine") if (ci + rep) % 2 == 0 else ("engine", "server")
                        for side in order:
                            make, http = sides[side]
                            if side == "server":
                                theirs = {p.pid for p in family(server.proc.pid, include_self=True)}
                                other = [p for p in family(own_pid, include_self=False) if p.pid not in theirs]
                                before = server_counters(server)
                            else:
                                other = family(server.proc.pid, include_self=True)
                                before = engine_counters(engine)
                            idle0 = process_cpu_seconds(other)
                            records, wall = run_phase(make, clients, args.requests_per_client, prompts, args, http)
                            idle = process_cpu_seconds(other) - idle0
                            after = server_counters(server) if side == "server" else engine_counters(engine)
                            proposed, accepted = after[0] - before[0], after[1] - before[1]
                            results[side].append((records, wall, idle, proposed, accepted,
                                                  strategy_delta(before[2], after[2])))
                    pair = {"method": method, "clients": clients}
                    for side in ("server", "engine"):
                        runs = results[side]
                        recs = [r for records, *_ in runs for r in records.values()]
                        wall = sum(w for _, w, *_ in runs)
                        s = summarize(recs, wall)
                        s["tok_s_runs"] = [sum(r["n"] for r in rec.values()) / w for rec, w, *_ in runs]
                        proposed = sum(x[3] for x in runs)
                        s["accept"] = sum(x[4] for x in runs) / proposed if proposed else None
                        s["idle_cpu_s"] = sum(x[2] for x in runs)
                        s["strategy"] = {}
                        for x in runs:
                            for k, v in x[5].items():
                                s["strategy"][k] = v if k.startswith("latest:") else s["strategy"].get(k, 0) + v
                        pair[side] = s
                    same = [results["server"][i][0][g]["ids"] == results["engine"][i][0][g]["ids"]
                            for i in range(args.repeats) for g in results["server"][i][0]]
                    pair["same"] = sum(same) / len(same)
                    srv, eng = pair["server"]["tok_s"], pair["engine"]["tok_s"]
                    pair["overhead"] = 1.0 - srv / eng if srv and eng else None
                    pairs.append(pair)
                    for side in ("server", "engine"):
                        s = pair[side]
                        rows.append({"method": method, "clients": clients, "side": side, "tok/s": s["tok_s"],
                                     "ttft p50 ms": s["ttft_p50_ms"], "ttft p99 ms": s["ttft_p99_ms"],
                                     "tpot p50 ms": s["tpot_p50_ms"], "tpot p99 ms": s["tpot_p99_ms"],
                                     "e2e p50 ms": s["e2e_p50_ms"], "accept": s["accept"],
                                     "idle cpu s": s["idle_cpu_s"],
                                     "ssd rule": ",".join(f"{k}={v}" for k, v in s["strategy"].items()) or None,
                                     "overhead": pair["overhead"] if side == "server" else None,
                                     "same": pair["same"] if side == "server" else None})
            except BaseException:
                if server is not None:
                    print(f"--- server log tail ({method}):\n{server.tail()}", file=sys.stderr)
                raise
            finally:
                if server is not None:
                    server.stop()
                if engine is not None:
                    engine.close()  # restores this process's CPU set and threads after SSD
            if note is None:
                note = machine_note()  # after the engine closed, so `threads` is --threads again

    print(f"{'tiny pair' if args.tiny else args.model}; R={args.requests_per_client} requests/client, "
          f"max_tokens={args.max_tokens}, T={args.temperature:g}, threads={args.threads}, "
          f"max_batch_size={args.max_batch_size}, repeats={args.repeats}")
    print_table(rows)
    print()
    summary_rows = [{"method": p["method"], "clients": p["clients"], "server tok/s": p["server"]["tok_s"],
                     "engine tok/s": p["engine"]["tok_s"],
                     "overhead %": None if p["overhead"] is None else 100.0 * p["overhead"],
                     "ttft p50 ms +": _diff(p, "ttft_p50_ms"), "tpot p50 ms +": _diff(p, "tpot_p50_ms")}
                    for p in pairs]
    print_table(summary_rows)
    at16 = {p["method"]: p["overhead"] for p in pairs if p["clients"] == 16}
    if at16:
        print("overhead at 16 clients (target < 5%): " + ", ".join(
            f"{m} {100 * o:.1f}% {'ok' if o < 0.05 else 'OVER'}" for m, o in at16.items() if o is not None))
    print_json_line({"bench": "serve", "machine": note or machine_note(), "model": "tiny" if args.tiny else args.model,
                     "draft": None if args.tiny else args.draft, "prompt_set": None if args.tiny else args.prompt_set,
                     "methods": args.method_list, "clients": args.client_counts,
                     "requests_per_client": args.requests_per_client, "max_tokens": args.max_tokens,
                     "temperature": args.temperature, "k": args.k, "threads": args.threads,
                     "max_batch_size": args.max_batch_size, "max_model_len": max_len, "repeats": args.repeats,
                     "logprobs": not args.no_logprobs,
                     "overhead_at_16": at16, "overhead_target": 0.05,
                     "pairs": pairs, "rows": rows})


def _diff(pair: dict, key: str):
    a, b = pair["server"][key], pair["engine"][key]
    return None if a is None or b is None else a - b


if __name__ == "__main__":
    main()
