"""A bf16 decoder layer for a few tokens in one C call (csrc/decoder_layer.c), for CPU decode and verify steps.

Why: at batch 1 a decode step's linears take about two thirds of its time on the bf16 rows kernel and
the rest is the twenty-odd small ops of each layer (norms, RoPE, cache writes, SwiGLU, residual adds),
each a PyTorch dispatch of microseconds for a few thousand floats of work (bench/RESULTS.md, "Where an
eager step's time goes"). One C call per layer runs the same arithmetic, in the eager decoder's rounding
order, with the linears on the rows kernel and the attention on the few-query kernel: the step then costs
about what reading its weights costs. A verify of a few tokens takes it too (the rows kernel at K + 1
rows costs less than oneDNN's linear plus the small ops' dispatch), up to `cpu_backend.layer_kernel_rows()`
tokens a step.

It serves a `Decoder.forward` of a bf16 CPU model with frozen weights where the tokens see their row's
cache causally (decode, verify, prefill of a few tokens; not a tree step's mask or spans), the rows hold
consecutive slots, and the rows kernel runs on this CPU (AVX-512: `bf16_rows.variant()`), outside
compiled steps: the CPU backend decides (rollout_ssd/models/cpu_backend.py, `one_call_layers`). Otherwise
the decoder's layers run as modules, as before. Built on first use with the C compiler found, from the
rows kernel's and the attention kernel's sources included into this one (kernel_build.py);
$ROLLOUT_SSD_LAYER_KERNEL=0 or `set_enabled(False)` turns it off.

Its results are the eager layers' except where two float32 computations of one value (a sum of squares
in another order, SiLU's exponential, a polynomial against PyTorch's) cross a bf16 rounding boundary differently;
tests/test_layer_kernel.py bounds that against a float32 model and checks a row's results do not depend
on its batch or the thread count.
"""

from __future__ import annotations

import ctypes
import functools
import os
import weakref
from pathlib import Path
from typing import Optional

import torch

from rollout_ssd.kernels import bf16_rows, few_attention, int4_rows, kernel_build

SOURCE = Path(__file__).with_name("csrc") / "decoder_layer.c"
INCLUDED = (bf16_rows.SOURCE, few_attention.SOURCE, int4_rows.SOURCE)  # in the library's key
MAX_HEAD_DIM = few_attention.MAX_HEAD_DIM

LIMIT = 32  # the most tokens of one row, and of an int4 draft's step, the kernel takes (cpu_backend.py says why)


def build(kind: str, compiler: Optional[str] = None) -> Path:
    """Compile csrc/decoder_layer.c for the rows kernel's `kind` ("amx" | "dot" | "widened") into the kernel cache."""
    return kernel_build.build_library(f"decoder_layer_{kind}", SOURCE, (*bf16_rows.flags(kind), "-fno-math-errno"),
                                      key_text=b"".join(p.read_bytes() for p in INCLUDED),
                                      compiler=compiler or kernel_build.default_compiler())


def load(kind: str):
    """The `kind` build's C function, argument types set."""
    lib = ctypes.CDLL(str(build(kind)))
    fn = lib.decoder_layer
    p, n = ctypes.c_void_p, ctypes.c_long
    fn.argtypes = [p, *[n] * 7, *[p] * 4, *[p] * 5, p, p, p, p, p, ctypes.c_int, p, p, p, p, n,
                   ctypes.c_float, ctypes.c_float, ctypes.c_int]
    fn.restype = ctypes.c_int
    fn.int4 = None
    if kind in INT4_KINDS:
        fn.int4 = lib.int4_rows_linear
        fn.int4.argtypes = [p, n, n, p, p, n, p, p, ctypes.c_int]
        fn.int4.restype = ctypes.c_int
    return fn


@functools.cache
def _kernel():
    """The loaded C function, or None where it cannot run here (logged once)."""
    return kernel_build.load_or_none("decoder layer kernel", load, bf16_rows.loaded_variant(),  # the rows kernel's
                                     "the layers run as modules")


_ON = os.environ.get("ROLLOUT_SSD_LAYER_KERNEL", "1") != "0"


def set_enabled(on: bool) -> None:
    """Turn the kernel's use on or off in this process (benchmarks and tests compare the forms this way)."""
    global _ON
    _ON = bool(on)


def available() -> bool:
    return _ON and bf16_rows.available() and _kernel() is not None


INT4_KINDS = ("amx", "dot")  # the builds with int4_rows.c (it needs avx512_bf16's dot instruction)


def int4_available() -> bool:
    """Whether int4 drafts' linears (int4_rows.GROUP groups) run on csrc/int4_rows.c here: its library
    builds, whether or not the layer kernel is on (`set_enabled` switches the layers' form, not the
    draft's quantization)."""
    return bf16_rows.available() and _kernel() is not None and _kernel().int4 is not None


def int4_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, n: int,
                bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [m, k] @ w.T (+ bias) -> bf16 [m, n] for w given as `int4_rows.pack(w)`; needs `int4_available()`."""
    m, k = x.shape
    kernel_build.check_operands("int4_rows", x, codes, n, bias)
    if codes.dtype != torch.uint8 or tuple(codes.shape[1:]) != (k // 2, 64) or codes.shape[0] * 64 < n \
            or k % int4_rows.GROUP or tuple(scales.shape) != (codes.shape[0], k // int4_rows.GROUP, 2, 64) \
            or scales.dtype != torch.bfloat16 or not (codes.is_contiguous() and scales.is_contiguous()) \
            or not scales.is_cpu:
        raise ValueError(f"layer_kernel.int4_linear: x {tuple(x.shape)} does not fit codes {tuple(codes.shape)} "
                         f"{codes.dtype}, scales {tuple(scales.shape)} {scales.dtype} with n={n}")
    x = x.to(torch.bfloat16).contiguous()
    if x.data_ptr() % 4:  # read in pairs of bf16
        x = x.clone()
    b = None if bias is None else bias.detach().float().contiguous()
    out = torch.empty(m, n, dtype=torch.bfloat16)
    if _kernel().int4(x.data_ptr(), m, k, codes.data_ptr(), scales.data_ptr(), n, None if b is None else b.data_ptr(),
                      out.data_ptr(), torch.get_num_threads()):
        raise MemoryError(f"layer_kernel.int4_linear: no memory for the group sums of x {tuple(x.shape)}")
    return out


def causal_mask(starts: list[int], num_new: list[int], t: int, length: int) -> Optional[torch.Tensor]:
    """uint8 [B, T, length]: token j of row i sees cache positions below starts[i] + min(j, num_new[i] - 1) + 1
    (a padded token sees its row's real ones); None where every token sees every position (one token a row,
    every row ending at `length`)."""
    if t == 1 and all(s + n == length for s, n in zip(starts, num_new)):
        return None
    last = torch.minimum(torch.arange(t)[None, :], torch.tensor(num_new)[:, None] - 1)
    return (torch.arange(length)[None, None, :] <= (torch.tensor(starts)[:, None] + last)[:, :, None]).to(torch.uint8)


def _tensors(layer) -> list[torch.Tensor]:
    """The tensors of a layer the kernel reads, directly or through copies made from them."""
    return [t for t in (layer.input_norm, layer.post_attn_norm, layer.q_norm, layer.k_norm, layer.wqkv, layer.bqkv,
                        layer.wo, layer.w_gate_up, layer.w_down) if t is not None]


# model -> (key, per-layer arguments): `_layer_args`' cache
_ARGS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _layer_args(model) -> list[tuple]:
    """Per layer, the kernel's arguments only a weight write changes: the norms' and the packed copies'
    addresses (the int4 codes' and their scales' for an int4 draft), the bias's float32 copy. Made again
    when any of the layers' tensors is written (its version), replaced (its identity) or given other
    storage (its address), or the model is quantized: the copies they point into are the layers'
    WeightCopies', which keep them exactly that long (made again only when their tensor changes so).
    Per step the check costs a list of versions, less than fetching every copy and address again did
    (bench/RESULTS.md, "One C call a layer")."""
    tensors = [t for layer in model.layers for t in _tensors(layer)]
    key = [(id(t), t._version, t.data_ptr()) for t in tensors] + [model.layers[0].row_major.int4_group]
    hit = _ARGS.get(model)
    if hit is not None and hit[0] == key and all(a is b for a, b in zip(hit[2], tensors)):
        return hit[1]
    _ARGS.pop(model, None)
    args = []
    names = ("wqkv", "wo", "w_gate_up", "w_down")
    for layer in model.layers:
        copies, scales = layer.row_major, None
        if copies.int4_group is None:
            packed = [copies.get(name + ":rows", getattr(layer, name), bf16_rows.pack) for name in names]
        else:  # an int4 draft: codes and their scales
            packed, sc = zip(*(copies.get(name + ":int4rows", getattr(layer, name), int4_rows.pack) for name in names))
            scales = (ctypes.c_void_p * 4)(*(t.data_ptr() for t in sc))
        bias = None if layer.bqkv is None else copies.get("bqkv:float32", layer.bqkv,
                                                          lambda w: w.detach().float().contiguous())
        ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
        args.append((ptr(layer.input_norm), ptr(layer.post_attn_norm), ptr(layer.q_norm), ptr(layer.k_norm),
                     ptr(packed[0]), ptr(bias), ptr(packed[1]), ptr(packed[2]), ptr(packed[3]), scales))
    _ARGS[model] = (key, args, tensors)  # the tensors held: an identity in the key is not reused meanwhile
    return args


def forward_layers(model, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, batch, cache,
                   length: int) -> torch.Tensor:
    """The model's layers over x [B, T, H] (bf16, updated in place and returned) for a forward
    `cpu_backend.one_call_layers` took: cos, signed_sin [B, T, 1, D] (Decoder.rope_tables), the rows' slots consecutive from
    batch.slots[0], `length` the longest row's cache length after the step. Writes the new keys and values."""
    cfg = model.cfg
    b, t, hidden = x.shape
    x = x.contiguous()
    cos, signed_sin = cos.contiguous(), signed_sin.contiguous()
    mask = causal_mask(batch.starts, batch.num_new, t, length)
    k0 = cache.keys[0]
    head = (x.data_ptr(), b, t, hidden, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size)
    rope = (cos.data_ptr(), signed_sin.data_ptr())
    tail = (int(k0.dtype == torch.float32), (ctypes.c_long * 3)(*k0.stride()[:3]), (ctypes.c_long * b)(*batch.starts),
            (ctypes.c_long * b)(*batch.num_new), None if mask is None else mask.data_ptr(), length, cfg.rms_norm_eps,
            model.scale, torch.get_num_threads())
    first = batch.slots[0] * k0.stride(0) * k0.element_size()  # the batch's first slot, in bytes
    fn = _kernel()
    for i, static in enumerate(_layer_args(model)):
        if fn(*head, *static, *rope, cache.keys[i].data_ptr() + first, cache.values[i].data_ptr() + first, *tail):
            raise MemoryError(f"layer_kernel: no memory for layer {i}'s scratch ({b} x {t} tokens)")
    return x
