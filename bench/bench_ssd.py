"""AR vs SD vs SSD on the default pair (issue 4), one run, side by side.

For each batch size and temperature: tokens/s of AR, SD (neural draft) and SSD (draft worker on its
own core, Theorem 12 fan-out, neural backup, strategy rule on), SSD's hit rate, acceptance, T_p, the
strategy the rule chose, and Theorem 7's predicted speedup (from the engine's live estimates) next
to the measured SSD/AR ratio. Greedy runs also check that SD and SSD tokens equal AR's. The three
engines run in turn, `--repeats` times over, and each one's tok/s is over all its runs (machine noise
and drift hit all three alike; the SSD engine keeps its live estimates from run to run, as it does
across RL steps). Batch 1 runs `--batch1-prompts` prompts one at a time. tok/s is decode tok/s
(rollout/decode_tokens_per_s: prefill time and its first token left out, the part Theorem 7 predicts);
the e2e columns are the same ratios over wall time with the prefill.

Two more parts at batch 1, T=1, SSD forced (rule off) so each setting is measured as itself, each
next to an SD run on the same prompts just before it:
"fanout" sweeps the speculation cache budget B (Theorem 12's allocation at each B, plus a flat
manual fan-out) and reports the hit rate against it with the fitted power-law exponent r; "C"
sweeps the Saguaro constant (and "adaptive") and reports hit rate, acceptance and tok/s: the
trade-off curve.

    .venv/bin/python bench/bench_ssd.py            # batches 1,4,16,32; greedy and T=1; fanout and C parts
    .venv/bin/python bench/bench_ssd.py --quick    # batch 1, greedy, short

Prompts: `--prompt-set templates` (default: held-out templates) or `unseen` (unseen prompts of the
draft's training templates), as in bench_sd.py.
"""

from __future__ import annotations

import argparse
import time

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


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--batches", default="1,4,16,32")
    p.add_argument("--temperatures", default="0,1")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--draft", default="default", help="default (the built-in draft), target-int4, or a checkpoint")
    p.add_argument("--dtype", default="float32", help='the pair\'s dtype ("auto": the engine\'s default)')
    p.add_argument("--threads", type=int, default=1,
                   help="intra-op threads (0: torch's default, all cores: what AR and SD get with engine defaults)")
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--parts", default="main,fanout,C", help="comma list of main, fanout, C")
    p.add_argument("--budgets", default="4,8,16,32", help="fanout part: cache budgets B")
    p.add_argument("--cs", default="1.0,0.8,0.6,0.4,adaptive", help="C part: Saguaro constants")
    p.add_argument("--sweep-prompts", type=int, default=4, help="fanout/C parts: prompts, run one at a time")
    p.add_argument("--batch1-prompts", type=int, default=4,
                   help="main part, batch 1: prompts, run one at a time through each engine")
    p.add_argument("--repeats", type=int, default=2,
                   help="main part: AR, SD, SSD runs interleaved this many times (engines kept: the rule's "
                        "estimates carry over, as across RL steps); tok/s over all of them")
    add_prompt_set_arg(p)
    args = p.parse_args(argv)
    if args.quick:
        args.batches, args.temperatures, args.new_tokens, args.parts = "1", "0", 32, "main"
        args.repeats, args.batch1_prompts = 1, 2
    return args


def run(engine, prompts, temperature, new_tokens, one_at_a_time=False):
    """(token ids per prompt, tokens, seconds) of one sample() call, or one per prompt."""
    params = SamplingParams(temperature=temperature, max_new_tokens=new_tokens, ignore_eos=True, seed=0)
    t0 = time.perf_counter()
    if one_at_a_time:
        out = [engine.sample([p], params)[0] for p in prompts]
    else:
        out = engine.sample(prompts, params)
    seconds = time.perf_counter() - t0
    return [r.token_ids for r in out], sum(len(r.token_ids) for r in out), seconds


def run_interleaved(engines, prompts, temperature, new_tokens, repeats, one_at_a_time):
    """Each engine in turn, `repeats` times over (so machine noise hits all alike): per engine the token
    ids of its first run, tok/s over all its runs, and its metrics over all of them."""
    totals = {name: [None, 0, 0.0] for name in engines}
    for engine in engines.values():
        engine.metrics(reset=True)
    for _ in range(repeats):
        for name, engine in engines.items():
            ids, tokens, seconds = run(engine, prompts, temperature, new_tokens, one_at_a_time)
            t = totals[name]
            t[0] = ids if t[0] is None else t[0]
            t[1] += tokens
            t[2] += seconds
    return {name: (t[0], t[1] / t[2], engines[name].metrics()) for name, t in totals.items()}


def batch1_rate(engine, prompts, new_tokens):
    """Decode tok/s and metrics of `engine` on `prompts` one at a time at T=1."""
    engine.metrics(reset=True)
    run(engine, prompts, 1.0, new_tokens, one_at_a_time=True)
    m = engine.metrics()
    return m["rollout/decode_tokens_per_s"], m


def sweep_row(part, setting, cfg_kwargs, target, draft, prompts, args, sd_engine):
    """One SSD setting (rule off) and, right before it, SD on the same prompts: SSD/SD is against the
    adjacent SD run, so slow drifts of the machine's speed cancel."""
    sd_rate, _ = batch1_rate(sd_engine, prompts, args.new_tokens)
    spec = SpecConfig(method="ssd", k=args.k, strategy_rule=False, **cfg_kwargs)
    cfg = EngineConfig(max_batch_size=1, max_model_len=max(map(len, prompts)) + args.new_tokens + 8)
    with RolloutEngine(target, spec, cfg, draft=draft) as engine:
        rate, m = batch1_rate(engine, prompts, args.new_tokens)
    return {"part": part, "setting": setting, "tok/s": rate, "SD tok/s": sd_rate, "SSD/SD": rate / sd_rate,
            "hit": m.get("ssd/hit_rate"), "hit warm": m.get("ssd/hit_rate_warm"), "accept": m.get("spec/accept_rate"),
            "fanout": m.get("ssd/fanout"), "r": m.get("ssd/r_estimate"),
            "pred miss": m.get("ssd/predicted_miss_rate"), "T_p": m.get("ssd/T_p")}


def sweeps(target, draft, args):
    """The fanout and C parts (batch 1, T=1, SSD forced), each next to an SD run on the same prompts."""
    parts = set(args.parts.split(","))
    prompts = bench_prompts(target.tokenizer, args.prompt_set, args.sweep_prompts)
    cfg = EngineConfig(max_batch_size=1, max_model_len=max(map(len, prompts)) + args.new_tokens + 8)
    sd = RolloutEngine(target, SpecConfig(method="sd", k=args.k), cfg, draft=draft)
    rows = []
    if "fanout" in parts:
        for b in (int(x) for x in args.budgets.split(",")):
            rows.append(sweep_row("fanout", f"Thm12 B={b}", {"budget": b}, target, draft, prompts, args, sd))
        flat = 2
        rows.append(sweep_row("fanout", f"flat F={flat}", {"fanout": (flat,) * (args.k + 1)}, target, draft,
                              prompts, args, sd))
    if "C" in parts:
        for c in args.cs.split(","):
            value = c if c == "adaptive" else float(c)
            rows.append(sweep_row("C", f"C={c}", {"C": value}, target, draft, prompts, args, sd))
    return rows


def main(argv=None):
    args = parse_args(argv)
    if args.threads:  # default 1: SSD pins target and draft to one core each, AR and SD get one core too
        torch.set_num_threads(args.threads)
    target, draft = load_default_pair(args.draft, dtype=args.dtype)
    batches = [int(b) for b in args.batches.split(",")]
    temps = [float(t) for t in args.temperatures.split(",")] if "main" in args.parts.split(",") else []
    all_prompts = bench_prompts(target.tokenizer, args.prompt_set, max(batches + [args.batch1_prompts]))
    rows = []
    for temp in temps:
        for batch in batches:
            prompts = all_prompts[:args.batch1_prompts] if batch == 1 else all_prompts[:batch]
            cfg = EngineConfig(max_batch_size=batch, max_model_len=max(map(len, prompts)) + args.new_tokens + 8)
            with RolloutEngine(target, SpecConfig(method="ssd", k=args.k), cfg, draft=draft) as ssd_engine:
                engines = {"ar": RolloutEngine(target, SpecConfig(method="ar"), cfg),
                           "sd": RolloutEngine(target, SpecConfig(method="sd", k=args.k), cfg, draft=draft),
                           "ssd": ssd_engine}
                res = run_interleaved(engines, prompts, temp, args.new_tokens, args.repeats, one_at_a_time=batch == 1)
            (ar_tokens, ar_e2e, ar_m), (sd_tokens, sd_e2e, sd_m), (ssd_tokens, ssd_e2e, m) = (
                res["ar"], res["sd"], res["ssd"])
            ar_rate, sd_rate, ssd_rate = (x["rollout/decode_tokens_per_s"] for x in (ar_m, sd_m, m))
            rounds = m.get("ssd/strategy_rounds", {})
            rows.append({
                "batch": batch, "T": temp, "AR tok/s": ar_rate, "SD tok/s": sd_rate, "SSD tok/s": ssd_rate,
                "SD/AR": sd_rate / ar_rate, "SSD/AR": ssd_rate / ar_rate, "SSD/SD": ssd_rate / sd_rate,
                "predicted": m.get("ssd/predicted_speedup"), "hit": m.get("ssd/hit_rate"),
                "accept": m.get("spec/accept_rate"), "T_p": m.get("ssd/T_p"),
                "strategy": ",".join(f"{k}:{v}" for k, v in sorted(rounds.items(), key=lambda kv: -kv[1])),
                "greedy==AR": (sd_tokens == ar_tokens and ssd_tokens == ar_tokens) if temp == 0 else None,
                "SD accept": sd_m.get("spec/accept_rate"),
                "chosen/best(AR,SD)": ssd_rate / max(ar_rate, sd_rate),
                "e2e SSD/AR": ssd_e2e / ar_e2e, "e2e SSD/SD": ssd_e2e / sd_e2e,
                "e2e chosen/best": ssd_e2e / max(ar_e2e, sd_e2e),
            })
    if rows:
        print_table(rows)
    sweep_rows = sweeps(target, draft, args) if {"fanout", "C"} & set(args.parts.split(",")) else []
    if sweep_rows:
        print_table(sweep_rows, columns=["part", "setting", "tok/s", "SD tok/s", "SSD/SD", "hit", "hit warm", "accept", "fanout",
                                         "r", "pred miss", "T_p"])
    print_json_line({"bench": "ssd", "machine": machine_note(), "dtype": args.dtype, "k": args.k, "draft": args.draft,
                     "new_tokens": args.new_tokens,
                     "prompt_set": args.prompt_set,
                     "rows": rows, "sweeps": sweep_rows})


if __name__ == "__main__":
    main()
