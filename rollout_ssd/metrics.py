"""Counters behind `engine.metrics()`, with DESIGN.md's names. Counters run since start or reset.

Acceptance (DESIGN.md): `spec/accept_rate` = accepted / judged, where a round judges its accepted
draft tokens plus the rejected one, if any (it estimates THEORY's per-token a);
`spec/accepted_per_proposed` = accepted / all proposed; `spec/accept_length` = tokens emitted per
verification round (accepted + bonus, before truncation at a stop); `spec/accept_rate_pos_{i}` =
accepted / judged at draft position i (1-based).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EngineMetrics:
    seconds: float = 0.0
    tokens: int = 0
    rounds: int = 0  # sequence-rounds: one per running sequence per decode round
    round_tokens: int = 0
    spec_rounds: int = 0  # sequence-rounds that verified a proposal (possibly empty)
    proposed: int = 0
    accepted: int = 0
    judged: int = 0
    verify_lengths: int = 0  # accepted + bonus summed over spec rounds
    pos_accepted: list = field(default_factory=list)
    pos_judged: list = field(default_factory=list)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    syncs: int = 0
    sync_seconds: float = 0.0
    sync_bytes: int = 0

    def add_time(self, seconds: float, tokens: int) -> None:
        self.seconds += seconds
        self.tokens += tokens

    def add_rounds(self, rows: int, tokens: int) -> None:
        self.rounds += rows
        self.round_tokens += tokens

    def add_spec_round(self, proposed: list[int], accepted: list[int], rejected: list[bool], emitted: int,
                       draft_seconds: float, verify_seconds: float) -> None:
        self.add_rounds(len(proposed), emitted)
        self.spec_rounds += len(proposed)
        self.draft_seconds += draft_seconds
        self.verify_seconds += verify_seconds
        for k, a, r in zip(proposed, accepted, rejected):
            judged = a + int(r)
            self.proposed += k
            self.accepted += a
            self.judged += judged
            self.verify_lengths += a + 1
            need = max(k, len(self.pos_judged))
            self.pos_judged += [0] * (need - len(self.pos_judged))
            self.pos_accepted += [0] * (need - len(self.pos_accepted))
            for i in range(judged):
                self.pos_judged[i] += 1
                self.pos_accepted[i] += int(i < a)

    def add_sync(self, seconds: float, nbytes: int) -> None:
        self.syncs += 1
        self.sync_seconds += seconds
        self.sync_bytes += nbytes

    def reset(self) -> None:
        self.__init__()

    def as_dict(self) -> dict:
        out = {
            "rollout/tokens": self.tokens,
            "rollout/seconds": self.seconds,
            "rollout/tokens_per_s": self.tokens / self.seconds if self.seconds else 0.0,
            "rollout/tokens_per_round": self.round_tokens / self.rounds if self.rounds else 0.0,
        }
        if self.syncs:
            out.update({"sync/bytes": self.sync_bytes, "sync/seconds": self.sync_seconds, "sync/count": self.syncs})
        if self.spec_rounds:
            total = self.draft_seconds + self.verify_seconds
            out.update({
                "spec/accept_rate": self.accepted / self.judged if self.judged else 0.0,
                "spec/accepted_per_proposed": self.accepted / self.proposed if self.proposed else 0.0,
                "spec/accept_length": self.verify_lengths / self.spec_rounds,
                "spec/proposed_per_round": self.proposed / self.spec_rounds,
                "spec/draft_seconds": self.draft_seconds,
                "spec/verify_seconds": self.verify_seconds,
                "spec/draft_time_share": self.draft_seconds / total if total else 0.0,
            })
            for i, (a, j) in enumerate(zip(self.pos_accepted, self.pos_judged), start=1):
                out[f"spec/accept_rate_pos_{i}"] = a / j if j else 0.0
        return out
