"""The default target minus some of its own layers as a draft (self-speculation): how much does it accept?

The target samples continuations of `--prompts` "unseen" prompts (greedy and T = 1, `--tokens` each), then
a greedy backward elimination drops, one layer at a time, the layer whose removal costs the least expected
acceptance, each candidate scored teacher-forced on those continuations (greedy: argmax agreement; T = 1:
sum_x min(p, q), `draft.acceptance.expected_acceptance`; the mean of the two decides), down to `--stop`
layers. The layers kept run the target's own bf16 weights, its final norm and head. Table (layers kept,
the layer dropped, both acceptances), then one JSON line.

    .venv/bin/python bench/layer_skip_draft.py                    # 12 prompts, 96 tokens, down to 19 layers
    .venv/bin/python bench/layer_skip_draft.py --stop 27 --prompts 4
    .venv/bin/python bench/layer_skip_draft.py --prompt-set templates --prompts 32 \
        --kept-from bench/results/layer_skip_search_amx_session25.jsonl --sizes 27,24,20   # score those, no search
"""

from __future__ import annotations

import argparse
import json
from collections import deque

import torch
from common import PROMPT_SETS, bench_prompts, machine_note, print_json_line, print_table
from torch.nn.utils.rnn import pad_sequence

from rollout_ssd.draft.acceptance import expected_acceptance  # noqa: E402  (common put the repo on the path)
from rollout_ssd.draft.on_policy import sample_continuations  # noqa: E402
from rollout_ssd.models.decoder import rms_norm  # noqa: E402
from rollout_ssd.models.loader import load_pretrained  # noqa: E402


@torch.no_grad()
def visited_logits(model, kept: list[int], pairs) -> torch.Tensor:
    """float32 logits at every continuation position of `pairs` ((prompt, continuation) token lists) through
    the layers `kept` of `model` only (a causal forward without a KV cache)."""
    tokens = pad_sequence([torch.tensor(p + c[:-1]) for p, c in pairs], batch_first=True)  # right-padded
    _, x = deque(model.layer_outputs(tokens, kept), maxlen=1)[0]  # the last kept layer's output
    hidden = rms_norm(x, model.norm, model.cfg.rms_norm_eps)
    return torch.cat([model.logits(hidden[b, len(p) - 1:len(p) - 1 + len(c)]).float() for b, (p, c) in enumerate(pairs)])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--stop", type=int, default=19, help="layers left when the elimination stops")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--prompt-set", choices=PROMPT_SETS, default="unseen")
    p.add_argument("--kept-from", default="", help="a search's JSON lines (n, kept): score those layer sets, no search")
    p.add_argument("--sizes", default="", help="with --kept-from: the layer counts to score (default all)")
    args = p.parse_args(argv)
    loaded = load_pretrained("smollm2-135m-instruct", dtype="auto")
    model = loaded.model
    prompts = bench_prompts(loaded.tokenizer, args.prompt_set, args.prompts)
    pairs = {}
    for temperature in (0.0, 1.0):
        completions = sample_continuations(model, prompts, [temperature] * len(prompts), args.tokens, 16, seed=args.seed)
        pairs[temperature] = [(list(q), c) for q, c in zip(prompts, completions) if c]
    every = list(range(model.cfg.num_layers))
    reference = {t: visited_logits(model, every, ps) for t, ps in pairs.items()}

    def score(kept):
        return [float(expected_acceptance(reference[t], visited_logits(model, kept, pairs[t]), t).mean()) for t in (0.0, 1.0)]

    kept, rows = every[:], []
    if args.kept_from:  # score a search's layer sets, no search
        sizes = {int(x) for x in args.sizes.split(",") if x}
        with open(args.kept_from) as f:
            searched = [row for row in map(json.loads, f) if "kept" in row and (not sizes or row["n"] in sizes)]
        for row in searched:
            greedy, t1 = score(row["kept"])
            rows.append({"layers kept": row["n"], "dropped": "-", "greedy": greedy, "T=1": t1, "kept": str(row["kept"])})
            print(rows[-1], flush=True)
    while len(kept) > args.stop and not args.kept_from:
        scored = [(sum(s) / 2, layer, s) for layer in kept for s in [score([j for j in kept if j != layer])]]
        _, dropped, (greedy, t1) = max(scored)
        kept.remove(dropped)
        rows.append({"layers kept": len(kept), "dropped": dropped, "greedy": greedy, "T=1": t1, "kept": str(kept)})
        print(rows[-1], flush=True)
    print(f"positions scored: greedy {len(reference[0.0])}, T=1 {len(reference[1.0])}; machine: {machine_note()}")
    print_table(rows, floatfmt=".4f")
    print_json_line({"bench": "layer_skip_draft", "machine": machine_note(), "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
