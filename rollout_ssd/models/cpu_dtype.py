"""What `dtype="auto"` loads on the machine found, and why (one line for logs and the demo).

bfloat16 where bf16 matmuls run natively (a CUDA device, a CPU with bf16 dot-product units) or at memory
speed through the bf16 rows kernel's widened build (AVX-512 without bf16 units); float32 elsewhere, where
PyTorch would emulate bf16. Measurements behind the choice: bench/RESULTS.md, "A sixth CPU kind".
"""

from __future__ import annotations

import logging

import torch

from rollout_ssd.kernels import bf16_rows
from rollout_ssd.kernels.cpu import BF16_UNITS, cpu_kind

log = logging.getLogger(__name__)


def native_bf16() -> bool:
    """Whether bfloat16 matmuls run natively here: a CUDA device, or a CPU with bf16 dot-product units
    (AMX or avx512_bf16). oneDNN also says so on AVX-512 CPUs without them (`_is_mkldnn_bf16_supported`),
    where it widens every bf16 operand to float32 in registers: prefill and decode measured slower in bf16
    than in float32 there (bench/RESULTS.md, "A sixth CPU kind"), so those count as not native."""
    return torch.cuda.is_available() or cpu_kind() in BF16_UNITS


def widened_bf16() -> bool:
    """Whether bf16 runs at memory speed without bf16 units: CPU kind "avx512" (no CUDA) with the bf16 rows
    kernel's widened build, where decode and verify measured faster in bf16 than in float32 (RESULTS.md)."""
    return not torch.cuda.is_available() and cpu_kind() == "avx512" and bf16_rows.variant() == "widened" \
        and bf16_rows.available()


def auto_dtype() -> torch.dtype:
    """What `dtype="auto"` loads: bfloat16 where bf16 matmuls run natively or `widened_bf16`, else float32
    (PyTorch would emulate bf16: prefill and batched decode several times slower than float32)."""
    log.info("dtype auto: %s", describe_auto_dtype())
    return torch.bfloat16 if native_bf16() or widened_bf16() else torch.float32


def describe_auto_dtype() -> str:
    """One line saying what dtype "auto" picks on this machine and why."""
    where = "CUDA" if torch.cuda.is_available() else f"CPU {cpu_kind()}"
    if native_bf16():
        return f"bfloat16 ({where}: native bf16 matmuls)"
    if widened_bf16():
        return f"bfloat16 ({where}: no bf16 units; the bf16 rows kernel widens bf16 weights in registers, half float32's bytes)"
    return f"float32 ({where}: no bf16 dot-product units, bf16 matmuls would be emulated)"
