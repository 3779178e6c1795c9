"""Decode strategies: how running sequences advance by one round. AR here; SD/SSD add their own.

Every round has the same target side, written once here: the target either takes one AR step
(`ar_verdict`) or verifies one chain per sequence (`verify_round`), and its verdict goes through the same
tail (`finish_round`): append the emitted tokens, roll the target KV back. AR, SD and SSD differ only in
where the chains come from.

Invariant every strategy keeps: for a running sequence, the target's KV cache holds every token
except the last emitted one (which the next round feeds).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from rollout_ssd.metrics import EngineMetrics
from rollout_ssd.runner import ModelRunner
from rollout_ssd.sampling import draw_tokens, full_logprobs, row_params, target_probs
from rollout_ssd.sequence import Sequence
from rollout_ssd.spec.verify import DraftDistribution, VerifyResult, verify


def draw_rows(seqs: list[Sequence], logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row from the target law, with its docs/DESIGN.md logprob, where the logits are.
    logits: [B, V]. Returns tokens [B] int64 and logprobs [B] float32."""
    temperature, top_k, top_p = row_params(seqs)
    logits = logits.float()  # once, for the law and the logprobs alike (bitwise what each would make)
    probs = target_probs(logits, temperature, top_k, top_p)
    tokens = draw_tokens(probs, temperature <= 0, [s.generator for s in seqs])
    return tokens, full_logprobs(logits, temperature).gather(1, tokens[:, None]).squeeze(1)


def sample_rows(seqs: list[Sequence], logits: torch.Tensor) -> tuple[list[int], list[float]]:
    """`draw_rows`, on the host: token ids and logprobs as lists."""
    tokens, logprobs = draw_rows(seqs, logits)
    both = torch.stack([tokens.double(), logprobs.double()]).tolist()  # one host sync (ids < 2^53: exact)
    return [int(t) for t in both[0]], [float(lp) for lp in both[1]]


def chain_lengths(seqs: list[Sequence], k: int) -> list[int]:
    """K_i per sequence: at most k, and K_i + 1 (the chain and the bonus) within what it may still emit."""
    return [max(0, min(k, s.budget - 1)) for s in seqs]


def ar_verdict(runner: ModelRunner, seqs: list[Sequence]) -> VerifyResult:
    """An AR round (one decode forward over each row's last token, then one token per row from the target
    law) as a verdict with nothing proposed, left where the logits are for `finish_round`'s one transfer.
    Not `verify` with empty chains: that builds the target law for a K+1-token verify and judges nothing,
    and costs more per round."""
    logits = runner.decode([s.slot for s in seqs], [s.last_token for s in seqs])
    tokens, logprobs = draw_rows(seqs, logits)
    n, dev = len(seqs), tokens.device
    return VerifyResult(tokens=tokens[:, None], num_emitted=torch.ones(n, dtype=torch.int64, device=dev),  # [B, 1]
                        num_accepted=torch.zeros(n, dtype=torch.int64, device=dev),
                        rejected=torch.zeros(n, dtype=torch.bool, device=dev), logprobs=logprobs[:, None])


def verify_round(runner: ModelRunner, seqs: list[Sequence], chains: list[list[int]],
                 draft: DraftDistribution) -> VerifyResult:
    """One target forward over [last token, chain] per sequence, then `verify` against the chains' q."""
    feeds = [[s.last_token] + c for s, c in zip(seqs, chains)]
    logits = runner.extend([s.slot for s in seqs], feeds)  # [B, Kmax+1, V]
    k_max = max(len(c) for c in chains)
    draft_tokens = torch.full((len(seqs), max(k_max, 1)), -1, dtype=torch.long)  # [B, Kmax]
    for i, c in enumerate(chains):
        draft_tokens[i, : len(c)] = torch.tensor(c, dtype=torch.long)
    num_draft = torch.tensor([len(c) for c in chains], dtype=torch.long)  # [B]
    if k_max == 0:
        draft_tokens = draft_tokens[:, :0]
    temperature, top_k, top_p = row_params(seqs)
    return verify(logits, draft_tokens, num_draft, draft, temperature, top_k, top_p, [s.generator for s in seqs])


@dataclass(frozen=True)
class RoundOutcome:
    """What a round's tail did: tokens emitted in all, and per row the draft tokens accepted and whether
    one was rejected (for the speculator and the stats)."""

    emitted: int
    accepted: list[int]
    rejected: list[bool]
    bonus: list[int]  # t* per row: the token the target drew after the accepted ones


def finish_round(runner: ModelRunner, seqs: list[Sequence], result: VerifyResult) -> RoundOutcome:
    """The tail of every round: each sequence appends its emitted tokens (stopping at its first stop token
    or its length budget: what follows a stop inside an accepted run is dropped, as AR would never have
    produced it), then the target KV is rolled back to the sequence minus its last token."""
    k1 = result.tokens.shape[1]
    # the verdict comes to the host in one transfer (float64 holds token ids and float32 logprobs exactly)
    rows = torch.cat([result.tokens.double(), result.logprobs.double(), result.num_emitted[:, None].double(),
                      result.num_accepted[:, None].double(), result.rejected[:, None].double()], dim=1).tolist()
    emitted = 0
    for seq, row in zip(seqs, rows):
        n = int(row[2 * k1])
        emitted += seq.append([int(t) for t in row[:n]], row[k1:k1 + n])
        if not seq.finished:
            runner.rollback(seq.slot, seq.num_tokens - 1)
    accepted = [int(r[2 * k1 + 1]) for r in rows]
    return RoundOutcome(emitted, accepted, [bool(r[2 * k1 + 2]) for r in rows],
                        [int(r[a]) for r, a in zip(rows, accepted)])


class DecodeStrategy(ABC):
    @abstractmethod
    def step(self, running: list[Sequence]) -> int:
        """Advance every running sequence by one round; returns tokens emitted."""

    def before_prefill(self, seqs: list[Sequence]) -> None:
        """Called before the target prefills new sequences (an SSD worker prefills its draft meanwhile)."""

    def on_admit(self, seqs: list[Sequence]) -> None:
        """Called after the target prefilled new sequences (drafts prefill here)."""

    def on_release(self, seq: Sequence) -> None:
        """Called before a finished sequence's slot is freed."""

    def on_weights_changed(self) -> None:
        """The target's weights changed between rounds: drop anything derived from them."""

    def on_idle(self) -> None:
        """No request is left: the thread that ran the rounds is handed back as it was before them
        (an SSD engine's rounds narrow it to one CPU core beside its worker)."""

    def close(self) -> None:
        """Release processes or other resources."""


class ARDecode(DecodeStrategy):
    def __init__(self, runner: ModelRunner, stats: EngineMetrics):
        self.runner = runner
        self.stats = stats

    def step(self, running: list[Sequence]) -> int:
        outcome = finish_round(self.runner, running, ar_verdict(self.runner, running))
        self.stats.add_rounds(len(running), outcome.emitted)
        return outcome.emitted
