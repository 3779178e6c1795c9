"""The learner's arithmetic: bf16 autocast where the hardware has bf16 matmul units, float32 elsewhere.

`LearnerConfig.autocast`:
- "auto" (the default): bf16 autocast on a CUDA device that supports bf16, and on a CPU whose kind
  (`cpu_kind`) has bf16 dot-product units (amx, avx512_bf16); float32 elsewhere (a CPU without them
  widens every bf16 operand to float32, which is slower than float32 itself);
- "bf16": bf16 autocast on any device (torch's CPU autocast runs on any x86 CPU, slowly without the units);
- "off": float32.

Under autocast the matmuls (linear layers, attention, the LM head) take bf16 operands and accumulate in
float32; the parameters, their gradients and the optimizer state stay float32 (master weights), and the
learner casts logits to float32 before the log-softmax, so the losses and reductions are float32.
tests/test_learner_autocast.py bounds the loss's and the gradients' departure from float32's.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

AUTOCAST_MODES = ("auto", "bf16", "off")


def _bf16_units() -> bool:
    from rollout_ssd.kernels.cpu import BF16_UNITS, cpu_kind

    return cpu_kind() in BF16_UNITS


def resolve_autocast(mode: str, device: torch.device) -> Optional[torch.dtype]:
    """The autocast dtype `mode` gives on `device` (torch.bfloat16), or None for float32."""
    if mode not in AUTOCAST_MODES:
        raise ValueError(f"autocast must be one of {AUTOCAST_MODES}, got {mode!r}")
    device = torch.device(device)
    if mode == "off":
        return None
    if mode == "bf16":
        return torch.bfloat16
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else None
    return torch.bfloat16 if device.type == "cpu" and _bf16_units() else None


def autocast(dtype: Optional[torch.dtype], device: torch.device):
    """The context a forward runs in: torch.autocast to `dtype` on `device`'s type, or nothing (float32)."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=dtype)


def label(dtype: Optional[torch.dtype]) -> str:
    """`learner/autocast`: "bf16" or "off"."""
    return "off" if dtype is None else str(dtype).replace("torch.bfloat", "bf")
