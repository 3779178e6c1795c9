"""The target's own weights in int4 as a draft model: `quantize_int4` and the linears it makes run.

Why: SSD can gain over SD only the share of an SD round the drafting takes (docs/THEORY.md, Corollary 9),
and a draft gains only as far as it agrees with the target. A small distilled draft is cheap but agrees
little; the target itself, its weights rounded to 4 bits, agrees far more and costs well under a target
step at a few rows, since a step at a few rows is bound by reading the weights and int4 reads a quarter
of bf16's bytes. It is also a draft that never drifts from the policy: it is made from the policy's own
weights, so every target update is the draft's update too.

How: every linear of a quantized model (its layers' projections and the LM head) runs torch's CPU int4
kernel (`aten._weight_int4pack_mm_for_cpu`) over an int4 copy of the weight, made in the model's
`WeightCopies` on first use and made again whenever the weight is written (an update). Groups of
`group` consecutive input columns per output row share a scale and an offset (asymmetric min/max
rounding, as torch's kernel expects: w ~ (q - 8) * scale + zero with q in 0..15). The bf16 or float32
weights stay in the model: they are what updates write and what the copies are made from. The kernel
runs on bf16 activations and scales whatever the model's dtype (`KERNEL_DTYPE`): fed float32 it takes a
path many times slower, even on a CPU without bf16 units (bench/RESULTS.md, "A sixth CPU kind").

A quantized model is a draft only: its logits are not the target's, so nothing here is lossless on its
own; verification against the unquantized target keeps the engine's outputs exact.
"""

from __future__ import annotations

from typing import Optional

import torch

from rollout_ssd.kernels import int4_rows, layer_kernel
from rollout_ssd.models.weight_copies import linear_weights

INT4_GROUPS = (32, 64, 128)
DEFAULT_GROUP = 32
KERNEL_DTYPE = torch.bfloat16  # what the int4 kernel reads and writes (module docstring)


def available() -> bool:
    """Whether this torch build has the CPU int4 kernels."""
    ops = torch.ops.aten
    return hasattr(ops, "_weight_int4pack_mm_for_cpu") and hasattr(ops, "_convert_weight_to_int4pack_for_cpu")


def int4_codes(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (codes [N, K] int32 in 0..15, scales_zeros [K / group, N, 2] float32): per group of
    `group` columns of a row, scale = (max - min) / 15 and zero = min + 8 * scale, so that
    (codes - 8) * scale + zero is w rounded to the group's 16 levels."""
    n, k = w.shape
    if k % group:
        raise ValueError(f"int4 groups of {group} columns need a multiple of {group} columns, got {k}")
    g = w.detach().float().reshape(n, k // group, group)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    scale = ((hi - lo) / 15).clamp(min=torch.finfo(torch.float32).tiny)
    codes = ((g - lo) / scale).round().clamp(0, 15).to(torch.int32).reshape(n, k)
    zero = lo + 8 * scale
    return codes, torch.stack((scale.squeeze(-1), zero.squeeze(-1)), -1).transpose(0, 1).contiguous()


def dequantize(codes: torch.Tensor, scales_zeros: torch.Tensor, group: int) -> torch.Tensor:
    """The float32 [N, K] weight the codes stand for (the reference the kernel is tested against)."""
    n, k = codes.shape
    scale, zero = scales_zeros[..., 0].t().unsqueeze(-1), scales_zeros[..., 1].t().unsqueeze(-1)
    return ((codes.reshape(n, k // group, group).float() - 8) * scale + zero).reshape(n, k)


def rows_copy(copies, name: str, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`name`'s copy in int4_rows.c's layout (`int4_rows.pack`), made on first use and after each write to w."""
    return copies.get(name + ":int4rows", w, int4_rows.pack)


class Int4Weight:
    """One weight's int4 copy in the kernel's packed layout."""

    def __init__(self, w: torch.Tensor, group: int):
        codes, scales_zeros = int4_codes(w, group)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        self.scales_zeros = scales_zeros.to(KERNEL_DTYPE)
        self.group = group
        self.rows = w.shape[0]


def _rows_kernel(x: torch.Tensor) -> bool:
    """Whether csrc/int4_rows.c takes a linear of x (its library runs here, whole groups of columns)."""
    return layer_kernel.int4_available() and x.shape[-1] % int4_rows.GROUP == 0


def _int4_copy(copies, name: str, w: torch.Tensor) -> Int4Weight:
    return copies.get(name + ":int4", w, lambda t: Int4Weight(t, copies.int4_group))


def linear(x: torch.Tensor, w: torch.Tensor, copies, name: str, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x @ w.T (+ bias) with w rounded to int4 (`copies.int4_group` columns per group), over the int4
    copy `copies` keeps for `name`: csrc/int4_rows.c's (groups of 32, up to 32 rows, where the layer
    kernel's library runs: avx512_bf16), else torch's int4 kernel's. Past 32 rows (a prefill, a large
    batch's or tree's step) where int4_rows.c runs, the weight's own bf16 product: compute-bound there,
    where no int4 kernel here is faster; a draft's outputs need not be int4's, only the target's exact."""
    m = x.numel() // x.shape[-1]
    if not torch.compiler.is_compiling() and copies.int4_group == int4_rows.GROUP and _rows_kernel(x):
        if m > int4_rows.MAX_ROWS:  # a prefill: compute-bound, where the weights' own bf16 GEMM is the fast form
            return torch.nn.functional.linear(x, w, bias)
        out = layer_kernel.int4_linear(x.reshape(m, x.shape[-1]), *rows_copy(copies, name, w), w.shape[0], bias)
        return out.to(w.dtype).view(*x.shape[:-1], w.shape[0])
    if torch.compiler.is_compiling():  # a compiled step: the copies `pack_live` listed before the trace
        packed, scales_zeros = copies.live[name + ":int4"]
        group, rows = copies.int4_group, w.shape[0]
    else:
        q = _int4_copy(copies, name, w)
        packed, scales_zeros, group, rows = q.packed, q.scales_zeros, q.group, q.rows
    a = x.reshape(m, x.shape[-1]).to(KERNEL_DTYPE).contiguous()  # the kernel reads A contiguous
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(a, packed, group, scales_zeros).to(w.dtype)
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], rows)


def pack_live(model) -> None:
    """List an int4 model's copies (made again where a weight was written since) where a compiled step
    reads them (`WeightCopies.live`), and make the eager steps' int4_rows.c copies where that kernel runs;
    a no-op for other models (cpu_backend.pack_live calls it for one)."""
    if getattr(model, "int4_group", None) is None:
        return
    for w, _, copies, name in linear_weights(model):
        q = _int4_copy(copies, name, w)
        copies.live[name + ":int4"] = (q.packed, q.scales_zeros)
        if copies.int4_group == int4_rows.GROUP and _rows_kernel(w):
            rows_copy(copies, name, w)  # the eager steps' copies too, made now rather than in a first round


def quantize_int4(model, group: int = DEFAULT_GROUP):
    """Make `model` (a Decoder on a CPU, bf16 or float32) run its linears and LM head in int4 from now
    on; returns it. Its weights stay as they are (updates still write them; each int4 copy is made again
    after its weight changes)."""
    if group not in INT4_GROUPS:
        raise ValueError(f"int4 group must be one of {INT4_GROUPS}, got {group!r}")
    if not available():
        raise RuntimeError("this torch build has no CPU int4 kernels (aten._weight_int4pack_mm_for_cpu)")
    if not model.embed.is_cpu or model.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"int4 drafts run on a CPU in bfloat16 or float32, got {model.dtype} on {model.embed.device}")
    columns = sorted({w.shape[1] for w, _, _, _ in linear_weights(model)})
    if any(k % group for k in columns):  # before anything changes: a refused model stays as it was
        fit = [g for g in INT4_GROUPS if all(k % g == 0 for k in columns)]
        raise ValueError(f"int4 group {group} does not divide this model's linears' column counts {columns}; "
                         f"groups that do: {fit or 'none'}")
    for copies in [model.copies] + [layer.row_major for layer in model.layers]:
        copies.int4_group = group
    model.int4_group = group
    pack_live(model)  # each int4 copy made now, not in a first round
    return model
