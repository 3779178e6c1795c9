"""Attention backends behind one interface.

A backend receives the batch's queries for the new tokens, the full (already written) keys/values of
the batch's slots up to the longest visible length, and a boolean visibility mask. There is one
backend today: PyTorch SDPA with the mask, on every device (on CUDA, SDPA itself dispatches to its
fused kernels). Tree masks (SSD's branch decoding, ssd/tree.py) go through it as well.

kernels/ holds a Triton tree-attention kernel for GPUs (with its torch reference); it is not wired in:
nothing in rollout_ssd imports it, and the CPU path never will (Triton runs on CPU only under its
interpreter, for tests). flash-attn is not used either.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Optional

import torch
import torch.nn.functional as F


class AttentionBackend(ABC):
    @abstractmethod
    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
                 scale: float) -> torch.Tensor:
        """q [B, Hq, T, D]; k, v [B, Hkv, L, D]; mask [B, 1, T, L] bool (True = visible) or None
        (every query sees every key). Returns [B, Hq, T, D]."""


class SDPABackend(AttentionBackend):
    def __call__(self, q, k, v, mask, scale):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                              enable_gqa=q.shape[1] != k.shape[1])


def default_backend(device: torch.device) -> AttentionBackend:
    """SDPA everywhere (the only backend); on CUDA PyTorch's SDPA dispatches to its fused kernels."""
    return SDPABackend()
