"""How far a draft's KV slot may be kept after a round: one rule for both draft paths (the SD draft
model, spec/draft_model.py, and the SSD draft side, ssd/tree.py).

A draft slot holds the sequence's first `cached` committed tokens, then the tokens the draft fed itself
while drafting (`written`). After verification the committed tokens moved on; the slot stays valid up to
the longest prefix of `written` that was committed, and never past the last committed token, which the
next round feeds again so that its logits come out.
"""

from __future__ import annotations


def kept_length(cached: int, written: list[int], committed: list[int]) -> int:
    """KV entries to keep: cached + (how many of `written` agree with committed[cached:]), at most
    len(committed) - 1."""
    tail = committed[cached:]
    agree = 0
    while agree < min(len(written), len(tail)) and written[agree] == tail[agree]:
        agree += 1
    return min(cached + agree, len(committed) - 1)
