"""The distillation loss: forward KL(p || q) per completion position, and its batches.

p is the teacher's top-k probabilities restricted to tokens the draft's head has and renormalised
over them (the tail mass outside the top-k and outside the head is dropped: q can never match it, and
at the optimum of the cross-entropy with unnormalised weights q equals the renormalised p anyway);
q is the draft's softmax over its head. `distill_loss` is what training (train.py) and the follow mode
(follow.py) minimise.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from rollout_ssd.draft.teacher import TeacherSample
from rollout_ssd.models.decoder import Decoder


@dataclass
class Batch:
    tokens: torch.Tensor     # [B, T] inputs (right-padded)
    rows: torch.Tensor       # [N] batch row of each supervised position
    cols: torch.Tensor       # [N] input position whose hidden state predicts it
    teacher_ids: torch.Tensor   # [N, k] int64
    teacher_logp: torch.Tensor  # [N, k] float32

    def to(self, device: torch.device | str) -> "Batch":
        return Batch(*(getattr(self, f.name).to(device, non_blocking=True) for f in fields(self)))


def make_batch(samples: Sequence[TeacherSample], device: torch.device | str = "cpu") -> Batch:
    """The samples' inputs and teacher rows as one batch on `device` (the draft's: built on the host,
    moved once)."""
    t_max = max(len(s.token_ids) - 1 for s in samples)
    tokens = torch.zeros(len(samples), t_max, dtype=torch.long)
    rows, cols = [], []
    for b, s in enumerate(samples):
        tokens[b, :len(s.token_ids) - 1] = torch.tensor(s.token_ids[:-1])
        n = s.num_completion
        rows.append(torch.full((n,), b))
        cols.append(torch.arange(s.prompt_len - 1, s.prompt_len - 1 + n))
    ids = torch.cat([s.topk_ids.to(device) for s in samples]).long()
    logp = torch.cat([s.topk_logp.to(device) for s in samples]).float()
    return Batch(tokens.to(device), torch.cat(rows).to(device), torch.cat(cols).to(device), ids, logp)


def head_index(draft: Decoder) -> torch.Tensor:
    """vocabulary id -> row of the restricted head, -1 where the head lacks the token. [V], on the
    draft's device."""
    device = draft.embed.device
    index = torch.full((draft.cfg.vocab_size,), -1, dtype=torch.long, device=device)
    index[draft.head_token_ids] = torch.arange(len(draft.head_token_ids), device=device)
    return index


def distill_loss(draft: Decoder, batch: Batch, index: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Mean over positions of KL(p || q): p = teacher top-k restricted to the head, renormalised;
    q = the draft's softmax over its head. The batch is moved to the draft's device (a no-op when
    make_batch put it there)."""
    index = head_index(draft) if index is None else index
    batch = batch.to(draft.embed.device)
    hidden = draft.forward_train(batch.tokens)[batch.rows, batch.cols]      # [N, H]
    logq = torch.log_softmax(F.linear(hidden, draft.lm_head).float(), -1)   # [N, head]
    cols = index[batch.teacher_ids]                                        # [N, k]
    valid = cols >= 0
    logp = batch.teacher_logp.masked_fill(~valid, float("-inf"))
    logp = logp - torch.logsumexp(logp, -1, keepdim=True)                   # renormalise on the support
    p = logp.exp()
    logq_k = logq.gather(1, cols.clamp(min=0))
    kl = (p * (logp.masked_fill(~valid, 0.0) - logq_k)).masked_fill(~valid, 0.0).sum(-1)
    return kl[valid.any(-1)].mean()



@torch.no_grad()
def eval_kl(draft: Decoder, samples: Sequence[TeacherSample]) -> float:
    """distill_loss averaged over `samples` (e.g. held-out ones)."""
    index = head_index(draft)
    total = count = 0.0
    for start in range(0, len(samples), 8):
        batch = make_batch(samples[start:start + 8], draft.embed.device)
        total += float(distill_loss(draft, batch, index)) * len(batch.rows)
        count += len(batch.rows)
    return total / max(count, 1)
