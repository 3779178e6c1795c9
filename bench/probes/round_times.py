"""Round by round: the SSD engine's rounds against the AR engine's on one workload (issue 15, part 4).

Where a fresh SSD engine's first call loses to the AR engine's when its rule runs AR (a GRPO batch on a
CPU): each engine's `DecodeStrategy.step` is timed round by round (fresh engines, rule cache off, the two
taking turns `--repeats` times), and for each call this prints its tokens, seconds and rounds, the mean
seconds of its AR rounds (the SSD engine's round bookkeeping, beside the AR engine's bare step), and every
round of another plan the SSD engine ran (index, plan, batch, ms). Workloads as bench/fresh_engines.py's.

    .venv/bin/python bench/probes/round_times.py                   # grpo, 2 repeats
    .venv/bin/python bench/probes/round_times.py --workload demo --repeats 1
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for common.py (a probe lives in bench/probes/)
from common import add_repo_to_path, machine_note, print_json_line, print_table  # noqa: E402
from fresh_engines import WORKLOADS, warm_kernel_cache, workload

add_repo_to_path()

from rollout_ssd import RolloutEngine, SpecConfig  # noqa: E402
from rollout_ssd.kernels.cpu import cpu_kind  # noqa: E402
from rollout_ssd.models.cpu_dtype import describe_auto_dtype  # noqa: E402


def timed_call(method: str, name: str) -> dict:
    """One fresh engine's first call of workload `name`, each round timed: its rounds as (batch, seconds, plan)."""
    engine = RolloutEngine.from_pretrained(draft=None if method == "ar" else "default",
                                           spec=SpecConfig(method=method, k=4, rule_cache=False))
    rounds = []
    with engine:
        batches, params = workload(name, engine.target.tokenizer)
        strategy = engine.strategy
        if method == "ssd":
            strategy.trace = []
        step = strategy.step

        def timed_step(running):
            t0 = time.perf_counter()
            emitted = step(running)
            plan = strategy.trace[-1]["strategy"] if method == "ssd" else "ar"
            rounds.append((len(running), time.perf_counter() - t0, plan))
            return emitted

        strategy.step = timed_step
        t0 = time.perf_counter()
        tokens = sum(len(r.token_ids) for batch in batches for r in engine.sample(batch, params))
        seconds = time.perf_counter() - t0
    return {"tokens": tokens, "seconds": seconds, "rounds": rounds}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="grpo", choices=WORKLOADS)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args(argv)
    warm_kernel_cache()
    rows = []
    for run in range(args.repeats):
        for method in ("ar", "ssd"):
            out = timed_call(method, args.workload)
            ar = [s for _, s, plan in out["rounds"] if plan == "ar"]
            rows.append({"run": run, "engine": method, "tokens": out["tokens"], "call s": out["seconds"],
                         "rounds": len(out["rounds"]), "AR rounds": len(ar), "AR round ms": 1e3 * statistics.mean(ar),
                         "other rounds (index plan batch ms)": " ".join(
                             f"{i}:{plan}/{b}/{1e3 * s:.0f}" for i, (b, s, plan) in enumerate(out["rounds"]) if plan != "ar")})
    print(f"CPU {cpu_kind()}; dtype auto: {describe_auto_dtype()}; workload {args.workload}; fresh engines, rule cache off")
    print_table(rows)
    print_json_line({"bench": "round_times", "machine": machine_note(), "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
