"""Batch 1 on one core or on all of them: AR and SD engines, one decode step, and a switch between them.

The SSD engine verifies on the target's own core while its draft worker holds the other (ssd/cores.py)
and gives the target every core back for AR and SD rounds; its strategy rule bounds SSD by v = (an AR
step on every core) / (an AR step on one core) (ssd/chooser.py, Corollary 9's cap). This measures what
those choices rest on, on the machine it runs on, with the default pair in the engine's dtype:
  - AR and SD engines, batch 1, greedy, 64 tokens per prompt, with one intra-op thread pinned to the
    first core, and with every core (the two settings take turns, `--repeats` times over);
  - one AR decode step after a 100-odd-token prompt, each setting steady and right after a switch from
    the other (median of 21), and the cost of a `torch.set_num_threads` pair.

    .venv/bin/python bench/threads_batch1.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from common import add_repo_to_path, bench_prompts, load_default_pair, machine_note, print_json_line, print_table

add_repo_to_path()

from rollout_ssd import EngineConfig, RolloutEngine, SamplingParams, SpecConfig  # noqa: E402


def set_share(wide: bool, cores: set[int], threads: int) -> None:
    os.sched_setaffinity(0, cores if wide else {min(cores)})
    torch.set_num_threads(threads if wide else 1)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--quick", action="store_true", help="1 repeat, 8 tokens")
    args = p.parse_args(argv)
    if args.quick:
        args.repeats, args.new_tokens = 1, 8
    cores, threads = os.sched_getaffinity(0), torch.get_num_threads()
    target, draft = load_default_pair(dtype="auto")
    prompts = bench_prompts(target.tokenizer, "templates", 4)
    cfg = EngineConfig(max_batch_size=1, max_model_len=max(map(len, prompts)) + args.new_tokens + 8)
    params = SamplingParams(temperature=0, max_new_tokens=args.new_tokens, ignore_eos=True, seed=0)
    engines = {"AR": RolloutEngine(target, SpecConfig(method="ar"), cfg),
               "SD (K=3)": RolloutEngine(target, SpecConfig(method="sd", k=3), cfg, draft=draft)}
    rates: dict[tuple[str, bool], list[float]] = {}
    for _ in range(args.repeats):
        for name, engine in engines.items():
            for wide in (False, True):
                set_share(wide, cores, threads)
                engine.metrics(reset=True)
                for prompt in prompts:
                    engine.sample([prompt], params)
                rates.setdefault((name, wide), []).append(engine.metrics()["rollout/decode_tokens_per_s"])
    rows = [{"engine": name, "1 core tok/s": statistics.mean(rates[(name, False)]),
             f"{len(cores)} cores tok/s": statistics.mean(rates[(name, True)]),
             "all / 1": statistics.mean(rates[(name, True)]) / statistics.mean(rates[(name, False)])}
            for name in engines]
    runner = engines["AR"].runner
    slot = runner.allocate()
    runner.prefill([slot], [prompts[0]])

    def step() -> float:
        t0 = time.perf_counter()
        runner.extend([slot], [[prompts[0][-1]]], last_only=True)
        seconds = time.perf_counter() - t0
        runner.rollback(slot, len(prompts[0]))
        return seconds

    steps = {}
    for label, wide, switched in (("all cores, steady", True, False), ("1 core, steady", False, False),
                                  ("all cores, after a switch", True, True), ("1 core, after a switch", False, True)):
        times = []
        for _ in range(21):
            if switched:
                set_share(not wide, cores, threads)
                step()
            set_share(wide, cores, threads)
            times.append(step())
        steps[label] = 1e3 * statistics.median(times)
    set_share(True, cores, threads)
    t0 = time.perf_counter()
    for _ in range(1000):
        torch.set_num_threads(1)
        torch.set_num_threads(threads)
    pair_us = (time.perf_counter() - t0) * 1e3
    runner.free(slot)
    print(machine_note())
    print_table(rows, floatfmt=".2f")
    print()
    print_table([{"decode step": k, "ms (median of 21)": v} for k, v in steps.items()], floatfmt=".2f")
    print(f"\nv = all-core step / 1-core step = {steps['all cores, steady'] / steps['1 core, steady']:.3f}; "
          f"a set_num_threads pair: {pair_us:.2f} us")
    print_json_line({"bench": "threads_batch1", "machine": machine_note(), "cores": sorted(cores), "threads": threads,
                     "rows": rows, "steps_ms": steps, "set_num_threads_pair_us": pair_us})


if __name__ == "__main__":
    main()
