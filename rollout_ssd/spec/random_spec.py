"""Random-token speculation: k uniformly random token ids per sequence.

The cheapest fast backup of THEORY §3 (the b* rule): it costs nothing to draft and is almost never
accepted, so a round emits about one token; it is the floor every other speculator must beat.

Randomness: each sequence draws from its own stream, sequence_generator(seed, prompt_index, sample_index,
stream=DRAFT_STREAM), created on admission and dropped on release; never from seq.generator, which
belongs to verification (stream 0). So a sequence's proposals depend only on (seed, i, j) and the ks it
was asked for, never on which sequences share its batch; verification draws the same uniforms whether or
not this speculator runs; and a k = 0 row draws nothing. The proposals are independent of the verifier's
uniforms, so verifying them as point masses (`PointDraft`) is exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rollout_ssd.sampling import sequence_generator
from rollout_ssd.sequence import Sequence
from rollout_ssd.spec.speculator import Proposal, Speculator, check_ks
from rollout_ssd.spec.verify import PointDraft

DRAFT_STREAM = 1  # sequence_generator stream of speculators' own draws (0 is verification's)


@dataclass(frozen=True)
class RandomConfig:
    """vocab_size: proposals are uniform over [0, vocab_size); the target model's vocabulary size."""

    vocab_size: int

    def __post_init__(self):
        if not isinstance(self.vocab_size, int) or isinstance(self.vocab_size, bool) or self.vocab_size < 1:
            raise ValueError(f"RandomConfig.vocab_size must be an integer >= 1, got {self.vocab_size!r}")


class RandomSpeculator(Speculator):
    """Proposes ks[i] uniform token ids for sequence i from its own generator stream."""

    name = "random"

    def __init__(self, config: RandomConfig):
        self.config = config
        self._generators: dict[int, tuple[Sequence, torch.Generator]] = {}  # id(seq) -> (seq, its stream)

    def propose(self, seqs: list[Sequence], ks: list[int]) -> Proposal:
        check_ks(seqs, ks)
        tokens = []
        for seq, k in zip(seqs, ks):
            if k == 0:
                tokens.append([])
                continue
            gen = self._generator(seq)
            tokens.append(torch.randint(0, self.config.vocab_size, (k,), generator=gen).tolist())
        return Proposal(tokens=tokens, q=PointDraft())

    def on_admit(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            self._generator(seq)

    def on_release(self, seq: Sequence) -> None:
        self._generators.pop(id(seq), None)

    def close(self) -> None:
        self._generators.clear()

    @property
    def num_tracked(self) -> int:
        """Sequences holding a generator stream (admitted and not yet released)."""
        return len(self._generators)

    def _generator(self, seq: Sequence) -> torch.Generator:
        """The sequence's own stream, created on first sight. The entry holds the sequence, so id(seq)
        cannot be reused while it is a key."""
        entry = self._generators.get(id(seq))
        if entry is None:
            gen = sequence_generator(seq.params.seed, seq.prompt_index, seq.sample_index, stream=DRAFT_STREAM)
            entry = self._generators[id(seq)] = (seq, gen)
        return entry[1]
