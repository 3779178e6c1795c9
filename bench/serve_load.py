"""The load and soak workloads of `bench_serve.py --workload mixed|soak` (the server as a subprocess,
`bench_serve.ServerProcess`, always stopped on exit).

mixed: fairness under load. Per admission policy (`--admission fair`, then `fifo`; one server each),
small requests (one prompt, n = 1, `--small-tokens` greedy tokens, streamed) are first sent one at a time
to the idle server, then from `--small-clients` closed-loop clients while `--big-requests` requests of
n = `--big-n` and `--big-tokens` tokens (ignore_eos) run. Reported per policy: p50 / p99 time to first
token and end-to-end latency of the small requests, idle and loaded, the ratio of loaded to idle p99
TTFT (the issue's target: within 3x under fair admission), and the big requests' end-to-end time.

soak: `--soak-requests` requests of random sizes (1-2 prompts, n 1-4, 1 to `--small-tokens` tokens,
greedy or T = 1, streamed or not) from `--small-clients` clients; a share (`--disconnect-rate`) of them
disconnect early; every `--update-every` seconds the weights switch between two checkpoints (A: the
target's own, B: A perturbed) through /update_weights_from_disk, versions 1, 2, ... (odd: B, even: A).
Checked: every request not disconnected got one answer with all its choices (indices 0..N-1 once) and
a unique id; the server counted every accepted request once (finished + aborted = accepted); every
greedy choice sampled under one version has exactly the tokens an in-process engine gives under that
version's weights (a choice an update landed in reports `weight_versions` and is counted, not
compared); RSS and thread count against requests completed (least-squares slope over the second half).
"""

from __future__ import annotations

import itertools
import json
import random
import threading
import time
from pathlib import Path

import httpx
import psutil
import torch
from bench_serve import ServerProcess, load_models, percentile, spec_for
from common import machine_note, print_json_line, print_table

from rollout_ssd import EngineConfig, RolloutEngine, SamplingParams


def _ms(x):
    return None if x is None else 1000.0 * x


def stream_small(url: str, prompt: list[int], tokens: int, timeout: float) -> dict:
    """One streamed greedy request: (send, first token, done) times and its token count."""
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "return_token_ids": True}
    epoch, send, first, count = time.time(), time.perf_counter(), None, 0
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=timeout) as resp:
        if resp.status_code != 200:
            resp.read()
            raise RuntimeError(f"small request: HTTP {resp.status_code}: {resp.text[:300]}")
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                new = sum(len(c.get("token_ids") or []) for c in json.loads(line[6:]).get("choices", []))
                if new and first is None:
                    first = time.perf_counter()
                count += new
    return {"t": epoch, "ttft": first - send, "e2e": time.perf_counter() - send, "tokens": count}


def _latency(records: list[dict]) -> dict:
    ttft, e2e = [r["ttft"] for r in records], [r["e2e"] for r in records]
    return {"requests": len(records), "ttft_p50_ms": _ms(percentile(ttft, 50)), "ttft_p99_ms": _ms(percentile(ttft, 99)),
            "e2e_p50_ms": _ms(percentile(e2e, 50)), "e2e_p99_ms": _ms(percentile(e2e, 99))}


def _loaded_phase(server, args, prompts) -> tuple[list[dict], list[float]]:
    """Big requests running, small clients meanwhile: (small records, big end-to-end seconds)."""
    big_times, errors = [], []

    def big(i: int):
        body = {"prompt": prompts[i % len(prompts)], "n": args.big_n, "max_tokens": args.big_tokens, "temperature": 1.0,
                "seed": i, "ignore_eos": True}
        t0 = time.perf_counter()
        resp = httpx.post(server.url + "/v1/completions", json=body, timeout=args.request_timeout)
        if resp.status_code != 200:
            errors.append(f"big request: HTTP {resp.status_code}: {resp.text[:300]}")
        big_times.append(time.perf_counter() - t0)

    bigs = [threading.Thread(target=big, args=(i,)) for i in range(args.big_requests)]
    for t in bigs:
        t.start()
    deadline = time.monotonic() + 120
    while server.metrics().get("vllm:num_requests_running", 0) < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    records, lock = [], threading.Lock()
    counter = itertools.count()

    def small_client():
        while any(t.is_alive() for t in bigs):
            g = next(counter)
            if g >= args.small_requests * args.small_clients:
                return
            rec = stream_small(server.url, prompts[g % len(prompts)], args.small_tokens, args.request_timeout)
            with lock:
                records.append(rec)

    smalls = [threading.Thread(target=small_client) for _ in range(args.small_clients)]
    for t in smalls:
        t.start()
    for t in smalls + bigs:
        t.join(args.phase_timeout)
    if errors:
        raise RuntimeError("; ".join(errors))
    return records, big_times


def mixed(args, tmp: Path) -> None:
    target_name, draft_name, target, _, prompts = load_models(args, args.method_list[:1], tmp)
    method = args.method_list[0]
    max_len = min(max(map(len, prompts)) + max(args.big_tokens, args.small_tokens) + 16,
                  target.model.cfg.max_position_embeddings)
    rows, results = [], {}
    trace = Path(args.trace) if args.trace else None
    if trace is not None:
        trace.mkdir(parents=True, exist_ok=True)
    for policy in ("fair", "fifo"):
        env = {}
        if trace is not None:
            (trace / f"{policy}_rounds.jsonl").unlink(missing_ok=True)
            env = {"ROLLOUT_SSD_ROUND_TRACE": str(trace / f"{policy}_rounds.jsonl")}
        server = ServerProcess(args, target_name, draft_name if method != "ar" else None, method, max_len,
                               extra=["--admission", policy, "--max-n", str(max(args.big_n, 1)),
                                      "--max-round-rows", str(args.max_round_rows)], env_extra=env)
        try:
            for p in prompts[:2]:  # warm-up
                stream_small(server.url, p, args.small_tokens, args.request_timeout)
            idle = [stream_small(server.url, prompts[i % len(prompts)], args.small_tokens, args.request_timeout)
                    for i in range(args.small_requests)]
            loaded, big_times = _loaded_phase(server, args, prompts)
        finally:
            server.stop()
        if trace is not None:
            with open(trace / f"{policy}_small.jsonl", "w") as f:
                for phase, recs in (("idle", idle), ("loaded", loaded)):
                    for rec in recs:
                        f.write(json.dumps({"phase": phase, **rec}) + "\n")
        res = {"idle": _latency(idle), "loaded": _latency(loaded), "big_e2e_s": big_times}
        idle99, loaded99 = res["idle"]["ttft_p99_ms"], res["loaded"]["ttft_p99_ms"]
        res["ttft_p99_ratio"] = loaded99 / idle99 if idle99 and loaded99 is not None else None
        results[policy] = res
        for phase in ("idle", "loaded"):
            rows.append({"admission": policy, "phase": phase, **res[phase],
                         "p99 ttft / idle": res["ttft_p99_ratio"] if phase == "loaded" else None,
                         "big e2e s": max(big_times) if phase == "loaded" and big_times else None})
    print(f"{'tiny pair' if args.tiny else args.model}, {method}; {args.big_requests} big requests of n={args.big_n} x "
          f"{args.big_tokens} tokens; small: {args.small_tokens} greedy tokens, {args.small_clients} clients; "
          f"max_batch_size={args.max_batch_size}, max_round_rows={args.max_round_rows or 'all'}, threads={args.threads}, "
          f"dtype={args.dtype}")
    print_table(rows)
    print_json_line({"bench": "serve-mixed", "machine": machine_note(), "model": "tiny" if args.tiny else args.model,
                     "method": method, "dtype": args.dtype, "big_requests": args.big_requests, "big_n": args.big_n,
                     "big_tokens": args.big_tokens, "small_tokens": args.small_tokens,
                     "small_clients": args.small_clients, "small_requests": args.small_requests,
                     "max_batch_size": args.max_batch_size, "max_round_rows": args.max_round_rows,
                     "threads": args.threads, "max_model_len": max_len,
                     "ttft_ratio_target": 3.0, "results": results})


# ---------------------------------------------------------------------------------------------- soak
def _checkpoints(target, tmp: Path) -> tuple[Path, Path, dict]:
    """Two checkpoint directories (A: the target's weights, B: A perturbed) and B's tensors."""
    from safetensors.torch import save_file

    a = {k: v.detach().clone().contiguous() for k, v in target.model.hf_parameters().items()}
    gen = torch.Generator().manual_seed(0)
    b = {k: (v + 0.02 * v.std().nan_to_num(0.0) * torch.randn(v.shape, generator=gen, dtype=v.dtype)).contiguous()
         for k, v in a.items()}
    dirs = (tmp / "ckpt_a", tmp / "ckpt_b")
    for d, state in zip(dirs, (a, b)):
        d.mkdir()
        save_file(state, str(d / "model.safetensors"))
    return dirs[0], dirs[1], b


def _references(args, target, draft, b_state, prompts, max_len) -> list[list[list[int]]]:
    """Greedy tokens of every prompt under A (index 0) and B (index 1), in process."""
    method = args.method_list[0]
    cfg = EngineConfig(max_batch_size=len(prompts), max_model_len=max_len)
    params = SamplingParams(temperature=0, max_new_tokens=args.small_tokens)
    with RolloutEngine(target, spec_for(args, method), cfg, draft=draft if method != "ar" else None) as engine:
        under_a = [r.token_ids for r in engine.sample(prompts, params)]
        engine.update_weights(b_state.items(), version=1)
        under_b = [r.token_ids for r in engine.sample(prompts, params)]
    return [under_a, under_b]


def _soak_request(url: str, args, g: int, prompts, rng: random.Random) -> dict:
    k = rng.choice([1, 1, 2])
    picks = [rng.randrange(len(prompts)) for _ in range(k)]
    body = {"prompt": [prompts[i] for i in picks], "n": rng.randint(1, 4), "max_tokens": rng.randint(1, args.small_tokens),
            "temperature": rng.choice([0, 1.0]), "seed": g, "stream": rng.random() < 0.5, "return_token_ids": True}
    rec = {"g": g, "picks": picks, "body": body, "disconnect": rng.random() < args.disconnect_rate}
    if rec["disconnect"]:
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=rng.uniform(0.01, 0.3)) as resp:
                rec["status"] = resp.status_code
                for _ in resp.iter_lines():
                    break  # leave after the first line
        except httpx.TimeoutException:
            rec["status"] = None
        return rec
    if body["stream"]:
        choices: dict = {}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=args.request_timeout) as resp:
            rec["status"] = resp.status_code
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    rec.setdefault("ids", set()).add(chunk["id"])
                    for c in chunk.get("choices", []):
                        got = choices.setdefault(c["index"], {"index": c["index"], "token_ids": []})
                        got["token_ids"] += c.get("token_ids") or []
                        got["finish_reason"] = c.get("finish_reason") or got.get("finish_reason")
                        got.update({k: c[k] for k in ("weight_version", "weight_versions") if k in c})
        rec["choices"] = list(choices.values())  # a choice's last chunk carries its weight_version
        return rec
    resp = httpx.post(url + "/v1/completions", json=body, timeout=args.request_timeout)
    rec["status"] = resp.status_code
    if resp.status_code == 200:
        data = resp.json()
        rec["ids"], rec["choices"] = {data["id"]}, data["choices"]
    return rec


def _check_soak(records: list[dict], refs, n_prompts_tokens: int) -> dict:
    out = {"sent": len(records), "disconnected": 0, "answered": 0, "incomplete": 0, "http_errors": 0,
           "duplicate_ids": 0, "greedy_checked": 0, "greedy_mismatch": 0, "spanning_updates": 0}
    seen_ids = set()
    for rec in records:
        if rec["disconnect"]:
            out["disconnected"] += 1
            continue
        if rec.get("status") != 200:
            out["http_errors"] += 1
            continue
        out["answered"] += 1
        ids = rec.get("ids", set())
        out["duplicate_ids"] += len(ids & seen_ids) + (len(ids) != 1)
        seen_ids |= ids
        n = rec["body"]["n"]
        choices = sorted(rec["choices"], key=lambda c: c["index"])
        if [c["index"] for c in choices] != list(range(len(rec["picks"]) * n)):
            out["incomplete"] += 1
            continue
        if rec["body"]["temperature"] != 0:
            continue
        for c in choices:
            if "weight_versions" in c:
                out["spanning_updates"] += 1
                continue
            ref = refs[c["weight_version"] % 2][rec["picks"][c["index"] // n]]
            out["greedy_checked"] += 1
            out["greedy_mismatch"] += c["token_ids"] != ref[:rec["body"]["max_tokens"]]
    return out


def _slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of y on x over the second half of the points (0 with fewer than 3)."""
    pts = points[len(points) // 2:]
    if len(pts) < 3:
        return 0.0
    mx, my = sum(x for x, _ in pts) / len(pts), sum(y for _, y in pts) / len(pts)
    var = sum((x - mx) ** 2 for x, _ in pts)
    return sum((x - mx) * (y - my) for x, y in pts) / var if var else 0.0


def _soak_threads(server, args, prompts, tmp_dirs, records: list, samples: list, updates: list):
    done, counter, lock = threading.Event(), itertools.count(), threading.Lock()
    proc = psutil.Process(server.proc.pid)

    def client(c: int):
        rng = random.Random(args.seed * 1000 + c)
        while (g := next(counter)) < args.soak_requests:
            rec = _soak_request(server.url, args, g, prompts, rng)
            with lock:
                records.append(rec)

    def updater():
        version = 0
        while not done.wait(args.update_every):
            version += 1
            resp = httpx.post(server.url + "/update_weights_from_disk", timeout=args.request_timeout,
                              json={"model_path": str(tmp_dirs[version % 2]), "weight_version": version})
            updates.append((time.perf_counter(), version, resp.status_code))

    def monitor():
        while not done.wait(0.5):
            samples.append((len(records), proc.memory_info().rss / 2 ** 20, proc.num_threads()))

    side = [threading.Thread(target=updater), threading.Thread(target=monitor)]
    clients = [threading.Thread(target=client, args=(c,)) for c in range(args.small_clients)]
    for t in side + clients:
        t.start()
    try:
        for t in clients:
            t.join(args.phase_timeout)
    finally:
        done.set()
        for t in side:
            t.join(60)


def soak(args, tmp: Path) -> None:
    target_name, draft_name, target, draft, prompts = load_models(args, args.method_list[:1], tmp)
    prompts = prompts[:16]
    method = args.method_list[0]
    max_len = min(2 * max(map(len, prompts)) + args.small_tokens + 16, target.model.cfg.max_position_embeddings)
    ckpt_a, ckpt_b, b_state = _checkpoints(target, tmp)
    refs = _references(args, target, draft, b_state, prompts, max_len)
    server = ServerProcess(args, target_name, draft_name if method != "ar" else None, method, max_len)
    records, samples, updates = [], [], []
    try:
        before = server.metrics()
        t0 = time.perf_counter()
        _soak_threads(server, args, prompts, (ckpt_a, ckpt_b), records, samples, updates)
        wall = time.perf_counter() - t0
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # disconnected requests end at the server's next round
            m = server.metrics()
            if m.get("vllm:num_requests_running", 0) == 0 and m.get("vllm:num_requests_waiting", 0) == 0:
                break
            time.sleep(0.2)
        time.sleep(1.0)  # handlers count their requests after the engine ends them
        after = server.metrics()
    finally:
        server.stop()

    def delta(outcome):
        key = f'rollout_ssd:requests_total{{outcome="{outcome}"}}'
        return after.get(key, 0.0) - before.get(key, 0.0)

    check = _check_soak(records, refs, len(prompts))
    accepted = sum(1 for r in records if r.get("status") == 200)
    unknown = sum(1 for r in records if r["disconnect"] and r.get("status") is None)  # left before the headers
    check.update({"server_finished": delta("finished"), "server_aborted": delta("aborted"),
                  "server_rejected": delta("rejected"), "accepted": accepted, "seconds": wall,
                  "updates": len(updates), "updates_failed": sum(1 for u in updates if u[2] != 200),
                  "rss_mib_first_last": [samples[0][1], samples[-1][1]] if samples else None,
                  "threads_min_max": [min(s[2] for s in samples), max(s[2] for s in samples)] if samples else None,
                  "rss_mib_per_1000_requests": 1000 * _slope([(s[0], s[1]) for s in samples]),
                  "threads_per_1000_requests": 1000 * _slope([(s[0], s[2]) for s in samples])})
    counted = check["server_finished"] + check["server_aborted"]
    # each accepted request is counted once (finished or aborted); one that left before the response's
    # headers may or may not have reached the engine
    check["counted_once"] = accepted <= counted <= accepted + unknown
    check["left_before_headers"] = unknown
    # flat: over the second half, under 8 MiB of RSS and 1 thread per 1,000 requests (judged from 1,000
    # requests on; a quick run's slopes are start-up noise)
    check["flat"] = check["rss_mib_per_1000_requests"] < 8 and check["threads_per_1000_requests"] < 1
    check["passed"] = bool(check["counted_once"] and not check["incomplete"] and not check["http_errors"]
                           and not check["duplicate_ids"] and not check["greedy_mismatch"] and not check["updates_failed"]
                           and (check["flat"] or args.soak_requests < 1000))
    print(f"{'tiny pair' if args.tiny else args.model}, {method}: soak of {args.soak_requests} requests, "
          f"{args.small_clients} clients, an update every {args.update_every:g} s, disconnect rate {args.disconnect_rate:g}")
    print_table([{k: v for k, v in check.items() if not isinstance(v, list)}])
    print_json_line({"bench": "serve-soak", "machine": machine_note(), "model": "tiny" if args.tiny else args.model,
                     "method": method, "requests": args.soak_requests, "clients": args.small_clients,
                     "update_every_s": args.update_every, "disconnect_rate": args.disconnect_rate,
                     "max_tokens": args.small_tokens, "max_batch_size": args.max_batch_size, "threads": args.threads,
                     "samples": samples[:: max(1, len(samples) // 50)], "result": check})
    if not check["passed"]:
        raise SystemExit(1)
