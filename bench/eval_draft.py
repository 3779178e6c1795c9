"""Held-out SD acceptance of a draft for SmolLM2-135M-Instruct on two prompt sets (issue 3's goals).

- `templates`: the distillation recipe's 32 held-out prompts, filled from templates training never
  uses (what the recipe itself reports);
- `unseen`: 32 training-template prompts no data cache sampled (`common.bench_prompts` defines both).

Per set, the expected per-token acceptance along target-sampled continuations of at most 96 tokens
(`draft.acceptance.measure_acceptance`: greedy P[argmax q = argmax p], T=1 sum_x min(p, q)). Run:

    .venv/bin/python bench/eval_draft.py                          # the default draft, both sets
    .venv/bin/python bench/eval_draft.py --draft /path/to/ckpt --sets unseen
"""

from __future__ import annotations

import argparse

import torch
from common import PROMPT_SETS, add_repo_to_path, bench_prompts, load_default_pair, machine_note, print_json_line, print_table

add_repo_to_path()

from rollout_ssd.draft.acceptance import measure_acceptance  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--draft", default="default", help='"default" or a draft checkpoint directory')
    p.add_argument("--sets", default=",".join(PROMPT_SETS), help=f"comma-separated, from {PROMPT_SETS}")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompts", type=int, default=32, help="the first N prompts of each set")
    p.add_argument("--quick", action="store_true", help="4 prompts per set, 16 tokens")
    args = p.parse_args(argv)
    if args.quick:
        args.prompts, args.max_new_tokens = 4, 16
    args.sets = [s for s in args.sets.split(",") if s]
    unknown = [s for s in args.sets if s not in PROMPT_SETS]
    if unknown or not args.sets:
        p.error(f"--sets takes names from {PROMPT_SETS}, got {unknown or args.sets}")
    return args


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    target, draft = load_default_pair(args.draft)
    rows = []
    for name in args.sets:
        ids = bench_prompts(target.tokenizer, name, args.prompts)
        for temperature in (0.0, 1.0):
            acc = measure_acceptance(target.model, draft.model, ids, temperature, args.max_new_tokens)
            rows.append({"set": name, "T": temperature, "accept": acc.accept_rate, "positions": acc.positions,
                         "sequences": acc.sequences})
            print(rows[-1], flush=True)
    print_table(rows, floatfmt=".3f")
    print_json_line({"bench": "eval_draft", "draft": draft.source, "args": vars(args), "machine": machine_note(),
                     "rows": rows})


if __name__ == "__main__":
    main()
