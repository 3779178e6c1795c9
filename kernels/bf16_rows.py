"""A few rows times a bf16 weight at memory speed on AVX-512 CPUs: the C kernel in csrc/bf16_rows.c.

Why a kernel of our own: at a few rows (a decode step, a verify of K+1 tokens, a draft's tree step) a
linear is bound by reading its weight, and every CPU kernel found for bf16 (oneDNN's packed linear,
inductor's reductions and GEMM templates) converts each weight element to float32 and multiplies in
float32: from 2 rows on they are compute-bound at under half the memory's read speed, so a verify cost
about two decode steps (bench/RESULTS.md, "bf16 kernel for a few rows"). Three builds of one source, by
what the CPU has (`variant`):
- "amx", where the CPU has AMX (Sapphire Rapids and later): the tile unit multiplies up to 16 rows x 32 k
  by 16 outputs in one instruction, so 1 to 16 rows cost the same pass over the weight, at the memory's
  read speed (the dot build's code where k is not a multiple of 32, or where Linux does not lend the
  process the tiles);
- "dot", with avx512_bf16: its dot instruction multiplies bf16 pairs as they are, 32 multiply-adds per
  instruction;
- "widened", AVX-512 without bf16 units: each line of bf16 pairs is widened to float32 in registers (a
  shift and a mask) and multiplied in float32. The weight is still read as bf16, half a float32 model's
  bytes, which is what bounds a few-row linear; oneDNN's emulated bf16 on such a CPU ran slower than
  float32, prefill three times slower than this kernel (bench/RESULTS.md, "bf16 without bf16 units").

What it computes: x [m, k] @ w.T (+ bias), accumulated in float32 and rounded once to bf16, over a copy
of w in the kernel's blocked layout (`pack`). Each output's sum runs over k in one fixed order, whatever
the row count and the other rows, so a row's result does not depend on the batch it is in (oneDNN's
kernels change their blocking with the row count). It is not bitwise F.linear (another summation
order); tests bound it against a float64 reference.

How it is built: with the C compiler found (`cc`, or $CC) on first use, into the kernel cache
(kernel_build.py), keyed by the source and the flags, and loaded with ctypes; its
OpenMP threads are torch's own (the library links libgomp.so.1, which torch has loaded). Where the CPU
has no AVX-512 (F, BW, VL), no compiler is found, or the build or the load fails, `available()` is False
and the CPU backend keeps oneDNN's packed kernels (or F.linear). $ROLLOUT_SSD_BF16_ROWS=0 (or
`set_enabled(False)`) turns it off.

Inside a compiled step the kernel is the op `rollout_ssd::bf16_rows`, which inductor calls as an opaque
kernel over the packed copy (a live step's input, so it follows weight updates; a frozen step holds its
copies). The op's CPU kernel is C++ (csrc/bf16_rows_op.cpp, over the same C code, built beside the C
library with the C++ compiler, `c++` or $CXX, against torch's stable C ABI), so a step's hundred-odd
calls do not each pass through Python; where that build or load fails, or $ROLLOUT_SSD_BF16_ROWS_OP=0,
the op falls back to `linear` (same results, a slower call).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from rollout_ssd.kernels import kernel_build
from rollout_ssd.kernels.cpu import cpu_flags

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "bf16_rows.c"
OP_SOURCE = SOURCE.with_name("bf16_rows_op.cpp")
COMMON_FLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-fopenmp", "-shared", "-fPIC")
VARIANT_FLAGS = {"amx": ("-mavx512bf16", "-mamx-tile", "-mamx-bf16"), "dot": ("-mavx512bf16",),
                 "widened": ("-mfma",)}  # past COMMON_FLAGS, by `variant()`
SYMBOLS = {"amx": "bf16_rows_linear_amx", "dot": "bf16_rows_linear", "widened": "bf16_rows_linear_widened"}
TILE = 64  # outputs per tile of the packed layout (csrc/bf16_rows.c)
OP_TORCH = "2.10"  # the stable ABI version csrc/bf16_rows_op.cpp targets (TORCH_TARGET_VERSION in _op_command)


def cpu_has_avx512_bf16() -> bool:
    return {"avx512_bf16", "avx512bw", "avx512vl"} <= cpu_flags()


def variant() -> Optional[str]:
    """The build this CPU should run: "amx" (AMX's tile unit where k is a multiple of 32, the dot build's
    code elsewhere), "dot" (avx512_bf16's dot instruction), "widened" (AVX-512 F/BW/VL with FMA, no bf16
    units: bf16 widened to float32 in registers), or None (no AVX-512: the kernel is off). Where the amx
    build fails (a compiler without AMX intrinsics) the dot one runs: `loaded_variant`."""
    if cpu_has_avx512_bf16():
        return "amx" if {"amx_bf16", "amx_tile"} <= cpu_flags() else "dot"
    return "widened" if {"avx512f", "avx512bw", "avx512vl", "fma"} <= cpu_flags() else None


def loaded_variant() -> Optional[str]:
    """The build `linear` runs in this process: `variant()`, or "dot" where the amx build did not build or
    load; None where the kernel does not run."""
    return _LOADED[0] if _kernel() is not None else None


def flags(kind: str) -> tuple[str, ...]:
    """The compiler flags of the `kind` build ("amx" | "dot" | "widened")."""
    return (*COMMON_FLAGS, *VARIANT_FLAGS[kind])


def _torch_root() -> Path:
    return Path(torch.__file__).parent


def _op_command() -> tuple[str, ...]:
    """The C++ op library's flags past the C kernel's: torch's headers, its library (the stable ABI's C
    functions), the ABI version the source targets (OP_TORCH: every function it calls)."""
    root = _torch_root()
    major, minor = (int(part) for part in OP_TORCH.split("."))
    return ("-std=c++17", f"-I{root / 'include'}", f"-DTORCH_TARGET_VERSION=0x{major:02x}{minor:02x}{0:012x}",
            f"-L{root / 'lib'}", "-ltorch_cpu", f"-Wl,-rpath,{root / 'lib'}")


def default_compiler(op: bool = False) -> str:
    """The compiler `build` runs: for the C kernel $CC, else `cc` or `gcc`; for the op's C++ kernel
    (op) $CXX, else `c++` or `g++`."""
    return kernel_build.default_compiler(cpp=op)


def build(compiler: Optional[str] = None, op: bool = False, kind: Optional[str] = None) -> Path:
    """Compile csrc/bf16_rows.c (op: csrc/bf16_rows_op.cpp, the op's C++ kernel over the same C code,
    with a C++ compiler) for `kind` (default: this CPU's `variant()`) into the kernel cache
    (kernel_build.py), once per source, flags and (op) torch version, and return the library's path.
    Raises CalledProcessError / OSError, ValueError where there is no kind to build."""
    kind = kind or variant()
    if kind not in VARIANT_FLAGS:
        raise ValueError(f"bf16_rows.build: no build for {kind!r} (this CPU has no AVX-512 F/BW/VL)")
    if op:
        return kernel_build.build_library(f"bf16_rows_op_{kind}", OP_SOURCE, flags(kind), _op_command(),
                                          SOURCE.read_bytes() + torch.__version__.encode(), compiler or default_compiler(op))
    return kernel_build.build_library(f"bf16_rows_{kind}", SOURCE, flags(kind), compiler=compiler or default_compiler())


def load(kind: str):
    """The `kind` build's C function, argument types set (tests run the widened build where the dot one
    is this CPU's)."""
    lib = ctypes.CDLL(str(build(kind=kind)))
    fn = getattr(lib, SYMBOLS[kind])
    fn.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_long,
                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    fn.restype = ctypes.c_int  # 0, or -1: the widened build could not allocate its float32 copy of x
    fn.amx_ready = lib.bf16_rows_amx_ready if kind == "amx" else None  # 1 where the OS lent the tiles
    return fn


@functools.cache
def _kernel():
    """The loaded C function, or None where the kernel cannot run here (logged once)."""
    global ROWS_CAP
    kinds = {"amx": ["amx", "dot"]}.get(variant(), [variant()])
    for kind in kinds:
        then = "the dot build next" if kind != kinds[-1] else "bf16 linears keep oneDNN's kernels"
        fn = kernel_build.load_or_none("bf16 rows kernel", load, kind, then)
        if fn is None:
            continue
        _LOADED[:] = [kind]
        if variant() == "amx" and not (kind == "amx" and fn.amx_ready()):  # the dot code runs on AMX
            log.warning("bf16 rows kernel: AMX's tiles are not used here (%s); bf16 linears of %d+ rows stay "
                        "on oneDNN", "the dot build loaded" if kind != "amx" else "the OS did not lend them",
                        DOT_ON_AMX_MAX_ROWS + 1)
            ROWS_CAP = DOT_ON_AMX_MAX_ROWS
        _op_library()
        return fn
    return None


_LOADED: list = []  # the kind `_kernel` loaded
DOT_ON_AMX_MAX_ROWS = 2  # the dot build's code on AMX loses to oneDNN from 3 rows (bench/RESULTS.md, "A fifth CPU kind")
ROWS_CAP: Optional[int] = None  # set to it where that code runs on AMX (cpu_backend.rows_kernel_rows reads it)


def amx_tiles() -> bool:
    """Whether bf16 linears run on AMX's tile unit here (the amx build loaded, the tiles lent)."""
    return loaded_variant() == "amx" and bool(_kernel().amx_ready())


@functools.cache
def _op_library() -> Optional[Path]:
    """Build and load the op's C++ kernel (csrc/bf16_rows_op.cpp), which then serves every CPU call of
    `rollout_ssd::bf16_rows` in place of the Python fallback below; None where it is turned off
    ($ROLLOUT_SSD_BF16_ROWS_OP=0), or cannot be built or loaded (logged once: the fallback stays, same
    results, a slower call). A library once loaded stays for the process."""
    if os.environ.get("ROLLOUT_SSD_BF16_ROWS_OP", "1") == "0":
        return None
    if torch.__version__ < OP_TORCH:
        log.info("bf16 rows op's C++ kernel needs torch >= %s (the stable C ABI it targets); the op calls it "
                 "through Python", OP_TORCH)
        return None
    try:
        path = build(op=True, kind=_LOADED[0] if _LOADED else None)  # the build `linear` runs
        torch.ops.load_library(str(path))
    except Exception as exc:  # noqa: BLE001 (a build or a load that fails: the fallback serves the op)
        detail = getattr(exc, "stderr", "") or exc
        log.warning("bf16 rows op's C++ kernel not built or not loaded (%s); compiled steps call it through Python", detail)
        return None
    return path


def op_in_cpp() -> bool:
    """Whether `rollout_ssd::bf16_rows` runs its C++ kernel here (else the Python fallback, or nothing)."""
    return _kernel() is not None and _op_library() is not None


_ON = os.environ.get("ROLLOUT_SSD_BF16_ROWS", "1") != "0"


def set_enabled(on: bool) -> None:
    """Turn the kernel's use on or off in this process (benchmarks compare it with oneDNN's this way).
    A frozen compiled step traced before keeps the form it was traced with (the kernel's copies it holds);
    a live one retraces in the new form once `pack_live` has remade the copies."""
    global _ON
    _ON = bool(on)


def available() -> bool:
    """Whether `linear` runs here: an AVX-512 CPU (`variant`), the kernel built, not turned off."""
    return _ON and _kernel() is not None


def pack(w: torch.Tensor) -> torch.Tensor:
    """w [n, k] bf16 (k even) in the kernel's layout: tiles of 64 outputs (n padded with zero rows),
    inside a tile one line per pair of k indices, [ceil(n / 64), k / 2, 64, 2]."""
    n, k = w.shape
    if k % 2:
        raise ValueError(f"bf16_rows.pack needs an even number of columns, got a weight of shape {tuple(w.shape)}")
    tiles = -(-n // TILE)
    padded = F.pad(w.detach().contiguous(), (0, 0, 0, tiles * TILE - n))
    return padded.view(tiles, TILE, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def linear(x: torch.Tensor, packed: torch.Tensor, n: int, bias: Optional[torch.Tensor] = None,
           kernel=None) -> torch.Tensor:
    """x [m, k] bf16 @ w.T (+ bias) -> [m, n] bf16, w given as `pack(w)`. Needs `available()` (kernel:
    a function from `load` to run instead of this CPU's, as tests do with the widened build)."""
    m, k = x.shape
    if x.dtype != torch.bfloat16 or packed.dtype != torch.bfloat16 or packed.dim() != 4 \
            or tuple(packed.shape[1:]) != (k // 2, TILE, 2) or k % 2 or packed.shape[0] * TILE < n:
        raise ValueError(f"bf16_rows.linear: x {tuple(x.shape)} {x.dtype} does not fit packed "
                         f"{tuple(packed.shape)} {packed.dtype} with n={n}")
    kernel_build.check_operands("bf16_rows", x, packed, n, bias)
    x = x.contiguous()
    if x.data_ptr() % 4:  # the kernel reads x in pairs of bf16 (4 bytes): a view at an odd offset is copied
        x = x.clone()
    b = None if bias is None else bias.detach().float().contiguous()
    out = torch.empty(m, n, dtype=torch.bfloat16)
    if (kernel or _kernel())(x.data_ptr(), m, k, packed.data_ptr(), n, None if b is None else b.data_ptr(),
                             out.data_ptr(), torch.get_num_threads()):
        raise MemoryError(f"bf16_rows.linear: no memory for a float32 copy of x {tuple(x.shape)}")
    return out


# The op compiled steps call (inductor runs it as an opaque kernel over the packed copy).
_LIBRARY = torch.library.Library("rollout_ssd", "FRAGMENT")
_LIBRARY.define("bf16_rows(Tensor x, Tensor packed, Tensor? bias, SymInt n) -> Tensor")
_LIBRARY.impl("bf16_rows", lambda x, packed, bias, n: linear(x, packed, n, bias), "CompositeExplicitAutograd")


@torch.library.register_fake("rollout_ssd::bf16_rows")
def _bf16_rows_shape(x, packed, bias, n):
    return x.new_empty(x.shape[0], n)
