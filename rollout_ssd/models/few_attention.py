"""Attention of a few queries per row over a bf16 model's CPU KV cache: the C kernel in csrc/few_attention.c.

Why a kernel of our own: a decode, verify or tree step attends 1-16 queries per row, and on a CPU both
forms PyTorch offers cost several times their arithmetic there. The explicit softmax(q k^T) v casts every
layer's cache to float32 on every step and runs a dozen ops; PyTorch's CPU flash kernel is tiled for long
query blocks (at 24 rows x 1 query x 250 keys it takes about 0.5 ms a layer on an AMX Xeon, where the
keys and values are 4.6 MB) and rounds the probabilities to bf16 (bench/RESULTS.md, "SDPA on AMX"). Here
one task per (row, KV head) reads that head's keys and values once for all the queries that use them
(GQA) and keeps every step in float32: scores, a softmax over the visible keys, P @ V, each output
rounded once to bf16. Its error against float64 is the explicit form's: the output's rounding plus
float32 arithmetic (tests/test_few_attention.py).

Built on first use with the C compiler found (kernel_build.py), for AVX-512 or AVX2 with FMA; where
neither, the build fails or $ROLLOUT_SSD_FEW_ATTENTION=0, `available()` is False and attention.py keeps
the form cpu_backend picks per CPU kind. It serves bf16 queries over a bf16 or float32 cache (the float32
one `attention.cache_dtype` gives a bf16 model where bf16 is widened), outside compiled steps.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import subprocess
from pathlib import Path
from typing import Optional

import torch

from rollout_ssd.models import f32_rows, kernel_build

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "few_attention.c"
ISA_FLAGS = {"avx512": ("-mavx512f", "-mavx512bw", "-mfma"), "avx2": ("-mavx2", "-mfma")}
COMMON_FLAGS = ("-O3", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC")
MAX_HEAD_DIM = 256


def build(kind: str, compiler: Optional[str] = None) -> Path:
    """Compile csrc/few_attention.c for `kind` ("avx512" | "avx2") into the kernel cache; the library's path."""
    return kernel_build.build_library(f"few_attention_{kind}", SOURCE, (*COMMON_FLAGS, *ISA_FLAGS[kind]),
                                      compiler=compiler or kernel_build.default_compiler())


def load(kind: str):
    """The built library's C function for `kind` (argument types set)."""
    fn = ctypes.CDLL(str(build(kind))).few_attention
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, *[ctypes.c_long] * 6,
                   ctypes.c_void_p, ctypes.c_void_p, *[ctypes.c_int] * 6, ctypes.c_float, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


@functools.cache
def _kernel():
    """The loaded C function, or None where it cannot run here (logged once)."""
    kind = f32_rows.isa()  # the same vector extensions as the float32 rows kernel
    if kind is None:
        return None
    try:
        return load(kind)
    except (OSError, AttributeError, subprocess.CalledProcessError) as exc:
        log.warning("few-query attention kernel not built or not loaded (%s)", getattr(exc, "stderr", "") or exc)
        return None


_ON = os.environ.get("ROLLOUT_SSD_FEW_ATTENTION", "1") != "0"


def set_enabled(on: bool) -> None:
    """Turn the kernel's use on or off in this process (benchmarks and tests compare forms this way)."""
    global _ON
    _ON = bool(on)


def available() -> bool:
    return _ON and _kernel() is not None


def serves(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether `attend` takes this call: bf16 q over a bf16 or float32 CPU cache, head dim up to 256,
    outside a compile (inductor fuses the explicit form there), the kernel here and on."""
    return q.dtype == torch.bfloat16 and k.dtype in (torch.bfloat16, torch.float32) and q.is_cpu and k.is_cpu \
        and q.shape[-1] <= MAX_HEAD_DIM and not torch.compiler.is_compiling() and available()


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], scale: float,
           kernel=None) -> torch.Tensor:
    """softmax(q k^T * scale, masked) v for q [B, Hq, T, D] bf16, k, v [B, Hkv, L, D] (bf16 or float32, any
    strides with D contiguous; query head h reads KV head h // (Hq / Hkv)), mask [B, 1, T, L] bool (True =
    visible) or None; bf16 [B, Hq, T, D]. Needs `serves(q, k)` (kernel: a function from `load` to run
    instead of this CPU's, as tests do with the AVX2 build)."""
    b, hq, t, d = q.shape
    hkv, length = k.shape[1], k.shape[2]
    if q.dtype != torch.bfloat16 or k.dtype not in (torch.bfloat16, torch.float32) or d > MAX_HEAD_DIM \
            or not (q.is_cpu and k.is_cpu and v.is_cpu) or hq % hkv or v.shape != k.shape or v.dtype != k.dtype \
            or k.shape[0] != b or k.shape[3] != d or k.stride(3) != 1 or v.stride(3) != 1:
        raise ValueError(f"few_attention.attend: q {tuple(q.shape)} {q.dtype} does not fit k {tuple(k.shape)} "
                         f"{k.dtype} / v {tuple(v.shape)} {v.dtype} (strides {k.stride()}, {v.stride()}; CPU "
                         f"tensors, bf16 q, head dim <= {MAX_HEAD_DIM})")
    q = q.contiguous()
    if mask is not None:
        if mask.dtype != torch.bool or tuple(mask.shape) != (b, 1, t, length):
            raise ValueError(f"few_attention.attend: mask {tuple(mask.shape)} {mask.dtype}, expected ({b}, 1, {t}, "
                             f"{length}) bool")
        mask = mask[:, 0].contiguous()
    out = torch.empty(b, hq, t, d, dtype=torch.bfloat16)
    fn = kernel or _kernel()
    if fn(q.data_ptr(), k.data_ptr(), v.data_ptr(), int(k.dtype == torch.float32), *k.stride()[:3], *v.stride()[:3],
          None if mask is None else mask.data_ptr(), out.data_ptr(), b, hq, hkv, t, length, d, scale,
          torch.get_num_threads()):
        raise MemoryError(f"few_attention.attend: no memory for the float32 scratch of {b} x {hkv} tasks")
    return out
