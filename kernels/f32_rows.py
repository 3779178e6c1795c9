"""A few rows times a float32 weight, the weight streamed once for all rows: the C kernel in csrc/f32_rows.c.

Why a kernel of our own: at a few rows (a verify of K+1 tokens, a draft's tree step, a small batch's
decode) a float32 linear is bound by reading its weight, yet MKL's few-row sgemm, in either GEMM form,
and inductor's templates cost a 4-row verify about 1.3-1.5 one-row steps on an AVX-512 Xeon (bench/
RESULTS.md, "A sixth CPU kind", "The float32 rows kernel"). Here each weight vector loaded feeds one fused
multiply-add per row: 2..8 rows cost 1.0-1.3 of one row, and up to 24 rows it beats MKL's forms
(on SmolLM2-135M's shapes; a row group past the first reads a tile from L2, which a much larger model's
tiles outgrow).

What it computes: x [m, k] @ w.T (+ bias) in float32 over a copy of w in the kernel's blocked layout
(`pack`: tiles of `tile()` outputs, one line per k). Each output's sum is one fused multiply-add per k,
k ascending, whatever the row count, the other rows and the thread count, so a row's result does not
depend on the batch it is in. It is not bitwise F.linear (MKL sums in another order); tests bound it
against a float64 reference.

Built on first use with the C compiler found (kernel_build.py) for the CPU's vector extension:
AVX-512F where the CPU has it, else AVX2 with FMA; where neither, no compiler is found or the build
fails, `available()` is False and the float32 linears keep MKL. Where it runs is cpu_backend's choice
(`F32_ROWS_KERNEL_ROWS`, per CPU kind). $ROLLOUT_SSD_F32_ROWS=0 (or `set_enabled(False)`) turns it off.
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from rollout_ssd.kernels import kernel_build
from rollout_ssd.kernels.cpu import cpu_flags

SOURCE = Path(__file__).with_name("csrc") / "f32_rows.c"
ISA_FLAGS = {"avx512": ("-mavx512f", "-mfma"), "avx2": ("-mavx2", "-mfma")}
COMMON_FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC")
TILES = {"avx512": 64, "avx2": 32}  # outputs per tile of the packed layout (csrc/f32_rows.c's TILE)


def isa() -> Optional[str]:
    """The vector extension the kernel is built for on this CPU: "avx512", "avx2" (with FMA), or None."""
    flags = cpu_flags()
    if "avx512f" in flags:
        return "avx512"
    return "avx2" if {"avx2", "fma"} <= flags else None


def build(kind: str, compiler: Optional[str] = None) -> Path:
    """Compile csrc/f32_rows.c for `kind` ("avx512" | "avx2") into the kernel cache; the library's path."""
    return kernel_build.build_library(f"f32_rows_{kind}", SOURCE, (*COMMON_FLAGS, *ISA_FLAGS[kind]),
                                      compiler=compiler or kernel_build.default_compiler())


def load(kind: str):
    """The built library's C function for `kind` (argument types set)."""
    fn = getattr(ctypes.CDLL(str(build(kind))), f"f32_rows_linear_{kind}")
    fn.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_long,
                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    fn.restype = ctypes.c_int  # the tile it was built with
    built = fn(None, 0, 0, None, 0, None, None, 1)  # no rows: returns its TILE, touches nothing
    if built != TILES[kind]:  # pack() lays copies out for TILES[kind]: a mismatch would read past them
        raise OSError(f"the {kind} float32 rows kernel was built with tiles of {built}, expected {TILES[kind]}")
    return fn


@functools.cache
def _kernel():
    """(the loaded C function, its tile), or None where the kernel cannot run here (logged once)."""
    kind = isa()
    fn = kernel_build.load_or_none("float32 rows kernel", load, kind, "float32 linears keep MKL")
    return None if fn is None else (fn, TILES[kind])


_ON = os.environ.get("ROLLOUT_SSD_F32_ROWS", "1") != "0"


def set_enabled(on: bool) -> None:
    """Turn the kernel's use on or off in this process (benchmarks compare it with MKL this way)."""
    global _ON
    _ON = bool(on)


def available() -> bool:
    """Whether `linear` runs here: the CPU has AVX-512F or AVX2 with FMA, the kernel built, not turned off."""
    return _ON and _kernel() is not None


def tile() -> int:
    """Outputs per tile of this CPU's packed layout. Needs `available()`."""
    return _kernel()[1]


def pack(w: torch.Tensor, tile_width: Optional[int] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """w [n, k] float32 (any strides) in the kernel's layout: tiles of `tile_width` (default: this CPU's)
    outputs, n padded with zero rows, one line per k index, [ceil(n / tile), k, tile], 64-byte aligned.
    out: an earlier pack of a weight of w's shape, written over in place (no new memory) and returned."""
    width = tile_width or tile()
    n, k = w.shape
    tiles = -(-n // width)
    if out is not None:
        if tuple(out.shape) != (tiles, k, width) or out.dtype != torch.float32:
            raise ValueError(f"f32_rows.pack: out {tuple(out.shape)} {out.dtype} is not the pack of {tuple(w.shape)}")
        full, src = n // width, w.detach()
        out[:full].copy_(src[:full * width].reshape(full, width, k).transpose(1, 2))
        if full < tiles:  # the last tile's outputs, then its zero padding (as written by the first pack)
            out[full, :, :n - full * width].copy_(src[full * width:].t())
        return out
    padded = F.pad(w.detach().float(), (0, 0, 0, tiles * width - n))
    packed = padded.view(tiles, width, k).permute(0, 2, 1).contiguous()
    if packed.data_ptr() % 64:  # torch's CPU allocator aligns to 64 bytes; keep the promise regardless
        raw = torch.empty(packed.numel() + 16, dtype=torch.float32)
        start = (-raw.data_ptr() // 4) % 16
        packed = raw[start:start + packed.numel()].view_as(packed).copy_(packed)
    return packed


def linear(x: torch.Tensor, packed: torch.Tensor, n: int, bias: Optional[torch.Tensor] = None,
           kernel=None) -> torch.Tensor:
    """x [m, k] float32 @ w.T (+ bias) -> [m, n] float32, w given as `pack(w)`. Needs `available()`
    (kernel: (function, tile) to run instead of this CPU's, as tests do with the AVX2 build)."""
    fn, width = kernel or _kernel()
    m, k = x.shape
    if x.dtype != torch.float32 or packed.dtype != torch.float32 or packed.dim() != 3 \
            or tuple(packed.shape[1:]) != (k, width) or packed.shape[0] * width < n:
        raise ValueError(f"f32_rows.linear: x {tuple(x.shape)} {x.dtype} does not fit packed "
                         f"{tuple(packed.shape)} {packed.dtype} with n={n} (tile {width})")
    kernel_build.check_operands("f32_rows", x, packed, n, bias)
    x = x.contiguous()
    b = None if bias is None else bias.detach().float().contiguous()
    out = torch.empty(m, n, dtype=torch.float32)
    fn(x.data_ptr(), m, k, packed.data_ptr(), n, None if b is None else b.data_ptr(), out.data_ptr(),
       torch.get_num_threads())
    return out


def warm(weights) -> None:
    """Make the kernel's copies of (weight, bias, WeightCopies, name) entries (models/weight_copies.py, `linear_weights`)
    now, as `cpu_backend.linear` would on a first verify (a fresh engine's first call would pay them)."""
    with torch.inference_mode():
        for w, _, copies, name in weights:
            copies.get(name + ":f32rows", w, pack, in_place=True)
