"""The int4 rows kernel's weight layout (csrc/int4_rows.c): `pack` makes it, `dequantize` reads it back.

The kernel itself lives in the layer kernel's library (layer_kernel.py: `int4_linear`, `int4_available`),
which includes int4_rows.c; rollout_ssd/models/quant.py makes int4 drafts whose linears run on it.
"""

from __future__ import annotations

from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("csrc") / "int4_rows.c"
GROUP = 32  # int4_rows.c's group of columns sharing a step and a minimum (its layout)
MAX_ROWS = 32  # rows of an int4 linear int4_rows.c takes (tested up to them; past them, a prefill)


def _nibble_order() -> tuple[torch.Tensor, torch.Tensor]:
    """(output, k parity) of each nibble of a pair's 64 bytes, [2 (low, high), 64]: byte b = 16 i + r holds
    output 4 i + (r % 8) // 2 (+ 16 where r >= 8) at parity r % 2, the high nibble the output 32 past it
    (int4_rows.c: what its unpacklo / unpackhi of each 128-bit lane put in output order)."""
    b = torch.arange(64)
    i, r = b // 16, b % 16
    out = 4 * i + (r % 8) // 2 + 16 * (r >= 8)
    return torch.stack((out, out + 32)), torch.stack((r % 2, r % 2))


_NIBBLE_OUTPUTS, _NIBBLE_PARITY = _nibble_order()


def pack(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] (K a multiple of 32) in csrc/int4_rows.c's layout: (codes uint8 [ceil(N / 64), K / 2, 64],
    scales bf16 [ceil(N / 64), K / 32, 2, 64]). Per group of 32 columns of a row: step s = (max - min) / 15
    and minimum lo, both rounded to bf16 first, codes round((w - lo) / s) in 0..15, so w ~ codes * s + lo
    (quant.int4_codes' rounding, on the bf16 step and minimum the kernel reads)."""
    n, k = w.shape
    if k % GROUP:
        raise ValueError(f"int4_rows.pack needs a multiple of {GROUP} columns, got a weight of shape {tuple(w.shape)}")
    tiles = -(-n // 64)
    g = torch.nn.functional.pad(w.detach().float(), (0, 0, 0, tiles * 64 - n)).reshape(tiles * 64, k // GROUP,
                                                                                     GROUP)
    lo = g.amin(-1).to(torch.bfloat16)
    step = ((g.amax(-1) - lo.float()) / 15).to(torch.bfloat16)
    safe = step.float().clamp(min=torch.finfo(torch.float32).tiny)[..., None]
    codes = ((g - lo.float()[..., None]) / safe).round().clamp(0, 15).to(torch.uint8).reshape(tiles, 64, k // 2, 2)
    codes = codes.permute(0, 2, 1, 3)[:, :, _NIBBLE_OUTPUTS, _NIBBLE_PARITY]  # [tiles, pairs, 2 nibbles, 64 bytes]
    packed = (codes[:, :, 0] | (codes[:, :, 1] << 4)).contiguous()
    scales = torch.stack((step, lo), -1).reshape(tiles, 64, k // GROUP, 2).permute(0, 2, 3, 1).contiguous()
    return packed, scales


def dequantize(packed: torch.Tensor, scales: torch.Tensor, n: int) -> torch.Tensor:
    """The float32 [n, K] weight `pack`'s output stands for (the reference its kernel is tested against)."""
    tiles, pairs, _ = packed.shape
    nibbles = torch.stack((packed & 15, packed >> 4), 2)  # [tiles, pairs, 2, 64]
    codes = torch.zeros(tiles, pairs, 64, 2, dtype=torch.uint8)
    codes[:, :, _NIBBLE_OUTPUTS, _NIBBLE_PARITY] = nibbles
    codes = codes.permute(0, 2, 1, 3).reshape(tiles * 64, pairs * 2).float()
    step, lo = (scales[:, :, i].permute(0, 2, 1).reshape(tiles * 64, -1).float() for i in (0, 1))
    w = codes.reshape(tiles * 64, -1, GROUP) * step[..., None] + lo[..., None]
    return w.reshape(tiles * 64, -1)[:n]
