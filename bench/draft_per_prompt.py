"""Two drafts' expected acceptance prompt by prompt, along the same target continuations.

`bench/eval_draft.py` gives one number per prompt set; this splits it by prompt, for both drafts over
the same continuations (one target sampling, seed 1234 as `measure_acceptance` uses), with each head's
coverage of the continuation's tokens (a token outside a restricted head can never be accepted). It
shows which kinds of prompt a new draft gained or lost on. Run:

    .venv/bin/python bench/draft_per_prompt.py --a default --b /path/to/ckpt            # held-out templates, greedy
    .venv/bin/python bench/draft_per_prompt.py --a default --b /path/to/ckpt --set unseen --temperature 1
"""

from __future__ import annotations

import argparse

import torch
from common import PROMPT_SETS, add_repo_to_path, load_default_pair, machine_note, print_json_line, print_table

add_repo_to_path()

from rollout_ssd.draft.acceptance import expected_acceptance  # noqa: E402
from rollout_ssd.draft.drift import visited_logits  # noqa: E402
from rollout_ssd.draft.on_policy import sample_continuations  # noqa: E402
from rollout_ssd.draft.prompts import chat_prompt_ids, eval_texts  # noqa: E402
from rollout_ssd.models.loader import load_draft  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--a", default="default", help='first draft: "default" or a checkpoint directory')
    p.add_argument("--b", required=True, help="second draft")
    p.add_argument("--set", choices=PROMPT_SETS, default="templates")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    target, a = load_default_pair(args.a)
    b = load_draft(args.b, target, "smollm2-135m-instruct", dtype="float32")
    texts = eval_texts(args.set, args.prompts)
    ids = chat_prompt_ids(target.tokenizer, texts)
    continuations = sample_continuations(target.model, ids, [args.temperature] * len(ids), args.max_new_tokens, 16, 1234)
    heads = [set(d.model.head_token_ids.tolist()) if d.model.head_token_ids is not None else None for d in (a, b)]
    rows = []
    for i, (prompt, cont) in enumerate(zip(ids, continuations)):
        if not cont:
            continue
        pair = [(list(prompt), cont)]
        p_logits = visited_logits(target.model, pair)
        row = {"prompt": i, "tokens": len(cont)}
        for name, draft, head in (("a", a, heads[0]), ("b", b, heads[1])):
            row[f"accept_{name}"] = float(expected_acceptance(p_logits, visited_logits(draft.model, pair),
                                                              args.temperature).mean())
            row[f"cover_{name}"] = 1.0 if head is None else sum(t in head for t in cont) / len(cont)
        row["text"] = texts[i][:60]
        rows.append(row)
    print_table(rows, floatfmt=".3f")
    total = sum(r["tokens"] for r in rows)
    means = {k: sum(r[k] * r["tokens"] for r in rows) / total for k in ("accept_a", "accept_b", "cover_a", "cover_b")}
    print("per-token means:", {k: round(v, 3) for k, v in means.items()})
    print_json_line({"bench": "draft_per_prompt", "args": vars(args), "machine": machine_note(), "means": means,
                     "rows": rows})


if __name__ == "__main__":
    main()
