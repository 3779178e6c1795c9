"""The SSD strategy rule round by round, on the default pair: what it ran, why, and what it cost.

One SSD engine (rule on, draft worker on its own core), `--repeats` sample() calls of `--batch` prompts
(`--prompt-set`, default `unseen`; `--distinct`: each call takes the next `--batch` prompts instead of
the same ones), one thread per process as in bench_ssd.py. Each round's record (`SSDDecode.trace`): batch
size, the strategy run, whether every sequence was on its first round (cold), the tokens emitted, the
round's wall time and its verify (or AR step) time, the target's wait for the draft side, the AR
calibration time, where each chain came from, and the scores the rule last published (expected batch
tokens per second of each strategy) with the predicted speedup over AR. Then per strategy: rounds,
tokens per round, seconds per round, tokens/s (decode: the prefill and the first token it gives are
outside the rounds), against an AR engine on the same prompts (the "AR engine" row, its decode time
and tokens; the two engines take turns call by call).

    .venv/bin/python bench/probes/trace_rule.py --batch 16 --temperature 1
    .venv/bin/python bench/probes/trace_rule.py --quick
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for common.py (a probe lives in bench/probes/)
from common import add_repo_to_path, bench_prompts, load_default_pair, machine_note, print_json_line, print_table  # noqa: E402

add_repo_to_path()

from rollout_ssd import EngineConfig, RolloutEngine, SamplingParams, SpecConfig  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--rounds-shown", type=int, default=12, help="rounds of each call printed (all are in the JSON)")
    p.add_argument("--quick", action="store_true", help="batch 4, 12 tokens, 1 call")
    p.add_argument("--dtype", default="float32", help='the pair\'s dtype ("auto": the engine\'s default)')
    p.add_argument("--threads", type=int, default=1, help="intra-op threads (0: torch's default, the engine's)")
    p.add_argument("--prompt-set", choices=("templates", "unseen"), default="unseen")
    p.add_argument("--distinct", action="store_true", help="each call on the next --batch prompts of the set")
    args = p.parse_args(argv)
    if args.quick:
        args.batch, args.new_tokens, args.repeats = 4, 12, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    target, draft = load_default_pair(dtype=args.dtype)
    calls = args.repeats if args.distinct else 1
    pool = bench_prompts(target.tokenizer, args.prompt_set, args.batch * calls)
    per_call = [pool[i * args.batch:(i + 1) * args.batch] for i in range(calls)]
    cfg = EngineConfig(max_batch_size=args.batch, max_model_len=max(map(len, pool)) + args.new_tokens + 8)
    params = SamplingParams(temperature=args.temperature, max_new_tokens=args.new_tokens, ignore_eos=True, seed=0)
    ar = RolloutEngine(target, SpecConfig(method="ar"), cfg)
    rows, summary = [], {}
    with RolloutEngine(target, SpecConfig(method="ssd", k=args.k), cfg, draft=draft) as ssd:
        ar.metrics(reset=True)
        for call in range(args.repeats):
            prompts = per_call[call % calls]
            ar.sample(prompts, params)
            m = ar.metrics(reset=True)  # decode only: the prefill and the token it gives left out, as below
            add(summary, "AR engine", args.new_tokens - 1, 0.0, m["rollout/seconds"] - m["rollout/prefill_seconds"],
                m["rollout/tokens"] - len(prompts))
            ssd.strategy.trace = trace = []
            ssd.sample(prompts, params)
            for i, r in enumerate(trace):
                rows.append({"call": call, "round": i, **r})
                add(summary, r["strategy"], 1, r["calibration_seconds"], r["seconds"], r["emitted"])
    shown = [r for r in rows if r["round"] < args.rounds_shown]
    print_table([{"call": r["call"], "round": r["round"], "b": r["batch"], "strategy": r["strategy"],
                  "cold": r["cold"], "tokens": r["emitted"], "s": r["seconds"], "verify s": r["verify_seconds"],
                  "wait s": r["wait_seconds"], "calib s": r["calibration_seconds"],
                  "paths": ",".join(f"{k}:{v}" for k, v in sorted(r["paths"].items())),
                  "scores": ",".join(f"{k}:{v:.1f}" for k, v in r["scores"].items()),
                  "predicted": r["predicted_speedup"]} for r in shown], floatfmt=".3f")
    table = [{"strategy": k, "rounds": v["rounds"], "tokens/round": v["tokens"] / max(v["rounds"], 1),
              "s/round": v["seconds"] / max(v["rounds"], 1), "calibration s": v["calibration"],
              "tok/s": v["tokens"] / v["seconds"]} for k, v in summary.items()]
    print()
    print_table(table, floatfmt=".3f")
    print_json_line({"bench": "trace_rule", "machine": machine_note(), "args": vars(args), "summary": table,
                     "rounds": rows})


def add(summary: dict, name: str, rounds: int, calibration: float, seconds: float, tokens: int) -> None:
    s = summary.setdefault(name, {"rounds": 0, "calibration": 0.0, "seconds": 0.0, "tokens": 0})
    s["rounds"] += rounds
    s["calibration"] += calibration
    s["seconds"] += seconds
    s["tokens"] += tokens


if __name__ == "__main__":
    main()
