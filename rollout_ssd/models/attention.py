"""Attention backends behind one interface, chosen by `EngineConfig.attention` (`select_backend`).

A forward describes its keys once (`KeyLayout`: which slot each row reads, the cache positions its new
tokens were written to, which are padding, and any visibility the caller gave as a dense mask or as
key spans); the backend turns that into what it reads (`prepare`, once per forward) and then attends
each layer's queries over that layer's whole KV cache (`__call__`):

  sdpa    PyTorch SDPA over the rows' caches cut to the read length (a view when the slots are one
          run, else a gather), with a dense [B, 1, T, L] visibility mask (none when every query sees
          every key: the equal-length decode). On every device; on CUDA, SDPA picks its fused kernel; on a
          CPU, a few queries per row over a bf16 cache take this package's C kernel through cpu_backend.py
          (kernels/few_attention.py: float32 softmax, each (row, KV head)'s keys read once); where it does
          not run (and for fp16), an explicit softmax(q k^T) v (`explicit_attention`), the CPU flash kernel
          with a mask being several times slower, except on CPU kinds where the flash kernel is the faster
          (`SDPA_FEW_QUERIES`: AMX).
  triton  the span-based Triton kernel (kernels/tree_attention.py): each query reads only
          its own keys, given as half-open spans of its slot ([Nq, S, 2] on the device), so no mask is
          built, no slot is gathered and the masked tail is never loaded. Decode's query sees
          [0, start + 1); verify's query i sees [0, start + i + 1); an SSD tree step's query sees its
          prefix and its branch's own tokens (ssd/tree.py). A causal forward of more than
          `TritonBackend.max_causal_tokens` tokens per row (a prefill) goes through SDPA: one program per
          query would re-read every key where flash attention tiles the queries. A caller's dense mask
          is refused (spans are the form this backend reads).

Padded query rows (rows shorter than the forward's T) see key 0 of their slot only: their output is
dropped, and one visible key keeps the softmax finite. Triton runs on CPU tensors only under its
interpreter (TRITON_INTERPRET=1 before triton is first imported: the tests run it in a child process),
so the CPU engine's default stays SDPA.
"""

from __future__ import annotations

import importlib.util
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch
import torch.nn.functional as F

from rollout_ssd.config import ATTENTION
from rollout_ssd.models import cpu_backend, cpu_dtype


@dataclass(frozen=True)
class KeyLayout:
    """Where one forward's keys are and which of them each query sees (made once per forward).

    slots: the slot row b reads: a host list (Decoder.forward) or a device tensor [B] (a static step);
    contiguous: slots is one increasing run of slot ids (SDPA then reads a view of the cache);
    read_len: every visible key is at a cache position < read_len;
    write_pos: [B, T] long, the cache position of query (b, i)'s own token; None: every query sees all
      of [0, read_len) (one new token per row, every row ending at read_len);
    valid: [B, T] bool, False for padded queries (None: none padded);
    mask: the caller's [B, T, >= read_len] bool visibility (True = visible), or
    spans: the caller's [B, T, S, 2] int half-open key spans per query; with neither, query (b, i)
      sees [0, write_pos[b, i] + 1) (causal over the row's cache)."""

    slots: Union[Sequence[int], torch.Tensor]
    contiguous: bool
    read_len: int
    write_pos: Optional[torch.Tensor]
    valid: Optional[torch.Tensor]
    mask: Optional[torch.Tensor]
    spans: Optional[torch.Tensor]
    device: torch.device

    def slot_tensor(self) -> torch.Tensor:
        """[B] long on the device."""
        if isinstance(self.slots, torch.Tensor):
            return self.slots
        return torch.tensor(list(self.slots), device=self.device)


class AttentionBackend(ABC):
    name: str  # EngineConfig.attention's name for it (the CPU backend asks for "sdpa"'s cache layout)

    @abstractmethod
    def prepare(self, layout: KeyLayout):
        """What every layer of this forward reads (built once, on the device)."""

    @abstractmethod
    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, prepared,
                 scale: float) -> torch.Tensor:
        """q [B, Hq, T, D]; k_cache, v_cache [S, Hkv, Lmax, D]: one layer's whole cache, this forward's
        keys already written; prepared: `prepare`'s result. Returns [B, Hq, T, D]."""


@dataclass(frozen=True)
class MaskedRead:
    """SDPA's plan: the rows' caches cut to read_len (slots lo..hi as a view, or gathered by index)."""

    mask: Optional[torch.Tensor]  # [B, 1, T, L] bool, None: every query sees every key
    lo: int
    hi: int
    index: Optional[torch.Tensor]  # [B] slot ids to gather, None: contiguous
    read_len: int

    def read(self, cache: torch.Tensor) -> torch.Tensor:  # [B, Hkv, L, D]
        if self.index is None:
            return cache[self.lo:self.hi, :, :self.read_len]
        return cache[:, :, :self.read_len].index_select(0, self.index)


def _visible_mask(layout: KeyLayout) -> Optional[torch.Tensor]:
    """[B, 1, T, L] bool for SDPA; padded queries see key 0 only."""
    if layout.write_pos is None:
        return None
    keys = torch.arange(layout.read_len, device=layout.device)
    valid = layout.valid
    if layout.mask is None and layout.spans is None:
        last = layout.write_pos if valid is None else layout.write_pos * valid
        return (keys[None, None, :] <= last[:, :, None])[:, None]
    if layout.mask is not None:
        mask = layout.mask[:, :, :layout.read_len]
    else:  # the union of the spans: [B, T, S, L] -> [B, T, L]
        lo, hi = layout.spans[..., 0, None], layout.spans[..., 1, None]
        mask = ((keys >= lo) & (keys < hi)).any(dim=2)
    if valid is not None:
        mask = mask & valid[:, :, None]
        mask[:, :, 0] |= ~valid  # padded queries see key 0 so softmax stays finite
    return mask[:, None]


# Attention of a few queries per row over a 16-bit CPU cache (decode, verify, SSD's tree steps): PyTorch's
# CPU flash kernel with a visibility mask costs several times the explicit softmax(q k^T) v on float32
# copies at batch 4 and more on CPUs without AMX (bench/RESULTS.md, "Attention of a few queries on a bf16
# CPU cache"), which is also closer to a float64 reference; few_attention.py's kernel, as close, costs less
# than either and about what the flash kernel costs on AMX ("A few-query attention kernel"), where the flash
# kernel is the faster of the other two (cpu_backend.SDPA_FEW_QUERIES_KINDS, "SDPA on AMX"). float32 caches
# and longer (prefill) rows keep SDPA.
EXPLICIT_ATTENTION_MAX_QUERIES = 16
SDPA_FEW_QUERIES = cpu_backend.cpu_kind() in cpu_backend.SDPA_FEW_QUERIES_KINDS  # read once: compiled steps trace it


def cache_dtype(model) -> torch.dtype:
    """The dtype of a model's KV cache: the model's, except a bf16 model on a CPU without bf16 units whose
    linears run the widened bf16 rows kernel (`cpu_dtype.widened_bf16`), with the SDPA backend. There the
    cache is float32: it holds the same bf16 values exactly (k and v are bf16 when written), and the
    explicit attention, which works on float32 copies of k and v, reads it without casting the whole
    cache of every layer on every step (at 24 rows of 300 positions the casts were 0.37 of a layer's
    0.97 ms: bench/RESULTS.md, "bf16 without bf16 units"); SDPA (a prefill) reads it cast back to bf16.
    Every output is bitwise what a bf16 cache gives. Twice the KV bytes of a bf16 cache."""
    if model.dtype == torch.bfloat16 and model.embed.is_cpu and isinstance(model.backend, SDPABackend) \
            and cpu_dtype.widened_bf16():
        return torch.float32
    return model.dtype


def few_queries(q: torch.Tensor) -> bool:
    """Whether this is a few-query attention call over a 16-bit model's CPU cache: q [B, Hq, T, D] 16-bit on a
    CPU, T small (over a 16-bit cache, or the float32 cache `cache_dtype` gives such a model)."""
    return q.is_cpu and q.dtype in (torch.bfloat16, torch.float16) and q.shape[2] <= EXPLICIT_ATTENTION_MAX_QUERIES


def explicit_attention_applies(q: torch.Tensor) -> bool:
    """Whether `explicit_attention` serves a few-query call the few_attention kernel does not take: on a CPU
    kind where it beats SDPA (not `SDPA_FEW_QUERIES`)."""
    return few_queries(q) and not SDPA_FEW_QUERIES


def explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
                       scale: float) -> torch.Tensor:
    """softmax(q k^T * scale, masked) v for q [B, Hq, T, D], k, v [B, Hkv, L, D] (query head h reads kv
    head h // (Hq / Hkv)), mask [B, 1, T, L] bool (True = visible) or None; in float32, cast back to q's
    dtype. Every query must see at least one key."""
    b, hq, t, d = q.shape
    hkv, length = k.shape[1], k.shape[2]
    g = hq // hkv
    scores = torch.matmul(q.reshape(b, hkv, g * t, d).float(), k.float().transpose(-1, -2)) * scale
    if mask is not None:  # [B, Hkv, g, T, L] against [B, 1, 1, T, L]
        scores = scores.view(b, hkv, g, t, length).masked_fill(~mask[:, :, None], float("-inf"))
        scores = scores.view(b, hkv, g * t, length)
    out = torch.matmul(torch.softmax(scores, dim=-1), v.float())  # [B, Hkv, g * T, D]
    return out.view(b, hq, t, d).to(q.dtype)


class SDPABackend(AttentionBackend):
    name = "sdpa"

    def prepare(self, layout: KeyLayout) -> MaskedRead:
        mask = _visible_mask(layout)
        if layout.contiguous:
            lo = layout.slots[0]
            return MaskedRead(mask, lo, lo + len(layout.slots), None, layout.read_len)
        return MaskedRead(mask, 0, 0, layout.slot_tensor(), layout.read_len)

    def __call__(self, q, k_cache, v_cache, prepared: MaskedRead, scale):
        k, v = prepared.read(k_cache), prepared.read(v_cache)
        if few_queries(q):  # a bf16 model's few queries: the kernel where it serves the call
            out = cpu_backend.few_query_attention(q, k, v, prepared.mask, scale)
            if out is not None:
                return out
        if explicit_attention_applies(q):  # where it does not run, and flash attention is not the faster
            return explicit_attention(q, k, v, prepared.mask, scale)
        if q.dtype != k.dtype:  # a float32 cache of a bf16 model (`cache_dtype`): its bf16 values back, exactly
            k, v = k.to(q.dtype), v.to(q.dtype)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=prepared.mask, scale=scale,
                                              enable_gqa=q.shape[1] != k.shape[1])


@dataclass(frozen=True)
class SpanRead:
    """The Triton backend's plan: per query (B x T of them, row-major) its slot and key spans."""

    slot: torch.Tensor   # [B * T] int32
    spans: torch.Tensor  # [B * T, S, 2] int32


def _query_spans(layout: KeyLayout, t: int) -> torch.Tensor:
    """[B, T, S, 2] long key spans per query; padded queries see [0, 1)."""
    b, dev = len(layout.slots), layout.device
    if layout.write_pos is None:  # every query sees every key
        return torch.tensor([0, layout.read_len], device=dev).expand(b, t, 1, 2)
    valid = layout.valid
    if layout.spans is None:
        last = layout.write_pos if valid is None else layout.write_pos * valid
        return torch.stack([torch.zeros_like(last), last + 1], dim=-1)[:, :, None, :]
    spans = layout.spans.long()
    if valid is None:
        return spans
    pad = torch.zeros(spans.shape[2:], dtype=torch.long, device=dev)
    pad[0, 1] = 1
    return torch.where(valid[:, :, None, None], spans, pad)


class TritonBackend(AttentionBackend):
    """Span attention with the project's Triton kernel (see the module docstring)."""

    name = "triton"
    max_causal_tokens = 16  # decode (1) and verify (K+1); longer causal rows are a prefill: SDPA

    def __init__(self, block_n: int = 64):
        from rollout_ssd.kernels.tree_attention import span_attention

        self.kernel = span_attention
        self.block_n = block_n
        self.sdpa = SDPABackend()

    def prepare(self, layout: KeyLayout) -> Union[SpanRead, MaskedRead]:
        if layout.mask is not None:
            raise ValueError("attention 'triton' reads key spans: pass spans instead of a dense mask "
                             "(or use attention 'sdpa')")
        t = 1 if layout.write_pos is None else layout.write_pos.shape[1]
        if layout.spans is None and t > self.max_causal_tokens:
            return self.sdpa.prepare(layout)
        spans = _query_spans(layout, t)
        b = spans.shape[0]
        slot = layout.slot_tensor()[:, None].expand(b, t).reshape(b * t).to(torch.int32)
        return SpanRead(slot, spans.reshape(b * t, spans.shape[2], 2).to(torch.int32))

    def __call__(self, q, k_cache, v_cache, prepared, scale):
        if isinstance(prepared, MaskedRead):
            return self.sdpa(q, k_cache, v_cache, prepared, scale)
        b, hq, t, d = q.shape
        rows = q.transpose(1, 2).reshape(b * t, hq, d)  # [B * T, Hq, D]
        out = self.kernel(rows, k_cache, v_cache, prepared.slot, prepared.spans, scale, self.block_n)
        return out.view(b, t, hq, d).transpose(1, 2)


def triton_interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def auto_attention(device: torch.device | str, static_steps: bool) -> str:
    """What attention "auto" runs for a model on `device`: "triton" for a CUDA model whose decode and
    verify run as captured static steps (`static_steps`: EngineConfig.cuda_graphs, the target), where
    triton is installed; "sdpa" otherwise. On an H200 the span kernel's graphed steps beat SDPA's at every
    shape bench/gpu_check.py measured (Llama-3-8B- and 1B-shaped, batch 1 to 64, one token and K+1): a
    static SDPA step reads every slot's whole cache, masked. Eager steps there were launch-bound and
    mixed (bench/RESULTS.md, "The engine on an H200"). Only on NVIDIA GPUs of compute capability 8.0+
    (the kernel's bf16 dots need it; ROCm, which torch also calls "cuda", has not run it)."""
    device = torch.device(device)
    if not (static_steps and device.type == "cuda" and importlib.util.find_spec("triton") is not None):
        return "sdpa"
    if torch.version.hip is not None or torch.cuda.get_device_capability(device) < (8, 0):
        return "sdpa"
    return "triton"


def select_backend(name: str, device: torch.device | str, static_steps: bool = False) -> AttentionBackend:
    """The backend `name` ("auto" | "sdpa" | "triton", EngineConfig.attention) for a model on `device`.
    auto: `auto_attention(device, static_steps)`. triton: a CUDA device, or a CPU under Triton's
    interpreter; a ValueError naming the setting otherwise."""
    device = torch.device(device)
    if name not in ATTENTION:
        raise ValueError(f"EngineConfig.attention must be one of {ATTENTION}, got {name!r}")
    has_triton = importlib.util.find_spec("triton") is not None
    if name == "auto":
        name = auto_attention(device, static_steps)
    if name == "sdpa":
        return SDPABackend()
    if not has_triton:
        raise ValueError("EngineConfig.attention='triton' needs triton installed (pip install triton)")
    if device.type == "cpu" and not triton_interpreted():
        raise ValueError("EngineConfig.attention='triton' on a CPU runs only under Triton's interpreter "
                         "(TRITON_INTERPRET=1 set before triton is first imported: for tests); use 'sdpa' or 'auto'")
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"EngineConfig.attention='triton' needs a CUDA device (or a CPU under the interpreter), "
                         f"got {device}")
    return TritonBackend()
