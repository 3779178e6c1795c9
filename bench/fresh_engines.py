"""Fresh engines, first call: AR, SD and SSD as a new user (or a new RL run) gets them (issue 15, part 4).

Each workload runs once per method on an engine made for it (`RolloutEngine.from_pretrained`, engine
defaults, dtype auto, the default draft, SSD with its strategy rule): the first `sample` call is what is
timed, end to end (prefill, the rule's first rounds and calibrations included). The methods take turns
workload by workload, `--repeats` times over, so machine noise hits them alike. Workloads:
  - demo: the main job's 4 chat prompts before issue 50, greedy, 96 new tokens, EOS on;
  - main: the main job's workload now (`make run`, rollout_ssd/demo.py): its 4 chat prompts, greedy, up to
    256 new tokens; with `--calls 2` this times what `make run`'s table reports (each engine's second call);
  - batch1: 4 chat prompts of the held-out templates, one `sample` call each, greedy, 96 tokens;
  - grpo: 6 prompts x n=4, T=1, EOS on, up to 160 new tokens (a GRPO step's rollouts);
  - grpo128: 32 prompts x n=4, T=1, EOS on, up to 96 new tokens (128 sequences, the CPU default batch).
Table (tok/s per method, SSD against the better of AR and SD, and the same by call time: the faster of AR's
and SD's calls' seconds over SSD's, since at T = 1 the engines draw different samples, whose lengths
differ, and an RL step waits for the whole call; SSD's rounds and their seconds by strategy
per run, "(calibration)" the AR calibration steps inside them, next to the whole call's seconds), JSON
last line.

    .venv/bin/python bench/fresh_engines.py
    .venv/bin/python bench/fresh_engines.py --workloads demo --repeats 1
    .venv/bin/python bench/fresh_engines.py --rule-cache warm   # SSD engines start from the rule's cache
    .venv/bin/python bench/fresh_engines.py --workloads grpo --ssd-rounds   # and the SSD engine's SSD rounds
    .venv/bin/python bench/fresh_engines.py --draft target-int4 --k 3        # another draft and K
    .venv/bin/python bench/fresh_engines.py --workloads main --calls 2 --repeats 1   # `make run`'s table

--calls N times the last of N identical calls on each engine (the default, 1, the first), and reports the
first call's seconds beside it.
"""

from __future__ import annotations

import argparse
import tempfile
import time

from common import MAIN_JOB_PROMPTS, add_repo_to_path, bench_prompts, machine_note, print_json_line, print_table

add_repo_to_path()

from rollout_ssd import RolloutEngine, SamplingParams, SpecConfig  # noqa: E402
from rollout_ssd import metric_names as names  # noqa: E402
from rollout_ssd.kernels.cpu import cpu_kind  # noqa: E402
from rollout_ssd.models.cpu_dtype import describe_auto_dtype  # noqa: E402

WORKLOADS = ("demo", "main", "batch1", "grpo", "grpo128")
SSD_ROUND_FIELDS = ("batch", "strategy", "cold", "emitted", "seconds", "verify_seconds", "wait_seconds", "paths", "fanout")


def workload(name: str, tokenizer, new_tokens: int = 0):
    """(list of prompt batches, one sample() call each; SamplingParams); `new_tokens` (demo only) other
    than the workload's 96."""
    if name == "demo":
        return [MAIN_JOB_PROMPTS], SamplingParams(temperature=0.0, max_new_tokens=new_tokens or 96, seed=0, chat=True)
    if name == "main":
        from rollout_ssd.demo import DEMO_PROMPTS

        return [DEMO_PROMPTS], SamplingParams(temperature=0.0, max_new_tokens=new_tokens or 256, seed=0, chat=True)
    if name == "batch1":
        prompts = bench_prompts(tokenizer, "templates", 4)
        return [[p] for p in prompts], SamplingParams(temperature=0.0, max_new_tokens=96, seed=0)
    if name == "grpo":
        prompts = bench_prompts(tokenizer, "templates", 6)
        return [prompts], SamplingParams(n=4, temperature=1.0, max_new_tokens=160, seed=0)
    if name == "grpo128":
        prompts = bench_prompts(tokenizer, "templates", 32)
        return [prompts], SamplingParams(n=4, temperature=1.0, max_new_tokens=96, seed=0)
    raise ValueError(f"unknown workload {name!r}; known: {WORKLOADS}")


def warm_kernel_cache() -> None:
    """Build (or find) this package's C kernels before anything is timed: they are built on first use,
    once per source version, and a build inside a timed call (seconds) is not what a fresh engine on a
    machine that ran the package before pays."""
    from rollout_ssd.kernels import bf16_rows, few_attention, layer_kernel

    bf16_rows.available(), bf16_rows.op_in_cpp(), few_attention.available(), layer_kernel.available()


def run(method: str, name: str, new_tokens: int = 0, rule_cache=False, draft: str = "default", k: int = 4,
        calls: int = 1) -> dict:
    """One fresh engine's first call of workload `name`: tokens, seconds, acceptance, prefill seconds,
    rounds and seconds per plan, and (SSD) the rounds' trace (`SSDDecode.trace`). `rule_cache`:
    SpecConfig.rule_cache (False: the engine measures as on a machine it never ran on); `draft` and `k`:
    SD's and SSD's draft and speculation length; `calls`: the timed call is the last of this many identical ones
    (the first call's seconds are reported too)."""
    spec = SpecConfig(method=method, k=k, rule_cache=rule_cache)
    engine = RolloutEngine.from_pretrained(draft=None if method == "ar" else draft, spec=spec)
    with engine:
        batches, params = workload(name, engine.target.tokenizer, new_tokens)
        first_seconds = None
        for _ in range(calls - 1):  # untimed calls before the timed one (the first pays the one-time costs)
            t0 = time.perf_counter()
            for batch in batches:
                engine.sample(batch, params)
            first_seconds = first_seconds or time.perf_counter() - t0
            engine.metrics(reset=True)
        trace = None
        if method == "ssd":
            engine.strategy.trace = trace = []
        t0 = time.perf_counter()
        tokens = sum(len(r.token_ids) for batch in batches for r in engine.sample(batch, params))
        seconds = time.perf_counter() - t0
        first_seconds = first_seconds or seconds
        m = engine.metrics()
    by_plan: dict[str, float] = {}
    for r in trace or []:  # a round's seconds include its AR calibration, also summed apart
        by_plan[r["strategy"]] = by_plan.get(r["strategy"], 0.0) + r["seconds"]
        by_plan["(calibration)"] = by_plan.get("(calibration)", 0.0) + r["calibration_seconds"]
    return {"tokens": tokens, "seconds": seconds, "first_seconds": first_seconds, "accept": m.get(names.SPEC_ACCEPT_RATE),
            "prefill_seconds": m[names.ROLLOUT_PREFILL_SECONDS], "rounds": m.get(names.SSD_STRATEGY_ROUNDS),
            "plan_seconds": by_plan, "trace": trace or []}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", default="demo,batch1,grpo", help=f"comma list of {WORKLOADS}")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--rule-cache", choices=("off", "warm"), default="off",
                   help="off: no engine starts from the strategy rule's cache (a machine's first run); warm: "
                        "each SSD engine starts from the cache its predecessors left (one untimed run per "
                        "workload fills it first), as an RL actor restarted on the same machine does")
    p.add_argument("--draft", default="default", help="SD's and SSD's draft: default, target-int4, or a checkpoint")
    p.add_argument("--k", type=int, default=4, help="SD's and SSD's speculation length")
    p.add_argument("--ssd-rounds", action="store_true",
                   help="also list the SSD engine's rounds of SSD plans (batch, cold, seconds, wait, fan-out)")
    p.add_argument("--calls", type=int, default=1, help="time the last of this many identical calls per engine")
    p.add_argument("--quick", action="store_true", help="a smoke run: the main workload, 2 calls, 16 new tokens")
    args = p.parse_args(argv)
    new_tokens = 16 if args.quick else 0
    if args.quick:
        args.workloads, args.repeats, args.calls = "main", 1, 2
    names_ = [w for w in args.workloads.split(",") if w]
    warm_kernel_cache()
    ssd_rounds = []
    cache = False if args.rule_cache == "off" else tempfile.mkdtemp(prefix="fresh_engines_rule_")
    for w in names_ if cache else ():
        run("ssd", w, rule_cache=cache, draft=args.draft, k=args.k)
    totals = {(w, m): {"tokens": 0, "seconds": 0.0, "first_seconds": 0.0, "rounds": {}, "plan_seconds": {}}
              for w in names_ for m in ("ar", "sd", "ssd")}
    for _ in range(args.repeats):
        for w in names_:
            for method in ("ar", "sd", "ssd"):
                out = run(method, w, new_tokens, rule_cache=cache, draft=args.draft, k=args.k, calls=args.calls)
                if args.ssd_rounds:
                    ssd_rounds += [{"workload": w, "round": i, **{k: r[k] for k in SSD_ROUND_FIELDS}}
                                   for i, r in enumerate(out["trace"]) if r["strategy"].startswith("ssd")]
                t = totals[(w, method)]
                t["tokens"] += out["tokens"]
                t["seconds"] += out["seconds"]
                t["first_seconds"] += out["first_seconds"]
                t["accept"] = out["accept"]
                for key in ("rounds", "plan_seconds"):
                    for k, v in (out[key] or {}).items():
                        t[key][k] = t[key].get(k, 0) + v
    rows = []
    for w in names_:
        rate = {m: totals[(w, m)]["tokens"] / totals[(w, m)]["seconds"] for m in ("ar", "sd", "ssd")}
        rows.append({"workload": w, "AR tok/s": rate["ar"], "SD tok/s": rate["sd"], "SSD tok/s": rate["ssd"],
                     "SSD / best(AR, SD)": rate["ssd"] / max(rate["ar"], rate["sd"]), "SSD / AR": rate["ssd"] / rate["ar"],
                     "by call time": min(totals[(w, m)]["seconds"] for m in ("ar", "sd")) / totals[(w, "ssd")]["seconds"],
                     "SD accept": totals[(w, "sd")].get("accept"),
                     "SSD rounds by strategy": ", ".join(f"{k} {v}" for k, v in totals[(w, "ssd")]["rounds"].items()),
                     "SSD seconds by strategy": ", ".join(f"{k} {v / args.repeats:.2f}"
                                                          for k, v in totals[(w, "ssd")]["plan_seconds"].items()),
                     "SSD call s": totals[(w, "ssd")]["seconds"] / args.repeats,
                     "first call s (AR, SD, SSD)": ", ".join(f"{totals[(w, m)]['first_seconds'] / args.repeats:.1f}"
                                                             for m in ("ar", "sd", "ssd"))})
    which = "first call" if args.calls == 1 else f"call {args.calls} of {args.calls}"
    print(f"CPU {cpu_kind()}; dtype auto: {describe_auto_dtype()}; {which} of a fresh engine, {args.repeats} runs "
          f"each; strategy rule cache {args.rule_cache}; draft {args.draft}, k {args.k}")
    print_table(rows)
    if ssd_rounds:
        print_table([{**r, "fanout": str(r["fanout"]), "paths": str(r["paths"])} for r in ssd_rounds], floatfmt=".3f")
    print_json_line({"bench": "fresh_engines", "machine": machine_note(), "args": vars(args), "rows": rows,
                     "ssd_rounds": ssd_rounds})


if __name__ == "__main__":
    main()
