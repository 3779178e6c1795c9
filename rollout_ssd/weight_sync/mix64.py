"""splitmix64's finaliser on int64 tensors, shared by the SSD draft's counter-based uniforms (ssd/rng.py)
and weight sync's device-side checksum (weight_sync/codec.py): wrapping products and logical shifts,
the same on every device."""

from __future__ import annotations

import torch

M64 = (1 << 64) - 1


def signed64(x: int) -> int:
    """x mod 2^64 as a signed 64-bit integer (what an int64 tensor holds)."""
    x &= M64
    return x - (1 << 64) if x >= 1 << 63 else x


GAMMA = signed64(0x9E3779B97F4A7C15)
_C1 = signed64(0xBF58476D1CE4E5B9)
_C2 = signed64(0x94D049BB133111EB)


def srl(z: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (z >> n) & ((1 << (64 - n)) - 1)


def mix64(z: torch.Tensor) -> torch.Tensor:
    z = (z ^ srl(z, 30)) * _C1
    z = (z ^ srl(z, 27)) * _C2
    return z ^ srl(z, 31)
