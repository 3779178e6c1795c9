"""Follow mode: the learner keeps the draft close to the policy by online distillation (docs/THEORY.md §5).

RL moves the target every step; a frozen draft drifts away from it and acceptance and the cache hit
rate fall. In "follow" mode, every `every_n_steps` policy steps the learner takes the step's rollouts
(prompt + completion token ids) and the CURRENT policy as teacher, and runs a few AdamW steps of forward
KL(p_policy || q_draft) at the positions the rollouts visited (`teacher.teacher_topk` for the
teacher's top-k log-probs, `loss.make_batch`, `loss.distill_loss`). `named_tensors()` then gives the draft's
new weights, for a `weight_sync.LearnerSync` (delta or full) to the engine's draft. "frozen" does nothing.

Departures from `train.train_draft`, which fits a draft once from scratch: the AdamW state persists
across follow updates (each update is a few steps, so fresh moments would make every update a warm-up),
the learning rate is constant (no wall-clock schedule), and a full-vocabulary draft is supported
(`distill_loss` with the identity head index). The draft trains in float32; the sync casts to the
rollout dtype. The draft's embedding is never trained (a built-in draft shares the target's, which
follows target updates; it is not among `named_tensors()`).
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

from rollout_ssd.config import require_positive_ints
from rollout_ssd.draft.build import trainable_parameters
from rollout_ssd.draft.drift import as_pairs
from rollout_ssd.draft.loss import distill_loss, head_index, make_batch
from rollout_ssd.draft.teacher import TeacherSample, teacher_topk
from rollout_ssd.models.decoder import Decoder

MODES = ("frozen", "follow")


@dataclass(frozen=True)
class FollowConfig:
    """mode: "frozen" | "follow". every_n_steps: distill on policy steps N, 2N, ... steps: AdamW steps per
    update; lr: constant learning rate; top_k: teacher log-probs kept per position; batch_tokens:
    completion positions per AdamW step (about); max_sequences: use at most this many of the step's
    rollouts (None: all); grad_clip: max gradient norm (0: off)."""

    mode: str = "frozen"
    every_n_steps: int = 1
    steps: int = 8
    lr: float = 1e-4
    top_k: int = 64
    batch_tokens: int = 2048
    max_sequences: Optional[int] = None
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"FollowConfig.mode must be one of {MODES}, got {self.mode!r}")
        require_positive_ints(self, ("every_n_steps", "steps", "top_k", "batch_tokens"))
        if self.max_sequences is not None and (not isinstance(self.max_sequences, int) or self.max_sequences < 1):
            raise ValueError(f"FollowConfig.max_sequences must be an integer >= 1 or None, got {self.max_sequences!r}")
        if not self.lr > 0:
            raise ValueError(f"FollowConfig.lr must be > 0, got {self.lr!r}")
        if self.weight_decay < 0 or self.grad_clip < 0:
            raise ValueError("FollowConfig.weight_decay and grad_clip must be >= 0")


@dataclass(frozen=True)
class FollowResult:
    step: int
    trained: bool  # False: frozen mode, not an N-th step, or no completion tokens
    optimizer_steps: int = 0
    positions: int = 0  # distinct visited positions distilled on
    first_loss: float = float("nan")  # KL(p || q) on the first batch, before the first update
    last_loss: float = float("nan")  # on the last batch, before the last update
    seconds: float = 0.0


class DraftFollower:
    """The learner-side draft (float32 Decoder) and its distillation state."""

    def __init__(self, draft: Decoder, config: FollowConfig = FollowConfig()):
        if config.mode == "follow" and draft.dtype != torch.float32:
            raise ValueError(f"follow mode trains the draft in float32 (the sync casts to the rollout dtype); "
                             f"got a {draft.dtype} draft")
        self.draft = draft
        self.config = config
        vocab = draft.cfg.vocab_size
        self._index = head_index(draft) if draft.head_token_ids is not None else \
            torch.arange(vocab, device=draft.embed.device)
        self._optimizer: Optional[torch.optim.Optimizer] = None
        self._rng = random.Random(config.seed)
        self.updates = 0

    def should_update(self, step: int) -> bool:
        return self.config.mode == "follow" and step >= 1 and step % self.config.every_n_steps == 0

    def step(self, step: int, rollouts: Sequence[Any], target: Optional[Decoder] = None,
             teacher: Optional[Sequence[TeacherSample]] = None) -> FollowResult:
        """After policy step `step` (1-based): distill toward `target` (the policy as it is NOW) at the
        positions `rollouts` visited ((prompt ids, completion ids) pairs or Rollouts), if this step is
        due. `teacher`: the teacher's top-k log-probs when the learner already has them (then `target`
        is not run)."""
        if not self.should_update(step):
            return FollowResult(step, False)
        t0 = time.perf_counter()
        if teacher is None:
            if target is None:
                raise ValueError("DraftFollower.step needs the current target (or precomputed teacher samples)")
            pairs = as_pairs(rollouts)
            if self.config.max_sequences is not None:
                pairs = pairs[: self.config.max_sequences]
            teacher = teacher_topk(target, [p + c for p, c in pairs], [len(p) for p, _ in pairs],
                                   top_k=min(self.config.top_k, target.cfg.vocab_size))
        samples = [s for s in teacher if s.num_completion > 0]
        if not samples:
            return FollowResult(step, False, seconds=time.perf_counter() - t0)
        batches = self._batches(samples)
        losses = self._train(batches)
        self.updates += 1
        return FollowResult(step, True, len(losses), sum(s.num_completion for s in samples), losses[0], losses[-1],
                            time.perf_counter() - t0)

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """The draft's weights to send (HF names): everything but the embedding when it is the target's
        (`shares_target_embedding`) and a restricted head's token ids (never trained)."""
        skip = {"lm_head.token_ids"}
        if self.draft.cfg.shares_target_embedding:
            skip.add("model.embed_tokens.weight")
        return [(n, t) for n, t in self.draft.hf_parameters().items() if n not in skip]

    # ------------------------------------------------------------------ internals
    def _batches(self, samples: list[TeacherSample]):
        """Groups of whole sequences with about batch_tokens completion positions each, shuffled."""
        order = list(range(len(samples)))
        self._rng.shuffle(order)
        groups, cur, n = [], [], 0
        for i in order:
            cur.append(samples[i])
            n += samples[i].num_completion
            if n >= self.config.batch_tokens:
                groups.append(cur)
                cur, n = [], 0
        if cur:
            groups.append(cur)
        return [make_batch(g, self.draft.embed.device) for g in groups]

    def _train(self, batches) -> list[float]:
        cfg = self.config
        params = trainable_parameters(self.draft)
        if self._optimizer is None:
            self._optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        losses = []
        for p in params:
            p.requires_grad_(True)
        try:
            for i in range(cfg.steps):
                loss = distill_loss(self.draft, batches[i % len(batches)], self._index)
                self._optimizer.zero_grad(set_to_none=True)
                loss.backward()
                if cfg.grad_clip:
                    torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
                self._optimizer.step()
                losses.append(float(loss.detach()))
        finally:
            for p in params:
                p.requires_grad_(False)
                p.grad = None
        return losses
