"""Target continuations of training-template prompts for `bench/feature_draft_probe.py`: token ids only
(the probe takes the teacher's distribution from the target's own features), sampled fast through the
engine (AR, large batches), so a few minutes give several hundred thousand tokens. Prompts: the
recipe's training prompts `build_prompts(8000, 0).train[--first:7900]` (the "unseen" bench set,
7900-7999, stays out); temperatures in turn 1.0, 1.0, 0.7, 0 (greedy).

    .venv/bin/python bench/feature_draft_data.py --out /tmp/s26/seqs_b.pt --minutes 12 --first 1024
"""

from __future__ import annotations

import argparse
import time

import torch
from common import add_repo_to_path, load_default_pair

add_repo_to_path()

from rollout_ssd.draft.on_policy import sample_continuations  # noqa: E402
from rollout_ssd.draft.prompts import UNSEEN_FROM, UNSEEN_OF, build_prompts, chat_prompt_ids  # noqa: E402

TEMPERATURES = (1.0, 1.0, 0.7, 0.0)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--minutes", type=float, default=12.0)
    p.add_argument("--first", type=int, default=0, help="first training prompt")
    p.add_argument("--chunk", type=int, default=256, help="prompts per engine call (saved after each)")
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--max-prompts", type=int, default=0, help="stop after this many prompts (0: --minutes decides)")
    p.add_argument("--quick", action="store_true", help="smoke run: 8 prompts, 16 tokens each")
    args = p.parse_args(argv)
    if args.quick:
        args.chunk, args.max_new_tokens, args.max_prompts = 8, 16, 8
    target, _ = load_default_pair("default", dtype="auto")
    texts = build_prompts(UNSEEN_OF, 0, seed=0).train[args.first:UNSEEN_FROM]
    texts = texts[:args.max_prompts] if args.max_prompts else texts
    deadline = time.monotonic() + args.minutes * 60
    seqs, plens, at, t0 = [], [], 0, time.monotonic()
    while at < len(texts) and time.monotonic() < deadline:
        ids = chat_prompt_ids(target.tokenizer, texts[at:at + args.chunk])
        temps = [TEMPERATURES[(args.first + at + i) % len(TEMPERATURES)] for i in range(len(ids))]
        comps = sample_continuations(target.model, ids, temps, args.max_new_tokens, 128, args.first + at, deadline)
        for prompt, comp in zip(ids, comps):
            if len(comp) > 1:
                seqs.append(list(prompt) + list(comp))
                plens.append(len(prompt))
        at += len(ids)
        torch.save({"token_ids": seqs, "prompt_len": plens, "first": args.first, "next": args.first + at}, args.out)
        tokens = sum(len(s) - n for s, n in zip(seqs, plens))
        print(f"{len(seqs)} sequences, {tokens} completion tokens, {time.monotonic() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
