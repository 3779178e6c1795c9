"""Speculative decoding as a decode strategy: propose, verify in one target forward, append, roll back.

One round for a batch (ragged K per sequence):
  1. the speculator proposes s_1..s_K for each sequence (K_i <= k, and K_i + 1 <= what it may still emit);
  2. the target runs ONE forward over [last token, s_1..s_K] per sequence -> logits for K_i + 1 positions;
  3. `verify` accepts a prefix and draws the bonus token (exact: THEORY.md §1);
  4. the sequence appends the emitted tokens, stopping at the first stop token or at its length budget
     (what follows a stop inside an accepted run is dropped, as AR would never have produced it);
  5. the target cache is rolled back to the sequence minus its last token; the speculator does the same.
"""

from __future__ import annotations

import time

import torch

from rollout_ssd.decode import DecodeStrategy, row_params
from rollout_ssd.metrics import EngineMetrics
from rollout_ssd.runner import ModelRunner
from rollout_ssd.sequence import Sequence
from rollout_ssd.spec.speculator import Speculator
from rollout_ssd.spec.verify import VerifyResult, verify


class SDDecode(DecodeStrategy):
    def __init__(self, runner: ModelRunner, speculator: Speculator, k: int, stats: EngineMetrics):
        self.runner = runner
        self.speculator = speculator
        self.k = k
        self.stats = stats

    def on_admit(self, seqs: list[Sequence]) -> None:
        self.speculator.on_admit(seqs)

    def on_release(self, seq: Sequence) -> None:
        self.speculator.on_release(seq)

    def close(self) -> None:
        self.speculator.close()

    def step(self, running: list[Sequence]) -> int:
        t0 = time.perf_counter()
        ks = [max(0, min(self.k, s.budget - 1)) for s in running]
        proposal = self.speculator.propose(running, ks)
        t1 = time.perf_counter()
        result = self.verify_round(running, proposal.tokens, proposal.draft)
        t2 = time.perf_counter()
        emitted = 0
        accepted = result.num_accepted.tolist()
        for i, seq in enumerate(running):
            n = int(result.num_emitted[i])
            emitted += seq.append(result.tokens[i, :n].tolist(), result.logprobs[i, :n].tolist())
            if not seq.finished:
                self.runner.rollback(seq.slot, seq.num_tokens - 1)
        self.speculator.on_verified(running, accepted)
        t3 = time.perf_counter()
        self.stats.add_spec_round(
            proposed=[len(t) for t in proposal.tokens], accepted=accepted, rejected=result.rejected.tolist(),
            emitted=emitted, draft_seconds=t1 - t0 + (t3 - t2), verify_seconds=t2 - t1,
        )
        return emitted

    def verify_round(self, seqs: list[Sequence], proposals: list[list[int]], draft) -> VerifyResult:
        """One target forward over [last token, proposal] per sequence, then `verify`."""
        feeds = [[s.last_token] + p for s, p in zip(seqs, proposals)]
        logits = self.runner.extend([s.slot for s in seqs], feeds)  # [B, Kmax+1, V]
        k_max = max(len(p) for p in proposals)
        draft_tokens = torch.full((len(seqs), max(k_max, 1)), -1, dtype=torch.long)
        for i, p in enumerate(proposals):
            draft_tokens[i, : len(p)] = torch.tensor(p, dtype=torch.long)
        num_draft = torch.tensor([len(p) for p in proposals], dtype=torch.long)
        if k_max == 0:
            draft_tokens = draft_tokens[:, :0]
        temperature, top_k, top_p = row_params(seqs)
        return verify(logits, draft_tokens, num_draft, draft, temperature, top_k, top_p,
                      [s.generator for s in seqs])
