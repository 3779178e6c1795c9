"""What dynamo's guards cost a frozen compiled step (issue 15, part 2; `gpu.inductor.guard_filter`). Two
frozen AR engines on one target (dtype auto), batch 1, greedy, fixed length: one compiled with the
engine's guard filter (a frozen step skips the guards on its module's attributes), one with every guard
dynamo makes (the filter patched to None while it compiles). Both warm up on the timed prompts until they
compile no new graph, then take turns prompt by prompt (the order flipped each pass). Reported: each
engine's median tok/s over the calls, the median of the per-call ratios, whether the two produce the same
tokens, and the graphs compiled during the timed calls (none expected: the filter must not cost a
recompile). Table, then one JSON line.

    .venv/bin/python bench/frozen_guards.py
    .venv/bin/python bench/frozen_guards.py --quick
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

from bench_compile import graphs_compiled, warm_up
from common import add_repo_to_path, bench_prompts, machine_note, print_json_line, print_table

add_repo_to_path()

from rollout_ssd import EngineConfig, RolloutEngine, SamplingParams, SpecConfig  # noqa: E402
from rollout_ssd.gpu import graphs  # noqa: E402
from rollout_ssd.models import bf16_rows  # noqa: E402
from rollout_ssd.models.cpu_backend import describe_auto_dtype  # noqa: E402
from rollout_ssd.models.loader import load_pretrained  # noqa: E402


@contextlib.contextmanager
def guards_of(name: str):
    """Around an engine's calls: the "every guard" engine compiles with no guard filter."""
    if name != "every guard":
        yield
        return
    kept = graphs.guard_filter
    graphs.guard_filter = lambda mode: None
    try:
        yield
    finally:
        graphs.guard_filter = kept


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--passes", type=int, default=5, help="timed passes over the prompts")
    p.add_argument("--quick", action="store_true", help="2 prompts, 16 tokens, 2 passes")
    args = p.parse_args(argv)
    if args.quick:
        args.prompts, args.new_tokens, args.passes = 2, 16, 2
    target = load_pretrained("smollm2-135m-instruct", dtype="auto")
    prompts = bench_prompts(target.tokenizer, "templates", args.prompts)
    params = SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens, ignore_eos=True, seed=0)
    names = ("filtered", "every guard")
    engines = {n: RolloutEngine(target, SpecConfig(method="ar"), EngineConfig(max_batch_size=1, compile="frozen"))
               for n in names}
    try:
        warm_s = {name: warm_up(engine, prompts, params, lambda name=name: guards_of(name))
                  for name, engine in engines.items()}
        rates, outputs, before = {n: [] for n in names}, {n: [] for n in names}, graphs_compiled()
        for i in range(args.passes):
            for prompt in prompts:
                for name in (names if i % 2 == 0 else names[::-1]):
                    t0 = time.perf_counter()
                    with guards_of(name):
                        out = engines[name].sample([prompt], params)[0]
                    rates[name].append(len(out.token_ids) / (time.perf_counter() - t0))
                    if i == 0:
                        outputs[name].append(list(out.token_ids))
        timed_graphs = graphs_compiled() - before
    finally:
        for engine in engines.values():
            engine.close()
    ratios = [a / b for a, b in zip(rates["filtered"], rates["every guard"])]
    rows = [{"engine": n, "median tok/s": statistics.median(rates[n]), "warm-up s": warm_s[n]} for n in names]
    summary = {"filtered / every guard (median of per-call ratios)": statistics.median(ratios),
               "same tokens": outputs["filtered"] == outputs["every guard"], "graphs compiled in timed calls": timed_graphs}
    print(f"dtype auto: {describe_auto_dtype()}; bf16 rows op's kernel: {'C++' if bf16_rows.op_in_cpp() else 'Python'}")
    print_table(rows)
    print(summary)
    print_json_line({"bench": "frozen_guards", "machine": machine_note(), "args": vars(args), "rows": rows,
                     "calls": len(ratios), **summary})


if __name__ == "__main__":
    main()
