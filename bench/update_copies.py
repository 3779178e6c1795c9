"""RL steps on one AR engine: a weight update, then a GRPO-shaped `sample`, with the weights' layout copies
written over in place (`WeightCopies.get(..., in_place=True)`, now) or made anew after each update (before).

Each step updates every target weight in place (`update_weights` with the engine's own values, version + 1:
what a learner's broadcast does to the engine's memory) and samples 6 prompts x n=4 at T=1 (up to
`--max-new-tokens`). The copies a float32 engine keeps (the float32 rows kernel's packed layout where it
runs, the LM head's column-major copy, row-major copies where MKL's W @ x.T runs) are several hundred MB;
made anew, each update's first steps fault that memory in again, page by page (`ru_minflt`: minor page
faults during the sample). The two ways take turns step by step in one process. Table (median seconds per
sample, page faults, update seconds) and a JSON last line.

    .venv/bin/python bench/update_copies.py
    .venv/bin/python bench/update_copies.py --steps 2 --max-new-tokens 16   # quick
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

from common import add_repo_to_path, bench_prompts, machine_note, print_json_line, print_table

add_repo_to_path()

from rollout_ssd import RolloutEngine, SamplingParams, SpecConfig  # noqa: E402
from rollout_ssd.models.cpu_backend import cpu_kind, describe_auto_dtype  # noqa: E402
from rollout_ssd.models.weight_copies import WeightCopies  # noqa: E402

WAYS = ("made anew (before)", "in place (now)")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=4, help="steps per way")
    p.add_argument("--max-new-tokens", type=int, default=48)
    args = p.parse_args(argv)
    real_get = WeightCopies.get
    anew = lambda self, name, w, make, in_place=False: real_get(self, name, w, make)  # noqa: E731
    engine = RolloutEngine.from_pretrained(spec=SpecConfig(method="ar"))
    stats = {way: {"sample": [], "faults": [], "update": []} for way in WAYS}
    with engine:
        prompts = bench_prompts(engine.target.tokenizer, "templates", 6)
        params = SamplingParams(n=4, temperature=1.0, max_new_tokens=args.max_new_tokens, seed=0)
        named = [(n, t.detach().clone()) for n, t in engine.target.model.hf_parameters().items()]
        engine.sample(prompts, params)  # warm-up: every copy made once
        version = 0
        for _ in range(args.steps):
            for way in WAYS:
                WeightCopies.get = real_get if way == WAYS[1] else anew
                version += 1
                t0 = time.perf_counter()
                engine.update_weights(named, version=version)
                update = time.perf_counter() - t0
                faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                t0 = time.perf_counter()
                engine.sample(prompts, params)
                stats[way]["sample"].append(time.perf_counter() - t0)
                stats[way]["faults"].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
                stats[way]["update"].append(update)
        WeightCopies.get = real_get
    rows = [{"copies after an update": way, "sample s (median)": statistics.median(s["sample"]),
             "page faults (median)": statistics.median(s["faults"]), "update s (median)": statistics.median(s["update"])}
            for way, s in stats.items()]
    print(f"CPU {cpu_kind()}; dtype auto: {describe_auto_dtype()}; AR engine, update then sample 6 x n=4, T=1, "
          f"up to {args.max_new_tokens} tokens; {args.steps} steps per way, taking turns")
    print_table(rows, floatfmt=".3f")
    print_json_line({"bench": "update_copies", "machine": machine_note(), "args": vars(args), "rows": rows,
                     "steps": stats})


if __name__ == "__main__":
    main()
