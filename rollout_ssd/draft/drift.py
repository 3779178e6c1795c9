"""Drift telemetry: how far the draft is from the policy, and the rollout from the learner, per version.

Two numbers per policy version, next to the engine's acceptance and hit rate (docs/DESIGN.md metric names):

`drift/kl_target_draft` = mean over visited positions of KL(p_T || q_T), where p_T = softmax(target
logits / T) and q_T = softmax(draft logits / T) (forward KL, target first: the quantity distillation
minimises and the one that bounds acceptance: 1 - sum_x min(p, q) = TV(p, q) <= sqrt(KL(p || q) / 2)).
Visited positions are those a completion token was drawn at: for prompt x_1..x_n and completion
y_1..y_m, the m distributions after x, x y_1, ..., x y_1..y_{m-1}. T defaults to 1 (RL samples at T = 1);
a restricted-head draft (head_token_ids) has q = 0 outside its head, so p is restricted to the head and
renormalised there (the definition `loss.distill_loss` minimises); the mass p puts outside the head
is what no draft update can recover and is not counted.

`mismatch/token_mult_prob_error` = mean over tokens of exp(|logp_learner - logp_rollout|) (NeMo-RL's
definition: 1.0 exactly when the learner recomputes the rollout's logprobs bit for bit, and above 1
by about the mean absolute logprob error when they differ).

`DriftLog` collects one row per policy version (acceptance, hit rate, accept length, the two drift
numbers, sync bytes and seconds) as dicts keyed by those metric names, ready for wandb or JSONL.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import torch

Pair = tuple[Sequence[int], Sequence[int]]  # (prompt token ids, completion token ids)


def as_pairs(sequences: Sequence[Any]) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, completion ids) from pairs or from objects with `prompt_token_ids` and `token_ids`
    (engine Rollouts)."""
    out = []
    for i, s in enumerate(sequences):
        if hasattr(s, "prompt_token_ids") and hasattr(s, "token_ids"):
            prompt, completion = s.prompt_token_ids, s.token_ids
        elif isinstance(s, (tuple, list)) and len(s) == 2:
            prompt, completion = s
        else:
            raise ValueError(f"sequences[{i}] must be a (prompt_ids, completion_ids) pair or a Rollout")
        prompt, completion = [int(t) for t in prompt], [int(t) for t in completion]
        if not prompt:
            raise ValueError(f"sequences[{i}] has an empty prompt")
        out.append((prompt, completion))
    return out


@torch.no_grad()
def visited_logits(model, pairs: Sequence[Pair], batch_size: int = 8) -> torch.Tensor:
    """float32 logits at every visited position, concatenated in order: [N, V] (N = total completion
    tokens). model: a Decoder (`forward_train`, `logits`); the inputs go to its device."""
    device = model.embed.device
    rows = []
    order = [i for i, (_, c) in enumerate(pairs) if c]
    for start in range(0, len(order), batch_size):
        chunk = [pairs[i] for i in order[start:start + batch_size]]
        inputs = [list(p) + list(c)[:-1] for p, c in chunk]
        tokens = torch.zeros(len(chunk), max(len(x) for x in inputs), dtype=torch.long)  # right-padded
        for b, x in enumerate(inputs):
            tokens[b, :len(x)] = torch.tensor(x)
        hidden = model.forward_train(tokens.to(device))  # [B, T, H]; causal, so padding never reaches a real row
        for b, (p, c) in enumerate(chunk):
            rows.append(model.logits(hidden[b, len(p) - 1:len(p) - 1 + len(c)]).float())
    if not rows:
        raise ValueError("no visited positions: every completion is empty")
    return torch.cat(rows)


def kl_from_logits(p_logits: torch.Tensor, q_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Per-row KL(p_T || q_T) [N] from logits [N, V]; q = 0 off its support (-inf logits, a restricted
    head) restricts and renormalises p there (see the module docstring)."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 (KL of greedy laws is undefined), got {temperature}")
    p_logits, q_logits = p_logits.double() / temperature, q_logits.double() / temperature
    support = torch.isfinite(q_logits)
    p_logits = p_logits.masked_fill(~support, float("-inf"))
    logp = torch.log_softmax(p_logits, -1)
    logq = torch.log_softmax(q_logits, -1)
    p = logp.exp()
    terms = torch.where(support & (p > 0), p * (logp - logq), torch.zeros_like(logp))
    return terms.sum(-1).clamp(min=0.0)


def kl_target_draft(target, draft, sequences: Sequence[Any], temperature: float = 1.0, batch_size: int = 8) -> float:
    """`drift/kl_target_draft`: mean over the visited positions of `sequences` (pairs or Rollouts) of
    KL(p_target,T || q_draft,T), in nats. target, draft: Decoders (same vocabulary)."""
    pairs = as_pairs(sequences)
    kl = kl_from_logits(visited_logits(target, pairs, batch_size), visited_logits(draft, pairs, batch_size),
                        temperature)
    return float(kl.mean())


def token_mult_prob_error(logp_learner: Union[torch.Tensor, Sequence[Sequence[float]]],
                          logp_rollout: Union[torch.Tensor, Sequence[Sequence[float]]],
                          mask: Optional[torch.Tensor] = None) -> float:
    """`mismatch/token_mult_prob_error` = mean over (unmasked) tokens of exp(|logp_learner - logp_rollout|).
    Tensors of one shape (with an optional 0/1 mask of that shape), or ragged per-sequence lists whose
    lengths match pairwise. 1.0 exactly when the two agree."""
    if isinstance(logp_learner, torch.Tensor) or isinstance(logp_rollout, torch.Tensor):
        device = (logp_learner if isinstance(logp_learner, torch.Tensor) else logp_rollout).device
        a = torch.as_tensor(logp_learner, device=device).double()
        b = torch.as_tensor(logp_rollout, device=device).double()
        if a.shape != b.shape:
            raise ValueError(f"logprob shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
        m = torch.ones_like(a) if mask is None else torch.as_tensor(mask, device=device).double()
        if m.shape != a.shape:
            raise ValueError(f"mask shape {tuple(m.shape)} does not match {tuple(a.shape)}")
    else:
        if mask is not None:
            raise ValueError("mask is only for tensor inputs (ragged lists are all valid tokens)")
        if len(logp_learner) != len(logp_rollout):
            raise ValueError(f"{len(logp_learner)} learner sequences vs {len(logp_rollout)} rollout sequences")
        for i, (x, y) in enumerate(zip(logp_learner, logp_rollout)):
            if len(x) != len(y):
                raise ValueError(f"sequence {i}: {len(x)} learner logprobs vs {len(y)} rollout logprobs")
        a = torch.tensor([v for x in logp_learner for v in x], dtype=torch.float64)
        b = torch.tensor([v for y in logp_rollout for v in y], dtype=torch.float64)
        m = torch.ones_like(a)
    count = float(m.sum())
    if count <= 0:
        raise ValueError("no tokens to compare")
    err = torch.exp((a - b).abs() * m)  # masked tokens contribute exp(0) * 0
    value = float((err * m).sum() / count)
    if not math.isfinite(value):
        raise ValueError("logprobs must be finite")
    return value


# ------------------------------------------------------------------------------ per-version record
_KEYS = {  # DriftRecord field -> metric name
    "version": "sync/version", "draft_version": "sync/draft_version", "accept_rate": "spec/accept_rate",
    "hit_rate": "ssd/hit_rate", "accept_length": "spec/accept_length", "kl_target_draft": "drift/kl_target_draft",
    "token_mult_prob_error": "mismatch/token_mult_prob_error", "sync_bytes": "sync/bytes",
    "sync_seconds": "sync/seconds", "draft_sync_bytes": "sync/draft_bytes", "draft_sync_seconds": "sync/draft_seconds",
}
_FROM_ENGINE = ("accept_rate", "hit_rate", "accept_length")


@dataclass
class DriftRecord:
    """One policy version. Unknown numbers stay None and are left out of `as_dict`."""

    version: int
    draft_version: Optional[int] = None
    accept_rate: Optional[float] = None
    hit_rate: Optional[float] = None
    accept_length: Optional[float] = None
    kl_target_draft: Optional[float] = None
    token_mult_prob_error: Optional[float] = None
    sync_bytes: Optional[int] = None
    sync_seconds: Optional[float] = None
    draft_sync_bytes: Optional[int] = None
    draft_sync_seconds: Optional[float] = None
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        out = {key: getattr(self, name) for name, key in _KEYS.items() if getattr(self, name) is not None}
        out.update(self.extra)
        return out


class DriftLog:
    """Rows of DriftRecord, one per policy version (recording a version again merges into its row)."""

    def __init__(self):
        self.records: list[DriftRecord] = []

    def record(self, version: int, *, metrics: Optional[dict] = None, kl_target_draft: Optional[float] = None,
               token_mult_prob_error: Optional[float] = None, target_sync=None, draft_sync=None,
               draft_version: Optional[int] = None, **extra) -> dict:
        """Add what is known about `version`. metrics: `engine.metrics(reset=True)` over the rollouts made
        under this version (acceptance, hit rate, accept length are read from it); target_sync /
        draft_sync: the learner's weight_sync TransferStats that delivered this version. Returns the row."""
        row = self.records[-1] if self.records and self.records[-1].version == version else None
        if row is None:
            row = DriftRecord(version)
            self.records.append(row)
        metrics = metrics or {}
        for name in _FROM_ENGINE:
            if _KEYS[name] in metrics:
                setattr(row, name, float(metrics[_KEYS[name]]))
        if draft_version is None and "sync/draft_version" in metrics:
            draft_version = int(metrics["sync/draft_version"])
        updates = {"draft_version": draft_version, "kl_target_draft": kl_target_draft,
                   "token_mult_prob_error": token_mult_prob_error}
        if target_sync is not None:
            updates.update(sync_bytes=target_sync.bytes_sent, sync_seconds=target_sync.seconds)
        if draft_sync is not None:
            updates.update(draft_sync_bytes=draft_sync.bytes_sent, draft_sync_seconds=draft_sync.seconds)
        for name, value in updates.items():
            if value is not None:
                setattr(row, name, value)
        row.extra.update(extra)
        return row.as_dict()

    def rows(self) -> list[dict]:
        return [r.as_dict() for r in self.records]

    def write_jsonl(self, path: Union[str, Path]) -> None:
        with open(path, "w") as f:
            for row in self.rows():
                f.write(json.dumps(row, sort_keys=True) + "\n")
