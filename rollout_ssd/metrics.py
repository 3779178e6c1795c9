"""Counters behind `engine.metrics()`, with DESIGN.md's names. Counters run since start or reset."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineMetrics:
    seconds: float = 0.0
    tokens: int = 0
    rounds: int = 0  # sequence-rounds: one per running sequence per decode round
    round_tokens: int = 0

    def add_time(self, seconds: float, tokens: int) -> None:
        self.seconds += seconds
        self.tokens += tokens

    def add_rounds(self, rows: int, tokens: int) -> None:
        self.rounds += rows
        self.round_tokens += tokens

    def reset(self) -> None:
        self.__init__()

    def as_dict(self) -> dict:
        return {
            "rollout/tokens": self.tokens,
            "rollout/seconds": self.seconds,
            "rollout/tokens_per_s": self.tokens / self.seconds if self.seconds else 0.0,
            "rollout/tokens_per_round": self.round_tokens / self.rounds if self.rounds else 0.0,
        }
