"""Decode strategies: how running sequences advance by one round. AR here; SD/SSD add their own.

Invariant every strategy keeps: for a running sequence, the target's KV cache holds every token
except the last emitted one (which the next round feeds).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from rollout_ssd.metrics import EngineMetrics
from rollout_ssd.runner import ModelRunner
from rollout_ssd.sampling import draw_tokens, full_logprobs, target_probs
from rollout_ssd.sequence import Sequence


def row_params(seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row (temperature [B], top_k [B], top_p [B]) tensors."""
    temperature = torch.tensor([s.params.temperature for s in seqs], dtype=torch.float32)
    top_k = torch.tensor([s.params.top_k for s in seqs], dtype=torch.long)
    top_p = torch.tensor([s.params.top_p for s in seqs], dtype=torch.float32)
    return temperature, top_k, top_p


def sample_rows(seqs: list[Sequence], logits: torch.Tensor) -> tuple[list[int], list[float]]:
    """One token per row from the target law, with its DESIGN.md logprob. logits: [B, V]."""
    temperature, top_k, top_p = row_params(seqs)
    probs = target_probs(logits, temperature, top_k, top_p)
    tokens = draw_tokens(probs, temperature <= 0, [s.generator for s in seqs])
    logprobs = full_logprobs(logits, temperature).gather(1, tokens[:, None]).squeeze(1)
    return tokens.tolist(), logprobs.tolist()


def ar_step(runner: ModelRunner, seqs: list[Sequence]) -> tuple[list[int], list[float]]:
    """One AR decode step: a decode forward over each row's last token, then one token per row from the
    target law (with its logprob). The AR engine's round, and the SSD engine's AR rounds."""
    logits = runner.decode([s.slot for s in seqs], [s.last_token for s in seqs])
    return sample_rows(seqs, logits)


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

    def close(self) -> None:
        """Release processes or other resources."""


class ARDecode(DecodeStrategy):
    def __init__(self, runner: ModelRunner, stats: EngineMetrics):
        self.runner = runner
        self.stats = stats

    def step(self, running: list[Sequence]) -> int:
        tokens, logprobs = ar_step(self.runner, running)
        emitted = sum(s.append([t], [lp]) for s, t, lp in zip(running, tokens, logprobs))
        self.stats.add_rounds(len(running), emitted)
        return emitted
