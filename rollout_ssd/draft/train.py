"""Fitting a draft to its teacher once: AdamW on the distillation loss under a wall-clock budget.

AdamW, linear warm-up then a cosine decay driven by elapsed wall-clock time (or by steps when
max_steps is set), so a time budget ends at the bottom of the schedule. Batches are whole sequences,
bucketed by length, of about batch_tokens completion positions each. The follow mode (follow.py)
reuses the loss for a few steps at a time with a persistent optimizer instead.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from rollout_ssd.draft.build import trainable_parameters
from rollout_ssd.draft.checkpoint import MAX_CHECKPOINT_BYTES, check_checkpoint_size
from rollout_ssd.draft.loss import distill_loss, head_index, make_batch
from rollout_ssd.draft.teacher import TeacherSample
from rollout_ssd.models.decoder import Decoder


@dataclass(frozen=True)
class DistillConfig:
    lr: float = 5e-4
    min_lr_ratio: float = 0.05
    warmup_steps: int = 20
    weight_decay: float = 0.0
    batch_tokens: int = 4096   # completion positions per step (about)
    minutes: float = 10.0      # wall-clock budget; the cosine schedule follows elapsed time
    max_steps: Optional[int] = None
    grad_clip: float = 1.0
    seed: int = 0
    # the bfloat16 checkpoint's size limit, checked before the first step (None: no limit)
    max_checkpoint_bytes: Optional[int] = MAX_CHECKPOINT_BYTES

    def __post_init__(self):
        if self.lr <= 0 or self.batch_tokens < 1 or self.minutes <= 0:
            raise ValueError("DistillConfig: lr, batch_tokens and minutes must be positive")
        limit = self.max_checkpoint_bytes
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
            raise ValueError(f"DistillConfig.max_checkpoint_bytes must be an integer >= 1 or None, got {limit!r}")



@dataclass
class TrainStats:
    steps: int
    seconds: float
    positions_seen: int
    first_loss: float
    last_loss: float   # mean of the last 20 steps


def _batches(samples: Sequence[TeacherSample], batch_tokens: int, rng: random.Random, device: torch.device):
    """Endless epochs of length-bucketed batches holding about batch_tokens completion positions, on
    `device`."""
    while True:
        order = sorted(range(len(samples)), key=lambda i: (len(samples[i].token_ids), rng.random()))
        groups, cur, n = [], [], 0
        for i in order:
            cur.append(i)
            n += samples[i].num_completion
            if n >= batch_tokens:
                groups.append(cur)
                cur, n = [], 0
        if cur:
            groups.append(cur)
        rng.shuffle(groups)
        for g in groups:
            yield make_batch([samples[i] for i in g], device)


def train_draft(draft: Decoder, samples: Sequence[TeacherSample], config: DistillConfig,
                log_every: int = 10, on_log: Optional[Callable[[dict], None]] = None) -> TrainStats:
    """AdamW on distill_loss until config.minutes (or max_steps) run out. Refuses, before the first
    step, a draft whose bfloat16 checkpoint would be over config.max_checkpoint_bytes."""
    check_checkpoint_size(draft.cfg, torch.bfloat16, config.max_checkpoint_bytes)
    params = trainable_parameters(draft)
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay, betas=(0.9, 0.98))
    index = head_index(draft)
    rng = random.Random(config.seed)
    budget = config.minutes * 60.0
    start = time.monotonic()
    losses: list[float] = []
    seen = step = 0
    for batch in _batches(samples, config.batch_tokens, rng, draft.embed.device):
        elapsed = time.monotonic() - start
        if elapsed >= budget or (config.max_steps is not None and step >= config.max_steps):
            break
        frac = elapsed / budget if config.max_steps is None else step / config.max_steps
        cosine = config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0)))
        lr = config.lr * min(1.0, (step + 1) / config.warmup_steps) * cosine
        for g in opt.param_groups:
            g["lr"] = lr
        loss = distill_loss(draft, batch, index)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if config.grad_clip:
            torch.nn.utils.clip_grad_norm_(params, config.grad_clip)
        opt.step()
        step += 1
        seen += len(batch.rows)
        losses.append(float(loss.detach()))
        if on_log is not None and (step % log_every == 0 or step == 1):
            on_log({"step": step, "loss": sum(losses[-log_every:]) / len(losses[-log_every:]), "lr": lr,
                    "positions": seen, "seconds": time.monotonic() - start})
    for p in params:
        p.requires_grad_(False)
        p.grad = None
    tail = losses[-20:] or [float("nan")]
    return TrainStats(step, time.monotonic() - start, seen, losses[0] if losses else float("nan"),
                      sum(tail) / len(tail))
