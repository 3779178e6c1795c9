"""The speculator interface: one class per way of proposing draft tokens.

A speculator proposes up to k tokens per running sequence together with the exact distribution
each token was drawn from (a `DraftDistribution` from `verify.py`): dense or sparse q for the draft
model, a point mass for suffix/n-gram/random proposals. Verification only needs that q, so any
speculator is lossless as long as it reports what it really sampled from.

Lifecycle, driven by the SD decode strategy:
  on_admit(seqs)          new sequences were prefilled by the target (a draft prefills here)
  propose(seqs, ks)       one proposal per sequence (ks[i] <= what sequence i may still emit - 1)
  on_verified(seqs, accepted_counts)
                          the round's tokens were appended to each sequence; accepted_counts[i] of
                          the proposal were accepted (a draft rolls its KV back accordingly)
  on_release(seq)         the sequence finished
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from rollout_ssd.sequence import Sequence
from rollout_ssd.spec.verify import DraftDistribution


@dataclass
class Proposal:
    tokens: list[list[int]]  # per sequence, its proposed tokens (length <= its k; may be empty)
    q: DraftDistribution  # the draft law each token was drawn from; rows aligned with `tokens`


def check_ks(seqs: list[Sequence], ks: list[int]) -> None:
    """ks must hold one non-negative k per sequence."""
    if len(ks) != len(seqs):
        raise ValueError(f"ks must hold one k per sequence ({len(seqs)}), got {len(ks)}")
    for k in ks:
        if k < 0:
            raise ValueError(f"ks must be >= 0, got {k}")


class Speculator(ABC):
    name: str = "speculator"

    @abstractmethod
    def propose(self, seqs: list[Sequence], ks: list[int]) -> Proposal:
        ...

    def on_admit(self, seqs: list[Sequence]) -> None:
        pass

    def on_verified(self, seqs: list[Sequence], accepted: list[int]) -> None:
        pass

    def on_release(self, seq: Sequence) -> None:
        pass

    def close(self) -> None:
        pass
