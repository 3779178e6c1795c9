"""The main job's workload on fresh engines, round by round: where a fresh SSD engine's first call goes.

An AR engine and then an SSD engine (engine defaults, dtype auto, the default draft, K = 4, the rule on)
each made for one `sample` call of the demo's 4 chat prompts (greedy, 96 new tokens, EOS on), as
`rollout-ssd demo` makes them (`fresh_engines.run`, its "demo" workload). Printed: each engine's call
and prefill seconds, then the SSD engine's rounds (`SSDDecode.trace`): batch size, plan, tokens, round /
verify / wait / calibration seconds; then seconds per plan. The rounds show what the chooser's
exploration costs at each batch size the call passes through as sequences end.

    .venv/bin/python bench/trace_demo.py
    .venv/bin/python bench/trace_demo.py --rule-cache DIR   # twice: the second SSD engine starts from the first's
"""

from __future__ import annotations

import argparse

from common import machine_note, print_json_line, print_table
from fresh_engines import run


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="16 new tokens")
    p.add_argument("--rule-cache", default=None, metavar="DIR",
                   help="the SSD engine's SpecConfig.rule_cache (default: off, a machine's first run)")
    args = p.parse_args(argv)
    new_tokens = 16 if args.quick else 0  # 0: the workload's 96
    engines, trace = [], []
    for method in ("ar", "ssd"):
        out = run(method, "demo", new_tokens, rule_cache=args.rule_cache or False)
        engines.append({"engine": method, "call s": out["seconds"], "prefill s": out["prefill_seconds"],
                        "tokens": out["tokens"], "tok/s": out["tokens"] / out["seconds"]})
        trace = out["trace"] or trace
    rounds = [{"round": i, "b": r["batch"], "plan": r["strategy"], "tokens": r["emitted"], "s": r["seconds"],
               "verify s": r["verify_seconds"], "wait s": r["wait_seconds"], "calib s": r["calibration_seconds"]}
              for i, r in enumerate(trace)]
    per_plan: dict[str, dict] = {}
    for r in rounds:
        agg = per_plan.setdefault(r["plan"], {"plan": r["plan"], "rounds": 0, "tokens": 0, "s": 0.0, "calib s": 0.0})
        agg["rounds"] += 1
        agg["tokens"] += r["tokens"]
        agg["s"] += r["s"]
        agg["calib s"] += r["calib s"]
    print(machine_note())
    print_table(engines, floatfmt=".3f")
    print()
    print_table(rounds, floatfmt=".4f")
    print()
    print_table(list(per_plan.values()), floatfmt=".3f")
    print_json_line({"bench": "trace_demo", "machine": machine_note(), "engines": engines, "rounds": rounds,
                     "per_plan": list(per_plan.values())})


if __name__ == "__main__":
    main()
