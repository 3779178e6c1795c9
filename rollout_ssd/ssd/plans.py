"""What one SSD round can run (`Plan`), the batch buckets plan choices are kept per, a long call's tail
(where no new bucket is explored), and the plans the strategy rule may pick given the fast backup. The
chooser (ssd/chooser.py) picks among them per round.
"""

from __future__ import annotations

from enum import Enum
from typing import Optional


class Plan(Enum):
    """What one round runs. The value is its label: what `ssd/strategy`, `ssd/scores` and
    `ssd/strategy_rounds` report, and the rule's name for it."""

    SSD_DRAFT = "ssd+neural"  # SSD; the draft model drafts a chain on a miss
    SSD_SUFFIX = "ssd+suffix"  # SSD; the suffix speculator covers misses
    SSD_RANDOM = "ssd+random"  # SSD; the random speculator covers misses
    SD = "sd"  # plain SD with the draft model (on the draft side)
    SUFFIX = "suffix"  # plain SD with the suffix speculator
    AR = "ar"

    @property
    def label(self) -> str:
        return self.value

    @property
    def is_ssd(self) -> bool:
        """Chains come from the speculation cache, and the draft side builds the next one."""
        return self in (Plan.SSD_DRAFT, Plan.SSD_SUFFIX, Plan.SSD_RANDOM)

    @property
    def asks_draft_side(self) -> bool:
        """The draft side is asked for this round's chains."""
        return self.is_ssd or self is Plan.SD

    @property
    def drafts_on_miss(self) -> bool:
        """Where the cache has no chain, the draft side drafts one on demand."""
        return self in (Plan.SSD_DRAFT, Plan.SD)

    @property
    def uses_backup(self) -> bool:
        """The fast backup speculator proposes where the draft side gave no chain."""
        return self in (Plan.SSD_SUFFIX, Plan.SSD_RANDOM, Plan.SUFFIX)


def batch_bucket(batch: int) -> int:
    """Batch sizes that share a plan choice: 1, 2-3, 4-7, 8-15, 16-31, ..."""
    return batch.bit_length()


# A long call's tail (`call_tail`): a plan's first rounds at a new bucket carry one-off costs (the draft side
# catching up: 0.5-0.9 s at 10-14 GRPO sequences, 2-core CPU) a tail cannot pay back (bench/RESULTS.md,
# "Batched rollouts"); there a bucket not decided at keeps the plan running (ssd/chooser.py)
TAIL_ROUNDS = 32


def call_tail(running: list) -> bool:
    """Whether this round is a long call's tail: every sequence (`Sequence`) has fewer than TAIL_ROUNDS
    tokens of its budget left and one has made TAIL_ROUNDS or more (a shorter call explores as always)."""
    return max(s.budget for s in running) < TAIL_ROUNDS <= max(len(s.token_ids) for s in running)


def candidate_plans(backup: Optional[str]) -> tuple[Plan, ...]:
    """What the rule may pick, given the fast backup speculator (None: the draft model covers misses)."""
    plans = [Plan.SSD_DRAFT, Plan.SD, Plan.AR]
    if backup == "suffix":
        plans[1:1] = [Plan.SSD_SUFFIX]
        plans[3:3] = [Plan.SUFFIX]
    elif backup == "random":
        plans[1:1] = [Plan.SSD_RANDOM]
    return tuple(plans)
