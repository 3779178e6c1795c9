"""The speculation cache: per sequence, the chains pre-drafted for the likely verdicts (k, t*).

An entry set is built once per round for the chain s_1..s_K under verification (ssd/tree.py): branch r
forks at depth k_r (s_1..s_{k_r} accepted, then the bonus t*_r) and holds the K draft tokens that follow
t*_r, with the exact law q (or Saguaro's q_C) each was sampled from. When the verdict (k, t*) arrives the
set is looked up once and dropped: a hit's chain is an ordinary SD proposal with its own q.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class CacheEntries:
    """One sequence's cache for one round.

    tokens: [N, K] int64 branch chains; q: [N, K, V] float32, the law each chain token was drawn from;
    index: (depth k, bonus t*) -> branch row; fanout: candidates actually cached at each depth 0..K_chain.
    """

    tokens: torch.Tensor
    q: torch.Tensor
    index: dict[tuple[int, int], int]
    fanout: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.index)


@dataclass(frozen=True)
class CacheHit:
    tokens: list[int]  # the chain, cut to the requested length
    q: torch.Tensor  # [len, V]


class SpeculationCache:
    """sequence id -> the CacheEntries of its chain under verification."""

    def __init__(self):
        self._entries: dict[int, CacheEntries] = {}

    def put(self, seq_id: int, entries: CacheEntries) -> None:
        self._entries[seq_id] = entries

    def drop(self, seq_id: int) -> None:
        self._entries.pop(seq_id, None)

    def has(self, seq_id: int) -> bool:
        return seq_id in self._entries

    def fanout_at(self, seq_id: int, depth: int) -> int:
        """How many bonus candidates were cached at `depth` (0 when nothing was built)."""
        entries = self._entries.get(seq_id)
        if entries is None or not 0 <= depth < len(entries.fanout):
            return 0
        return entries.fanout[depth]

    def take(self, seq_id: int, depth: int, bonus: int, length: int) -> Optional[CacheHit]:
        """Look up the verdict (depth, bonus) and drop the sequence's entries (they are single-use)."""
        entries = self._entries.pop(seq_id, None)
        if entries is None:
            return None
        row = entries.index.get((depth, bonus))
        if row is None:
            return None
        length = min(length, entries.tokens.shape[1])
        return CacheHit(entries.tokens[row, :length].tolist(), entries.q[row, :length].clone())

    def __len__(self) -> int:
        return len(self._entries)
