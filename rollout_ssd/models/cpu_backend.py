"""The decoder's hardware-specific choices on CPU: weight layouts, GEMM forms, row padding, dtype "auto".

The decoder (decoder.py) states the model; this module decides how its matmuls run on the machine
found. Every choice here changes float32 results only at rounding level (the same products, summed in
another order), never the model:
- layer matrices: float32 ones are stored column-major (`layer_weight`), the fastest form for one row;
  2..24 rows run the float32 rows kernel (f32_rows.py) where the CPU kind lists it, else MKL in the
  form measured fastest per kind (`linear`, `WeightCopies`, `gemm_rows`); the LM head likewise (`head_matmul`);
- bf16 (`packed_linear`): at 1..`rows_kernel_rows()` rows (per CPU kind) on AVX-512 the bf16 rows kernel
  (bf16_rows.py: the weight read at memory speed, a row's result independent of its batch, within bf16
  rounding of F.linear); otherwise, with bf16 units, oneDNN's linear over packed weights, bitwise F.linear;
- inside a live compiled step (graphs.py): the same kernels, as ops inductor calls as they are, over copies
  `pack_live` keeps current; with the rows kernel off, a one-row linear is a float32 reduction inductor streams;
- whether a forward's layers run as one C call each (`one_call_layers`, the layer kernel) and which
  attention form a few queries over a 16-bit cache take (`SDPA_FEW_QUERIES_KINDS`, `few_query_attention`).

It is the one module the model calls for these choices: the kernels (rollout_ssd.kernels: bf16_rows,
f32_rows, few_attention, layer_kernel) sit below it and never import it. dtype "auto" is cpu_dtype.py's.
The CPU kind is read once per process (`cpu_kind`, kernels/cpu.py). Measurements behind these choices:
bench/RESULTS.md; bench/bench_gemm.py, bench/bf16_rows_kernel.py and bench/f32_rows_kernel.py re-measure them.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from rollout_ssd.kernels import bf16_rows, f32_rows, few_attention, int4_rows, layer_kernel
from rollout_ssd.kernels.cpu import BF16_UNITS, cpu_kind
from rollout_ssd.models import quant
from rollout_ssd.models.weight_copies import WeightCopies, linear_weights

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------ layouts and copies
def layer_weight(rows: int, cols: int, dtype: torch.dtype) -> nn.Parameter:
    """A frozen [rows, cols] layer weight matrix (zeros). float32 ones are stored column-major: F.linear(x, w)
    is then an x @ w.T GEMM over a row-major operand, which at batch 1 streams the weights at the read
    bandwidth where MKL's GEMV over the row-major layout does not, and is as fast or faster at 2..32 rows
    (AVX2 EPYC, MKL 2024.2). Only strides differ. Other dtypes keep the row-major layout (not measured)."""
    if dtype == torch.float32:
        return nn.Parameter(torch.zeros(cols, rows, dtype=dtype).t(), requires_grad=False)
    return nn.Parameter(torch.zeros(rows, cols, dtype=dtype), requires_grad=False)


# MKL's W @ x.T (N = the row count M) runs a slow remainder path when M is off a multiple of 4 or 8 ("GEMM widths"):
# `linear` and the LM head pad x with zero rows to `gemm_rows(M)` (to 16: where padding won; above: multiples of 8).
_PAD_SMALL = {3: 4, 7: 8, 12: 16, 13: 16, 14: 16, 15: 16}
ONE_THREAD_COLUMN_MAJOR_ROWS = 12  # one thread: x @ W.T (column-major) as fast as W @ x.T from here, no remainder
# The LM head computes head @ rows.T up to this many rows, F.linear above (same run).
HEAD_MM_T_MAX_ROWS = 64
# By CPU kind: float32 linears of 2..N rows, and of FROM rows and more, run x @ W.T over column-major storage, not
FLOAT32_COLUMN_MAJOR_ROWS = {"avx512": 8}  # W @ x.T transposed ("A sixth CPU kind", "Wide float32 linears")
FLOAT32_COLUMN_MAJOR_FROM = {"avx512": 25}
# By CPU kind: float32 linears and LM head of 2..N rows run f32_rows.py's kernel where it builds (AVX-512 Xeon,
# SmolLM2-135M shapes: 1.2-1.4x MKL's best form at 2..24 rows, 1.06x at 32, 0.9x at 1; RESULTS, "The float32 rows kernel").
F32_ROWS_KERNEL_ROWS = {"avx512": 24}


def f32_rows_kernel_rows() -> int:
    """The most rows a float32 linear runs on the float32 rows kernel here (0: kind not listed, off, or no build)."""
    rows = F32_ROWS_KERNEL_ROWS.get(cpu_kind(), 0)
    return rows if rows and f32_rows.available() else 0


def _f32_rows(x: torch.Tensor, m: int, bias: Optional[torch.Tensor] = None) -> bool:
    """For a frozen float32 CPU weight outside a compile (the callers' checks): whether m rows of x take the kernel."""
    return 2 <= m <= f32_rows_kernel_rows() and x.dtype == torch.float32 and not x.requires_grad \
        and (bias is None or not bias.requires_grad)


def column_major_rows(m: int, wide: bool = True) -> bool:
    """Whether an m-row float32 linear runs x @ W.T over column-major weights on this CPU (not wide: only
    the few rows; the row-major LM head's GEMMs of FROM+ rows need no column-major copy)."""
    kind = cpu_kind()
    return m <= FLOAT32_COLUMN_MAJOR_ROWS.get(kind, 1) or (wide and m >= FLOAT32_COLUMN_MAJOR_FROM.get(kind, m + 1))


def _column_major(w: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    return w.t().contiguous() if out is None else out.copy_(w.t())


def _row_major(w: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    return w.contiguous() if out is None else out.copy_(w)


# CPU kinds where a few queries per row over a 16-bit cache take PyTorch's SDPA, not attention.py's explicit form,
SDPA_FEW_QUERIES_KINDS = ("amx",)  # where few_attention's kernel does not run (0.77-0.98x; RESULTS, "SDPA on AMX")


def few_query_attention(q, k, v, mask, scale) -> Optional[torch.Tensor]:
    """A few queries per row over a 16-bit CPU cache on few_attention's kernel, or None where the kernel does
    not take the call (attention.py then picks between its explicit form and SDPA)."""
    return few_attention.try_attend(q, k, v, mask, scale)


# The most tokens a step runs through the layer kernel: the rows kernel's own limit (`rows_kernel_rows()`), at most
# layer_kernel.LIMIT, unless measured otherwise for a CPU kind here where the rows kernel takes LIMIT rows
# (bench/layer_kernel.py; bench/RESULTS.md, "One C call a layer" and "The layer kernel's arithmetic on every thread").
# Whatever the rows, a row of more than LIMIT tokens is a prefill (SDPA's flash kernel's work), and so are the
# linears of an int4 draft's step past LIMIT tokens (int4_rows.c is tested up to LIMIT rows).
LAYER_KERNEL_ROWS = {"amx": 256}  # AMX's tiles: decode and verify steps of up to 256 rows beat the module layers
_LAYER_ROWS: Optional[int] = None  # an override (bench/layer_kernel.py forces the kernel past its limit this way)


def layer_kernel_rows() -> int:
    """The most tokens (rows x tokens per row) a step runs through the layer kernel on this CPU."""
    if _LAYER_ROWS is not None:
        return _LAYER_ROWS
    rows = min(rows_kernel_rows(), layer_kernel.LIMIT)
    return LAYER_KERNEL_ROWS.get(cpu_kind(), rows) if rows == layer_kernel.LIMIT else rows


def _layer_kernel_fits(model) -> bool:
    """Whether the model's layers are ones the layer kernel computes: bf16 on the CPU, frozen, bf16 linears or an
    int4 draft's in int4_rows.c's groups, the SDPA backend's cache layout, shapes the kernels take."""
    cfg, layer = model.cfg, model.layers[0] if len(model.layers) else None
    if layer is not None and layer.row_major.int4_group is not None:  # an int4 draft: int4_rows.c's groups
        g = int4_rows.GROUP
        if layer.row_major.int4_group != g or not layer_kernel.int4_available() \
                or any(k % g for k in (cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.intermediate_size)):
            return False
    return (layer is not None and model.dtype == torch.bfloat16 and model.embed.is_cpu
            and model.backend.name == "sdpa" and not layer.wqkv.requires_grad
            and 0 < cfg.head_dim <= layer_kernel.MAX_HEAD_DIM and cfg.head_dim % 2 == 0
            and cfg.hidden_size % 2 == 0 and cfg.intermediate_size % 2 == 0)


def one_call_layers(model, batch, cache, contiguous: bool) -> bool:
    """Whether a Decoder forward runs its layers as one C call each (`layer_kernel.forward_layers`): a few causal
    tokens (decode, verify, a short prefill; not a tree step's mask or spans) of a bf16 CPU model with frozen
    weights, rows in consecutive slots, where the rows kernel runs, outside compiled steps."""
    b, t = batch.tokens.shape
    limit = layer_kernel.LIMIT
    if torch.compiler.is_compiling() or not contiguous or batch.mask is not None or batch.spans is not None \
            or not layer_kernel.available() or t > (_LAYER_ROWS or limit) or b * t > layer_kernel_rows() \
            or not few_attention.available() or not _layer_kernel_fits(model) \
            or (b * t > limit and model.layers[0].row_major.int4_group is not None):
        return False  # (available() first: loading the rows kernel may lower the row limit, bf16_rows._kernel)
    kc = cache.keys[0]
    return kc.is_cpu and kc.dtype in (torch.bfloat16, torch.float32) and kc.dim() == 4 and kc.stride(3) == 1 \
        and all(k.stride() == kc.stride() and v.stride() == kc.stride() and k.dtype == kc.dtype
                for k, v in zip(cache.keys, cache.values))


def forward_one_call_layers(model, x, cos, signed_sin, batch, cache, length: int) -> torch.Tensor:
    """The model's layers over x [B, T, H] for a forward `one_call_layers` took (layer_kernel.forward_layers)."""
    return layer_kernel.forward_layers(model, x, cos, signed_sin, batch, cache, length)


def gemm_rows(m: int) -> int:
    """The row count `linear` and the LM head run an m-row W @ x.T at (m, or up to 7 zero rows more)."""
    if m <= 16:
        return _PAD_SMALL.get(m, m)
    return -(-m // 8) * 8


def padded_mm_t(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """(w @ x.T).T for x [M, K] (a non-contiguous view), over gemm_rows(M) rows (zero rows' outputs dropped)."""
    m = x.shape[0]
    padded = gemm_rows(m)
    if padded == m:
        return torch.mm(w, x.t()).t()
    return torch.mm(w, F.pad(x, (0, 0, 0, padded - m)).t())[:, :m].t()


# bf16 on a CPU with native bf16: oneDNN's linear over a weight it reordered ("packed") once, bitwise F.linear
# (tested) and faster at every row count measured up to 256 (bench/RESULTS.md, "bf16 linear over packed weights").
PACKED_BF16_MAX_ROWS = 256


@functools.cache
def packed_bf16() -> bool:
    """Whether bf16 linears run over oneDNN-packed weights: the CPU has bf16 units and oneDNN's packed
    linear exists in this torch build."""
    ops = torch.ops.mkldnn
    return cpu_kind() in BF16_UNITS and hasattr(ops, "_reorder_linear_weight") \
        and hasattr(ops, "_linear_pointwise") and bool(ops._is_mkldnn_bf16_supported())


def _pack(w: torch.Tensor) -> torch.Tensor:
    """oneDNN's packed copy of w, no row hint (packed for 1 row, AMX ran non-F.linear kernels above 32 rows)."""
    return torch.ops.mkldnn._reorder_linear_weight(w, None)


# bf16 linears of 1..N rows run bf16_rows.py's kernel on AVX-512, oneDNN's packed linear above: N = every row count
# without bf16 units (oneDNN emulates bf16, 3x slower), else 32 (AMX's amx build: 1.1-1.2x oneDNN's speed; lowered by
# bf16_rows.DOT_ON_AMX_MAX_ROWS where AMX runs the dot code). (RESULTS.md: "bf16 kernel for a few rows", "One C call a layer".)
ROWS_KERNEL_MAX_ROWS = {"avx512": 1 << 30}
_ROWS_KERNEL_ROWS = ROWS_KERNEL_MAX_ROWS.get(cpu_kind(), 32)  # read once: compiled steps trace the plain read


def rows_kernel_rows() -> int:
    """The most rows a bf16 linear runs on the rows kernel on this CPU (where the kernel runs; lowered to
    `bf16_rows.ROWS_CAP` where loading it found AMX's tiles unused)."""
    cap = bf16_rows.ROWS_CAP
    return _ROWS_KERNEL_ROWS if cap is None else min(_ROWS_KERNEL_ROWS, cap)


def _rows_kernel_serves(w: torch.Tensor) -> bool:
    """Whether the bf16 rows kernel can take this weight: it runs here and w has whole pairs of columns."""
    return w.shape[1] % 2 == 0 and bf16_rows.available()


def _rows_kernel(x: torch.Tensor, w: torch.Tensor, m: int) -> bool:
    return x.dtype == torch.bfloat16 and _rows_kernel_serves(w) and m <= rows_kernel_rows()  # (the kernel loaded first)


def packed_linear(x: torch.Tensor, w: torch.Tensor, copies: WeightCopies, name: str,
                  bias: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """F.linear(x, w, bias) for a frozen bf16 CPU weight in the fastest form for the row count (the bf16
    rows kernel over its packed copy at 1..rows_kernel_rows() rows where it runs, else oneDNN over its
    packed copy), or None where neither applies (other dtypes, devices, training, more rows than
    either serves: oneDNN's PACKED_BF16_MAX_ROWS). Inside a compiled step: the same kernels, as ops over the copies
    `pack_live` made. A frozen step takes only the rows kernel (its copy held by the graph; inductor's
    own bf16 GEMMs are slower at these row counts) and otherwise None (F.linear, which inductor packs
    itself); a live one (`live_steps`) also oneDNN's op, or a one-row reduction."""
    m = x.numel() // x.shape[-1]
    if torch.compiler.is_compiling():
        x2 = x.reshape(m, x.shape[-1])
        rows = copies.live.get(name + ":rows") if m <= rows_kernel_rows() else None  # made where the kernel runs
        if rows is not None:
            out = torch.ops.rollout_ssd.bf16_rows(x2, rows, bias, w.shape[0])
        elif m > PACKED_BF16_MAX_ROWS:
            return None
        elif not _LIVE:  # frozen: F.linear, which inductor packs itself
            return None
        elif m == 1 and w.dtype == torch.bfloat16:  # one row: a reduction inductor streams the weight through
            out = (w.float() * x2.float()).sum(-1)
            out = (out if bias is None else out + bias.float()).to(x.dtype)
        elif (packed := copies.live.get(name)) is not None:
            out = torch.ops.rollout_ssd.packed_linear(x2, packed, bias, w.shape[0])
        else:
            return None
        return out.view(*x.shape[:-1], w.shape[0])
    if w.dtype != torch.bfloat16 or not w.is_cpu or w.requires_grad or x.requires_grad:
        return None
    x2 = x.reshape(m, x.shape[-1])
    if _rows_kernel(x, w, m):
        out = bf16_rows.linear(x2, copies.get(name + ":rows", w, bf16_rows.pack), w.shape[0], bias)
    elif packed_bf16() and m <= PACKED_BF16_MAX_ROWS:
        out = torch.ops.mkldnn._linear_pointwise(x2, copies.get(name + ":packed", w, _pack), bias, "none", [], "")
    else:
        return None
    return out.view(*x.shape[:-1], w.shape[0])


# Live compiled steps (EngineConfig.compile = "live"; gpu/graphs.py): the weights stay graph inputs, so a step follows
# every update without a recompile. inductor lowers oneDNN's packed linear only over weights it froze itself, so
# here it is an op of this package inductor calls as an opaque kernel, over the copy `pack_live` keeps current.
_LIBRARY = torch.library.Library("rollout_ssd", "DEF")
_LIBRARY.define("packed_linear(Tensor x, Tensor packed, Tensor? bias, SymInt n) -> Tensor")
_LIBRARY.impl("packed_linear", lambda x, packed, bias, n: torch.ops.mkldnn._linear_pointwise(
    x, packed, bias, "none", [], ""), "CompositeExplicitAutograd")


@torch.library.register_fake("rollout_ssd::packed_linear")
def _packed_linear_shape(x, packed, bias, n):
    return x.new_empty(x.shape[0], n)


_LIVE = False  # whether a live step is being compiled or run (dynamo guards its graphs on this value)


@contextlib.contextmanager
def live_steps(on: bool = True):
    """Within: compiled steps use `pack_live`'s copies (live) rather than F.linear (frozen)."""
    global _LIVE
    before, _LIVE = _LIVE, on
    try:
        yield
    finally:
        _LIVE = before


def pack_live(model) -> None:
    """Bring the packed copies a live compiled step reads (`WeightCopies.live`) up to date with a bf16
    CPU model's linear weights: each is repacked only where its weight was written or replaced since
    (`WeightCopies.get`); an int4 draft's copies likewise (quant.pack_live). A no-op where neither
    applies (a float32 model's live steps read the weights themselves)."""
    if not _packs(model):
        if model.dtype == torch.bfloat16 and model.copies.int4_group is None:  # the rows kernel turned off since
            for _, _, copies, name in linear_weights(model):
                copies.live.pop(name + ":rows", None)
        return quant.pack_live(model)
    with torch.inference_mode():
        for w, _, copies, name in linear_weights(model):
            if packed_bf16():
                copies.live[name] = copies.get(name + ":packed", w, _pack)
            if _rows_kernel_serves(w):
                copies.live[name + ":rows"] = copies.get(name + ":rows", w, bf16_rows.pack)
            else:  # turned off since: steps traced from now on do not call it
                copies.live.pop(name + ":rows", None)


def _packs(model) -> bool:
    """Whether a model's linears run over packed copies (oneDNN's, the bf16 rows kernel's): a bf16 CPU
    model where `packed_bf16` or `bf16_rows.available()`, not an int4 draft."""
    return (packed_bf16() or bf16_rows.available()) and model.dtype == torch.bfloat16 and model.embed.is_cpu \
        and model.copies.int4_group is None


# oneDNN makes a kernel per (weight shape, row count) on first meeting one (a fresh engine's first call meets
# dozens; bench/RESULTS.md, "The SSD engine's first call"); `warm_packed` makes them and the copies up front.
WARM_ROWS = 32
_WARMED: set[tuple] = set()  # (weight shape, bias?, rows) whose kernels this process has made: oneDNN keeps them


def warm_packed(model, rows: int = WARM_ROWS) -> None:
    """Pack a frozen bf16 CPU model's linear weights (bf16 rows kernel, oneDNN) and make oneDNN's kernels
    for the row counts up to `rows` it serves, per distinct weight shape (the layers share theirs; a later
    engine over the same shapes makes none) and the LM head; a float32 model's head copy for one-row logits
    and float32 rows kernel copies where it runs (made on a first call, each cost that call a quarter
    second of page faults here). Otherwise a no-op. The outputs are thrown away; nothing is written."""
    if not _packs(model):
        if model.dtype == torch.float32 and model.embed.is_cpu and model.copies.int4_group is None:
            if not model.lm_head.requires_grad:  # a trained head's logits are F.linear's (`head_matmul`)
                model.copies.get("lm_head_t", model.lm_head, _column_major, in_place=True)
            if f32_rows_kernel_rows():
                f32_rows.warm(linear_weights(model))
        return
    kernel_rows = rows_kernel_rows() if bf16_rows.available() else 0  # the rows kernel has no per-shape state
    with torch.inference_mode():
        for w, bias, copies, name in linear_weights(model):
            key = (tuple(w.shape), bias is not None, rows)
            sizes = range(kernel_rows + 1, rows + 1) if key not in _WARMED else ()  # oneDNN's kernels, once
            for m in {1, *sizes}:  # 1: the first form's copy (the rows kernel's where it runs)
                packed_linear(torch.zeros(m, w.shape[1], dtype=w.dtype), w, copies, name, bias)
            if packed_bf16():  # oneDNN's copy (prefill), also where the rows kernel took every size above
                copies.get(name + ":packed", w, _pack)
            _WARMED.add(key)


def linear(x: torch.Tensor, w: torch.Tensor, copies: WeightCopies, name: str,
           bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear(x, w, bias) in the fastest form measured for the row count and CPU (int4 for an int4
    draft, quant.py; bf16: `packed_linear`). float32: one row, x @ W.T over the column-major storage
    (`layer_weight`); 2+ rows of a frozen weight, the float32 rows kernel where `F32_ROWS_KERNEL_ROWS`
    lists the CPU kind, else W @ x.T over a row-major copy in `copies` (AVX2 EPYC, MKL 2024.2: 2..9 rows
    cost about one row), x padded to `gemm_rows`, or x @ W.T where `column_major_rows` says so, as with
    one thread from 12 rows on. Weights that require grad use F.linear. The forms differ in rounding only."""
    if copies.int4_group is not None:
        return quant.linear(x, w, copies, name, bias)
    packed = packed_linear(x, w, copies, name, bias)
    if packed is not None:
        return packed
    m = x.numel() // x.shape[-1]
    if m < 2 or w.requires_grad or w.dtype != torch.float32 or not w.is_cpu or torch.compiler.is_compiling():
        return F.linear(x, w, bias)
    if _f32_rows(x, m, bias):
        packed = copies.get(name + ":f32rows", w, f32_rows.pack, in_place=True)
        out = f32_rows.linear(x.reshape(m, x.shape[-1]), packed, w.shape[0], bias)
        return out.view(*x.shape[:-1], w.shape[0])
    one_thread_wide = m >= ONE_THREAD_COLUMN_MAJOR_ROWS and torch.get_num_threads() == 1
    if (one_thread_wide or column_major_rows(m)) and w.t().is_contiguous():
        return F.linear(x, w, bias)
    rows = w if w.is_contiguous() else copies.get(name, w, _row_major, in_place=True)
    out = padded_mm_t(rows, x.reshape(m, x.shape[-1]))
    if bias is not None:
        out = out + bias
    return out.contiguous().view(*x.shape[:-1], w.shape[0])


def head_matmul(rows: torch.Tensor, head: torch.Tensor, copies: WeightCopies) -> torch.Tensor:
    """rows [M, H] @ head.T (the LM head, row-major) in the form fastest for M on a float32 CPU head: the
    rows kernel as in `linear`; M = 1 (and up to `FLOAT32_COLUMN_MAJOR_ROWS` by CPU kind) a column-major
    copy; 2 <= M <= HEAD_MM_T_MAX_ROWS head @ rows.T padded to `gemm_rows(M)`; else F.linear."""
    if copies.int4_group is not None:
        return quant.linear(rows, head, copies, "lm_head")
    packed = packed_linear(rows, head, copies, "lm_head")
    if packed is not None:
        return packed
    m = rows.shape[0]
    cpu_f32 = head.dtype == torch.float32 and head.is_cpu and not rows.requires_grad \
        and not head.requires_grad and not torch.compiler.is_compiling()
    if cpu_f32 and _f32_rows(rows, m):
        return f32_rows.linear(rows, copies.get("lm_head:f32rows", head, f32_rows.pack, in_place=True), head.shape[0])
    if cpu_f32 and column_major_rows(m, wide=False):
        return rows @ copies.get("lm_head_t", head, _column_major, in_place=True)
    if cpu_f32 and m <= HEAD_MM_T_MAX_ROWS:
        return padded_mm_t(head, rows).contiguous()
    return F.linear(rows, head)
