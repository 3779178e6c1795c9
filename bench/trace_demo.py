"""The main job's workload on fresh engines, round by round: where a fresh SSD engine's first call goes.

An AR engine and then an SSD engine (engine defaults, dtype auto, the default draft, K = 4, the rule on)
each made for one `sample` call of the demo's 4 chat prompts (greedy, 96 new tokens, EOS on), as
`rollout-ssd demo` makes them. Printed: each engine's call and prefill seconds, then the SSD engine's
rounds (`SSDDecode.trace`): batch size, plan, tokens, round / verify / wait / calibration seconds; then
seconds per plan. The rounds show what the chooser's exploration costs at each batch size the call
passes through as sequences end.

    .venv/bin/python bench/trace_demo.py
"""

from __future__ import annotations

import argparse
import time

from common import add_repo_to_path, machine_note, print_json_line, print_table

add_repo_to_path()

from rollout_ssd import RolloutEngine, SamplingParams, SpecConfig  # noqa: E402
from rollout_ssd.cli import DEMO_PROMPTS  # noqa: E402


def call(method: str, params: SamplingParams) -> tuple[dict, list[dict]]:
    engine = RolloutEngine.from_pretrained(draft=None if method == "ar" else "default", spec=SpecConfig(method=method, k=4))
    with engine:
        trace: list[dict] = []
        if method == "ssd":
            engine.strategy.trace = trace
        t0 = time.perf_counter()
        out = engine.sample(DEMO_PROMPTS, params)
        seconds = time.perf_counter() - t0
        m = engine.metrics()
    tokens = sum(len(r.token_ids) for r in out)
    return {"engine": method, "call s": seconds, "prefill s": m["rollout/prefill_seconds"], "tokens": tokens,
            "tok/s": tokens / seconds}, trace


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--quick", action="store_true", help="16 tokens")
    args = p.parse_args(argv)
    if args.quick:
        args.new_tokens = 16
    params = SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens, seed=0, chat=True)
    ar, _ = call("ar", params)
    ssd, trace = call("ssd", params)
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
    print_table([ar, ssd], floatfmt=".3f")
    print()
    print_table(rounds, floatfmt=".4f")
    print()
    print_table(list(per_plan.values()), floatfmt=".3f")
    print_json_line({"bench": "trace_demo", "machine": machine_note(), "engines": [ar, ssd], "rounds": rounds,
                     "per_plan": list(per_plan.values())})


if __name__ == "__main__":
    main()
