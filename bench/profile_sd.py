"""Where an SD round's time goes on the default pair (issue 3), next to an AR step, in one run.

Wall-clock timers around the target's and the draft's forwards (`ModelRunner.extend`, model + LM head)
split each SD round (batch 1, greedy, K drafted tokens) into: the target's verify forward, the draft's
forwards, and everything else (sampling, verification, bookkeeping). The AR run gives a decode step.
Then torch.profiler's self CPU time per aten op over target decode steps shows how much of a forward
is GEMM / GEMV and how much is the small per-layer ops. Run:

    .venv/bin/python bench/profile_sd.py            # 4 held-out prompts, 48 tokens, K=3, 2 threads, float32
    .venv/bin/python bench/profile_sd.py --dtype auto
    .venv/bin/python bench/profile_sd.py --dtype auto --draft target-int4 --k 4
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch
from common import (
    add_prompt_set_arg,
    add_repo_to_path,
    bench_prompts,
    load_default_pair,
    machine_note,
    print_json_line,
    print_table,
)

add_repo_to_path()

from rollout_ssd import EngineConfig, RolloutEngine, SamplingParams, SpecConfig  # noqa: E402
from rollout_ssd.runner import ModelRunner  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompts", type=int, default=4)
    add_prompt_set_arg(p)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--draft", default="default", help="default (the built-in), target-int4, or a checkpoint")
    p.add_argument("--op-steps", type=int, default=20, help="target decode steps under torch.profiler")
    p.add_argument("--dtype", default="float32", help="the pair's dtype (\"auto\": the engine's default)")
    p.add_argument("--quick", action="store_true", help="1 prompt, 12 tokens, 3 profiled steps")
    args = p.parse_args(argv)
    if args.quick:
        args.prompts, args.new_tokens, args.op_steps = 1, 12, 3
    return args


class ForwardTimer:
    """Seconds spent in ModelRunner.extend outside prefills, per model (by identity), and in prefills,
    while installed."""

    def __init__(self):
        self.seconds: dict[int, float] = defaultdict(float)
        self.calls: dict[int, int] = defaultdict(int)
        self.prefill_seconds = 0.0
        self._orig = (ModelRunner.extend, ModelRunner.prefill)
        self._in_prefill = False

    def __enter__(self):
        extend, prefill = self._orig
        timer = self

        def timed_extend(runner, *args, **kwargs):
            if timer._in_prefill:
                return extend(runner, *args, **kwargs)
            t0 = time.perf_counter()
            try:
                return extend(runner, *args, **kwargs)
            finally:
                timer.seconds[id(runner.model)] += time.perf_counter() - t0
                timer.calls[id(runner.model)] += 1

        def timed_prefill(runner, *args, **kwargs):
            t0, timer._in_prefill = time.perf_counter(), True
            try:
                return prefill(runner, *args, **kwargs)
            finally:
                timer._in_prefill = False
                timer.prefill_seconds += time.perf_counter() - t0

        ModelRunner.extend, ModelRunner.prefill = timed_extend, timed_prefill
        return self

    def __exit__(self, *exc):
        ModelRunner.extend, ModelRunner.prefill = self._orig


def run(engine, prompts, params):
    """(wall seconds, tokens, rounds, metrics) for the prompts one at a time."""
    engine.metrics(reset=True)
    t0 = time.perf_counter()
    tokens = sum(len(r.token_ids) for p in prompts for r in engine.sample([p], params))
    seconds = time.perf_counter() - t0
    m = engine.metrics()
    rounds = tokens / m.get("rollout/tokens_per_round", 1.0)
    return seconds, tokens, rounds, m


def op_profile(target, steps: int) -> list[dict]:
    """Self CPU ms per target decode step by aten op (top ops), over `steps` batch-1 steps."""
    from torch.profiler import ProfilerActivity, profile

    runner = ModelRunner(target, 1, 512)
    slot = runner.allocate()
    runner.prefill([slot], [[1] * 128])
    for _ in range(3):
        runner.decode([slot], [5])
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            runner.decode([slot], [5])
    rows = [(e.key, e.self_cpu_time_total / 1e3 / steps, e.count / steps) for e in prof.key_averages()]
    total = sum(r[1] for r in rows)
    rows.sort(key=lambda r: -r[1])
    out = [{"op": k, "ms/step": ms, "calls/step": n, "share": ms / total} for k, ms, n in rows[:12]]
    out.append({"op": "(all ops)", "ms/step": total, "calls/step": sum(r[2] for r in rows), "share": 1.0})
    return out


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    target, draft = load_default_pair(args.draft, dtype=args.dtype)
    prompts = bench_prompts(target.tokenizer, args.prompt_set, args.prompts)
    cfg = EngineConfig(max_batch_size=1, max_model_len=max(map(len, prompts)) + args.new_tokens + 8)
    params = SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens, ignore_eos=True, seed=0)
    ar = RolloutEngine(target, SpecConfig(method="ar"), cfg)
    sd = RolloutEngine(target, SpecConfig(method="sd", k=args.k, speculator="draft"), cfg, draft=draft)
    ar.sample(prompts[:1], params)  # warm-up (weight copies, allocator)
    sd.sample(prompts[:1], params)
    results = {}
    for name, engine in (("ar", ar), ("sd", sd)):
        with ForwardTimer() as timer:
            seconds, tokens, rounds, m = run(engine, prompts, params)
        results[name] = {"seconds": seconds, "tokens": tokens, "rounds": rounds, "metrics": m,
                         "target_s": timer.seconds[id(target.model)], "draft_s": timer.seconds[id(draft.model)],
                         "target_calls": timer.calls[id(target.model)], "prefill_s": timer.prefill_seconds}
    a, s = results["ar"], results["sd"]
    # prefills (one per prompt per model) are timed apart and left out of the per-round split
    step_ms = a["target_s"] / a["target_calls"] * 1e3
    s["seconds"] -= s["prefill_s"]
    per_round = {k: s[k] / s["rounds"] * 1e3 for k in ("target_s", "draft_s", "seconds")}
    other = per_round["seconds"] - per_round["target_s"] - per_round["draft_s"]
    table = [
        {"what": "AR decode step (target forward)", "ms": step_ms, "x AR step": 1.0},
        {"what": f"SD round, K={args.k}: total (no prefill)", "ms": per_round["seconds"],
         "x AR step": per_round["seconds"] / step_ms},
        {"what": "  target verify forward", "ms": per_round["target_s"], "x AR step": per_round["target_s"] / step_ms},
        {"what": "  draft forwards", "ms": per_round["draft_s"], "x AR step": per_round["draft_s"] / step_ms},
        {"what": "  everything else", "ms": other, "x AR step": other / step_ms},
    ]
    print(f"SD: {s['tokens'] / (s['seconds'] + s['prefill_s']):.2f} tok/s, AR: {a['tokens'] / a['seconds']:.2f} tok/s, "
          f"tokens/round {s['metrics'].get('rollout/tokens_per_round', 0):.2f}, "
          f"accept {s['metrics'].get('spec/accept_rate', 0):.3f}")
    print_table(table, floatfmt=".2f")
    ops = op_profile(target.model, args.op_steps)
    print()
    print_table(ops, floatfmt=".3f")
    print_json_line({"bench": "profile_sd", "args": vars(args), "machine": machine_note(),
                     "sd_tok_s": s["tokens"] / (s["seconds"] + s["prefill_s"]), "ar_tok_s": a["tokens"] / a["seconds"],
                     "round": table, "ops": ops, "sd_metrics": s["metrics"]})


if __name__ == "__main__":
    main()
