"""What a fresh SSD engine does on the main job's workload (`rollout-ssd demo`: its 4 chat prompts, greedy,
K=4, dtype auto, 96 tokens), with the strategy rule on and off: rounds run under each strategy, hit rate,
acceptance, the cost ratios the rule saw (T_p, T_b), tokens/s. Table, then one JSON line.

    .venv/bin/python bench/ssd_fresh_engine.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import machine_note, print_json_line, print_table  # noqa: E402


def main() -> None:
    from rollout_ssd import RolloutEngine, SamplingParams, SpecConfig
    from rollout_ssd.cli import DEMO_PROMPTS

    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=96, seed=0, chat=True)
    rows = []
    for rule in (True, False):
        engine = RolloutEngine.from_pretrained(draft="default", spec=SpecConfig(method="ssd", k=4, strategy_rule=rule))
        with engine:
            engine.sample(DEMO_PROMPTS, params)
            m = engine.metrics()
        rows.append({"rule": rule, "tok/s": m["rollout/tokens_per_s"], "tokens/round": m["rollout/tokens_per_round"],
                     "rounds by strategy": m.get("ssd/strategy_rounds"), "hit": m.get("ssd/hit_rate"),
                     "accept": m.get("spec/accept_rate"), "T_p": m.get("ssd/T_p"), "T_b": m.get("ssd/T_b"),
                     "last strategy": m.get("ssd/strategy")})
    print_table(rows)
    print_json_line({"bench": "ssd_fresh_engine", "machine": machine_note(), "rows": rows})


if __name__ == "__main__":
    main()
