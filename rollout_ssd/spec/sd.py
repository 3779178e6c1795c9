"""Speculative decoding as a decode strategy: propose, verify in one target forward, append, roll back.

One round for a batch (ragged K per sequence):
  1. the speculator proposes s_1..s_K for each sequence (K_i <= k, and K_i + 1 <= what it may still emit);
  2. the target runs ONE forward over [last token, s_1..s_K] per sequence -> logits for K_i + 1 positions;
  3. `verify` accepts a prefix and draws the bonus token (exact: docs/THEORY.md §1);
  4. the sequence appends the emitted tokens, stopping at the first stop token or at its length budget
     (what follows a stop inside an accepted run is dropped, as AR would never have produced it);
  5. the target cache is rolled back to the sequence minus its last token; the speculator does the same.
Steps 2-3 are `decode.verify_round` and 4-5 `decode.finish_round`, shared with AR and SSD.
"""

from __future__ import annotations

import time

from rollout_ssd.decode import DecodeStrategy, chain_lengths, finish_round, verify_round
from rollout_ssd.draft_sync import shared_names
from rollout_ssd.metrics import EngineMetrics
from rollout_ssd.runner import ModelRunner
from rollout_ssd.sequence import Sequence
from rollout_ssd.spec.speculator import Speculator


class SDDecode(DecodeStrategy):
    def __init__(self, runner: ModelRunner, speculator: Speculator, k: int, stats: EngineMetrics):
        self.runner = runner
        self.speculator = speculator
        self.k = k
        self.stats = stats
        # a neural draft holding target tensors (the built-in draft's embedding, every weight of an int4
        # draft) changes with each target update (`on_weights_changed`)
        draft = getattr(speculator, "model", None)
        self._shares_target = draft is not None and bool(shared_names(draft.hf_parameters(), runner.model.hf_parameters()))

    def on_admit(self, seqs: list[Sequence]) -> None:
        self.speculator.on_admit(seqs)

    def on_release(self, seq: Sequence) -> None:
        self.speculator.on_release(seq)

    def close(self) -> None:
        self.speculator.close()

    def on_weights_changed(self) -> None:
        """The target's weights changed: a draft that shares tensors with it changed too, so the draft KV
        its old values built goes (the next catch-up recomputes it; outputs are exact either way)."""
        if self._shares_target:
            self.speculator.weights_changed()

    def step(self, running: list[Sequence]) -> int:
        t0 = time.perf_counter()
        ks = chain_lengths(running, self.k)
        proposal = self.speculator.propose(running, ks)
        t1 = time.perf_counter()
        result = verify_round(self.runner, running, proposal.tokens, proposal.q)
        t2 = time.perf_counter()
        outcome = finish_round(self.runner, running, result)
        self.speculator.on_verified(running, outcome.accepted)
        t3 = time.perf_counter()
        self.stats.add_spec_round(
            proposed=[len(t) for t in proposal.tokens], accepted=outcome.accepted, rejected=outcome.rejected,
            emitted=outcome.emitted, draft_seconds=t1 - t0 + (t3 - t2), verify_seconds=t2 - t1,
        )
        return outcome.emitted
