"""Serial chain drafting: the loop both draft paths share (the SD draft model, spec/draft_model.py, and
the SSD draft side's on-demand chains, ssd/tree.py).

Per row: one catch-up forward over every token the draft's KV lacks (at least the last committed one),
then one token at a time: draw from the draft law q at the last position, and feed the drawn token back
(one decode forward for all rows still growing). How a token is drawn (the generator, Saguaro, a
restricted head) is the caller's `sample`; the loop only decides who is fed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rollout_ssd.runner import ModelRunner

# sample(step, rows, logits) -> drawn token ids, one per row in `rows` (logits: [len(rows), V or head]);
# it may shorten lengths[r] (to step + 1) for rows whose chain ends with this token
Sampler = Callable[[int, list[int], torch.Tensor], list[int]]


def draft_chains(runner: ModelRunner, slots: list[int], catch_up: list[list[int]], lengths: list[int],
                 sample: Sampler, head_only: bool = False) -> list[list[int]]:
    """Up to lengths[r] draft tokens for each slot; returns the drawn tokens per row. Every drawn token
    but a chain's last is written into the draft KV (after catch_up[r])."""
    logits = runner.extend(slots, catch_up, last_only=True, head_only=head_only)  # [R, V]
    tokens: list[list[int]] = [[] for _ in slots]
    dev = logits.device
    for step in range(max(lengths, default=0)):
        rows = [r for r in range(len(slots)) if lengths[r] > step]
        drawn = sample(step, rows, logits[torch.tensor(rows, dtype=torch.long, device=dev)])
        for r, t in zip(rows, drawn):
            tokens[r].append(t)
        feed = [(r, t) for r, t in zip(rows, drawn) if lengths[r] > step + 1]
        if feed:
            logits[torch.tensor([r for r, _ in feed], dtype=torch.long, device=dev)] = runner.decode(
                [slots[r] for r, _ in feed], [t for _, t in feed], head_only=head_only)
    return tokens
