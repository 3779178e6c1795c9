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
import os
from pathlib import Path
from typing import Optional

import torch

from rollout_ssd.kernels import f32_rows, kernel_build

SOURCE = Path(__file__).with_name("csrc") / "few_attention.c"
ISA_FLAGS = {"avx512": ("-mavx512f", "-mfma"), "avx2": ("-mavx2", "-mfma")}  # (its intrinsics: AVX-512F only)
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
    return kernel_build.load_or_none("few-query attention kernel", load, f32_rows.isa(),  # f32_rows' extensions
                                     "attention keeps PyTorch's forms")


_ON = os.environ.get("ROLLOUT_SSD_FEW_ATTENTION", "1") != "0"


def set_enabled(on: bool) -> None:
    """Turn the kernel's use on or off in this process (benchmarks and tests compare forms this way)."""
    global _ON
    _ON = bool(on)


def available() -> bool:
    return _ON and _kernel() is not None


def _misfit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor]) -> Optional[str]:
    """What the C kernel cannot take in this call (None: it can)."""
    if q.dim() != 4 or k.dim() != 4 or q.dtype != torch.bfloat16 or k.dtype not in (torch.bfloat16, torch.float32):
        return "bf16 q [B, Hq, T, D] over a bf16 or float32 k, v [B, Hkv, L, D]"
    b, hq, t, d = q.shape
    if not (q.is_cpu and k.is_cpu and v.is_cpu and (mask is None or mask.is_cpu)):
        return "CPU tensors"
    if not 0 < d <= MAX_HEAD_DIM or k.shape[1] < 1 or hq % k.shape[1] or v.shape != k.shape or v.dtype != k.dtype \
            or k.shape[0] != b or k.shape[3] != d or k.stride(3) != 1 or v.stride(3) != 1:
        return f"k and v alike, D contiguous, Hq a multiple of Hkv, head dim 1..{MAX_HEAD_DIM}"
    if mask is not None and (mask.dtype != torch.bool or tuple(mask.shape) != (b, 1, t, k.shape[2])):
        return f"a bool mask [B, 1, T, L] = ({b}, 1, {t}, {k.shape[2]})"
    return None


def serves(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor]) -> bool:
    """Whether `attend` takes this call: a shape and dtypes it fits (bf16 q over a bf16 or float32 CPU cache,
    head dim up to 256), outside a compile (inductor fuses the explicit form there), the kernel here and on."""
    return not torch.compiler.is_compiling() and available() and _misfit(q, k, v, mask) is None


def try_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
               scale: float) -> Optional[torch.Tensor]:
    """`attend`'s result where `serves` holds, else None (the caller's other form): the checks made once."""
    return _run(_kernel(), q, k, v, mask, scale) if serves(q, k, v, mask) else None


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], scale: float,
           kernel=None) -> torch.Tensor:
    """softmax(q k^T * scale, masked) v for q [B, Hq, T, D] bf16, k, v [B, Hkv, L, D] (bf16 or float32, any
    strides with D contiguous; query head h reads KV head h // (Hq / Hkv)), mask [B, 1, T, L] bool (True =
    visible) or None; bf16 [B, Hq, T, D]. Needs `available()` (kernel: a function from `load` to run
    instead of this CPU's, as tests do with the AVX2 build); a ValueError names what does not fit."""
    problem = _misfit(q, k, v, mask)
    if problem is not None:
        raise ValueError(f"few_attention.attend: q {tuple(q.shape)} {q.dtype}, k {tuple(k.shape)} {k.dtype}, v "
                         f"{tuple(v.shape)} {v.dtype} (strides {k.stride()}, {v.stride()}), mask "
                         f"{None if mask is None else (tuple(mask.shape), mask.dtype)}: needs {problem}")
    fn = kernel or _kernel()
    if fn is None:
        raise RuntimeError("few_attention.attend: the kernel does not run here (few_attention.available())")
    return _run(fn, q, k, v, mask, scale)


def _run(fn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], scale: float) -> torch.Tensor:
    """The C call on operands `_misfit` passed."""
    b, hq, t, d = q.shape
    hkv, length = k.shape[1], k.shape[2]
    q = q.contiguous()
    mask = None if mask is None else mask[:, 0].contiguous()
    out = torch.empty(b, hq, t, d, dtype=torch.bfloat16)
    if fn(q.data_ptr(), k.data_ptr(), v.data_ptr(), int(k.dtype == torch.float32), *k.stride()[:3], *v.stride()[:3],
          None if mask is None else mask.data_ptr(), out.data_ptr(), b, hq, hkv, t, length, d, scale,
          torch.get_num_threads()):
        raise MemoryError(f"few_attention.attend: no memory for the float32 scratch of {b} x {hkv} tasks")
    return out
