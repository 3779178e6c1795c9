"""Tree attention for SSD branch decoding: metadata, mask, SDPA path and fp64 reference.

SSD builds its speculation cache by decoding K tokens for every branch of every sequence, all in one
forward per step (docs/THEORY.md §2). A sequence's draft KV cache slot holds

    [ prefix (committed context) | glue (the K+1 tokens just sent) | branch tokens ]

and the query of branch j at step t sees three key intervals of its slot, half-open, in cache order:

    prefix  [0, prefix_len)
    glue    [glue_start, glue_start + fork_depth + 1)          glue tokens 0..fork_depth
    branch  [branch_start, branch_start + branch_len)          its earlier tokens and the current one

so a query is one row of `TreeAttentionMetadata` and the mask is the union of its three spans. The
spans must be ordered and disjoint (prefix_len <= glue_start, glue end <= branch_start); gaps between
them are allowed, which lets a slot keep fixed regions. `TreeAttentionMetadata.packed` builds the
canonical layout: glue right after the prefix, and branch r of a sequence at
`prefix_len + glue_len + r * branch_capacity`, so every branch appends into its own contiguous run.

Shapes: q [Nq, Hq, D] (one row per branch query, all sequences flattened); k_cache, v_cache
[S, Hkv, Lmax, D] (one slot per sequence, keys already position-encoded); Hq = g * Hkv (GQA: query head
h reads kv head h // g); out [Nq, Hq, D] in q's dtype. Every query sees at least its current token.

This file needs only torch; the Triton kernel lives in tree_attention.py and reads the same metadata.
The engine's tree steps do not use this layout: ssd/tree.py appends branches step-major and hands the
attention backend per-query key spans (models/attention.py), which the same kernel reads through
`span_attention`; this metadata, its SDPA path and the float64 loop are the kernel's references.
"""

import copy
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

_FIELDS = ("slot", "prefix_len", "glue_start", "fork_depth", "branch_start", "branch_len")


@dataclass(frozen=True)
class TreeAttentionMetadata:
    """Which keys each branch query sees: one entry per query, every field an int tensor [Nq].

    Build it on the host (validation reads the values once); move it with `.to(device)`.
    """

    slot: torch.Tensor          # [Nq] cache slot of the query's sequence
    prefix_len: torch.Tensor    # [Nq] prefix keys [0, prefix_len)
    glue_start: torch.Tensor    # [Nq] first glue key
    fork_depth: torch.Tensor    # [Nq] the branch sees glue tokens 0..fork_depth (inclusive)
    branch_start: torch.Tensor  # [Nq] first key of the query's own branch
    branch_len: torch.Tensor    # [Nq] branch tokens so far, the current one included (>= 1)
    max_key_end: int = field(init=False)  # 1 + last key any query sees: the cache must be this long
    num_slots: int = field(init=False)    # 1 + largest slot index

    def __post_init__(self) -> None:
        tensors = [getattr(self, name) for name in _FIELDS]
        nq = self.slot.shape[0] if isinstance(self.slot, torch.Tensor) and self.slot.dim() == 1 else -1
        for name, t in zip(_FIELDS, tensors):
            if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.shape[0] != nq:
                raise ValueError(f"{name}: expected a 1-D tensor of length Nq={nq}")
            if t.dtype not in (torch.int32, torch.int64):
                raise ValueError(f"{name}: expected int32 or int64, got {t.dtype}")
            if t.device != tensors[0].device:
                raise ValueError(f"{name}: on {t.device}, slot is on {tensors[0].device}")
        glue_end = self.glue_start + self.fork_depth + 1
        checks = {
            "slot": self.slot >= 0,
            "prefix_len": (self.prefix_len >= 0) & (self.prefix_len <= self.glue_start),
            "fork_depth": (self.fork_depth >= 0) & (glue_end <= self.branch_start),
            "branch_len": self.branch_len >= 1,
        }
        for name, ok in checks.items():
            if not bool(ok.all()):
                bad = int((~ok).nonzero()[0, 0])
                raise ValueError(f"{name}: query {bad} breaks 0 <= prefix_len <= glue_start, "
                                 f"glue_start + fork_depth + 1 <= branch_start, branch_len >= 1, slot >= 0")
        end = self.branch_start + self.branch_len
        object.__setattr__(self, "max_key_end", int(end.max()) if nq else 0)
        object.__setattr__(self, "num_slots", int(self.slot.max()) + 1 if nq else 0)

    @property
    def num_queries(self) -> int:
        return self.slot.shape[0]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "TreeAttentionMetadata":
        """The same metadata on `device`, without validating (and syncing) again."""
        moved = copy.copy(self)
        for name in _FIELDS:
            object.__setattr__(moved, name, getattr(self, name).to(device, non_blocking=non_blocking))
        return moved

    def key_spans(self) -> torch.Tensor:
        """[Nq, 3, 2] int32 half-open (start, end) of prefix, glue and branch; adjacent spans merged."""
        glue_end = self.glue_start + self.fork_depth + 1
        # When the glue follows the prefix directly, read [0, glue_end) as one span (no split block).
        merged = self.prefix_len == self.glue_start
        prefix_end = torch.where(merged, glue_end, self.prefix_len)
        glue_start = torch.where(merged, glue_end, self.glue_start)
        zero = torch.zeros_like(self.slot)
        spans = torch.stack([zero, prefix_end, glue_start, glue_end,
                             self.branch_start, self.branch_start + self.branch_len], dim=1)
        return spans.view(-1, 3, 2).to(torch.int32)

    @classmethod
    def packed(cls, prefix_len: torch.Tensor, glue_len: int, seq_of_query: torch.Tensor,
               fork_depth: torch.Tensor, step: int, branch_capacity: int) -> "TreeAttentionMetadata":
        """Canonical layout: slot b = sequence b, glue at prefix_len[b], branches after it in query order.

        prefix_len [B]; seq_of_query, fork_depth [Nq] (one query per branch, queries of a sequence
        in branch order); step: tokens each branch has decoded before this one (0 at the first step).
        """
        if not 0 <= step < branch_capacity:
            raise ValueError(f"step: {step} not in [0, branch_capacity={branch_capacity})")
        if bool((fork_depth >= glue_len).any()):
            raise ValueError(f"fork_depth: must be < glue_len={glue_len}")
        seq = seq_of_query.long()
        if bool((seq[1:] < seq[:-1]).any()):
            raise ValueError("seq_of_query: queries must be grouped by sequence in ascending order")
        first_query_of_seq = torch.searchsorted(seq, seq)
        rank = torch.arange(seq.shape[0], device=seq.device) - first_query_of_seq
        prefix = prefix_len.long()[seq]
        return cls(
            slot=seq,
            prefix_len=prefix,
            glue_start=prefix,
            fork_depth=fork_depth.long(),
            branch_start=prefix + glue_len + rank * branch_capacity,
            branch_len=torch.full_like(seq, step + 1),
        )


def build_tree_mask(meta: TreeAttentionMetadata, max_len: int) -> torch.Tensor:
    """[Nq, max_len] bool: True where query i may attend to key position l of its slot."""
    if meta.max_key_end > max_len:
        raise ValueError(f"max_len: {max_len} < {meta.max_key_end}, the end of the last visible key")
    pos = torch.arange(max_len, device=meta.slot.device)[None, :]  # [1, L]
    spans = meta.key_spans().long()                                # [Nq, 3, 2]
    mask = torch.zeros(meta.num_queries, max_len, dtype=torch.bool, device=meta.slot.device)
    for s in range(3):
        mask |= (pos >= spans[:, s, 0:1]) & (pos < spans[:, s, 1:2])
    return mask


def check_shapes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """q [Nq, Hq, D] and caches [S, Hkv, Lmax, D] of one head dim, Hq a multiple of Hkv (ValueError)."""
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"q: expected [Nq, Hq, D] and caches [S, Hkv, Lmax, D], got "
                         f"{tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    hq, d = q.shape[1:]
    hkv, dk = k_cache.shape[1], k_cache.shape[3]
    if dk != d or hq % hkv != 0:
        raise ValueError(f"q: head dim {d} vs cache {dk}; Hq={hq} must be a multiple of Hkv={hkv}")


def _check_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: TreeAttentionMetadata) -> None:
    check_shapes(q, k_cache, v_cache)
    nq = q.shape[0]
    s, max_len = k_cache.shape[0], k_cache.shape[2]
    if meta.num_queries != nq:
        raise ValueError(f"meta: {meta.num_queries} queries, q has {nq}")
    if meta.num_slots > s or meta.max_key_end > max_len:
        raise ValueError(f"meta: needs {meta.num_slots} slots x {meta.max_key_end} keys, "
                         f"cache has {s} x {max_len}")


def tree_attention_sdpa(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: TreeAttentionMetadata, sm_scale: float | None = None) -> torch.Tensor:
    """Tree attention with torch SDPA and an explicit mask: q [Nq, Hq, D] -> [Nq, Hq, D].

    Queries are grouped by slot so each used cache slot is read once, not once per branch:
    q is scattered into [S', Hq, Qmax, D] (S' used slots, Qmax most queries in one slot).
    """
    _check_inputs(q, k_cache, v_cache, meta)
    nq, hq, d = q.shape
    if nq == 0:
        return q.new_empty(q.shape)
    mask = build_tree_mask(meta, k_cache.shape[2])                        # [Nq, L]
    slots, group, counts = torch.unique(meta.slot, return_inverse=True, return_counts=True)
    first = torch.cumsum(counts, 0) - counts                              # [S'] first query of each group
    order = torch.argsort(group, stable=True)
    rank = torch.empty_like(group)
    rank[order] = torch.arange(nq, device=q.device) - first[group[order]]  # [Nq] row within its group
    q_max = int(counts.max())
    q_grouped = q.new_zeros(slots.shape[0], hq, q_max, d)
    q_grouped[group, :, rank] = q
    mask_grouped = torch.zeros(slots.shape[0], 1, q_max, mask.shape[1], dtype=torch.bool, device=q.device)
    mask_grouped[group, 0, rank] = mask
    out = F.scaled_dot_product_attention(q_grouped, k_cache[slots], v_cache[slots],
                                         attn_mask=mask_grouped, scale=sm_scale, enable_gqa=True)
    return out[group, :, rank]                                            # [Nq, Hq, D]


def tree_attention_reference_fp64(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                  meta: TreeAttentionMetadata,
                                  sm_scale: float | None = None) -> torch.Tensor:
    """Plain float64 loop over queries, keys listed from the metadata fields: [Nq, Hq, D] float64.

    Independent of `key_spans` and `build_tree_mask`, so it also checks them.
    """
    _check_inputs(q, k_cache, v_cache, meta)
    nq, hq, d = q.shape
    group = hq // k_cache.shape[1]
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    out = torch.zeros(nq, hq, d, dtype=torch.float64, device=q.device)
    for i in range(nq):
        prefix_len, glue_start, fork_depth, branch_start, branch_len = (
            int(getattr(meta, name)[i]) for name in _FIELDS[1:])
        keys = torch.cat([torch.arange(prefix_len),
                          torch.arange(glue_start, glue_start + fork_depth + 1),
                          torch.arange(branch_start, branch_start + branch_len)]).to(q.device)
        slot = int(meta.slot[i])
        k = k_cache[slot][:, keys].double().repeat_interleave(group, dim=0)  # [Hq, n, D]
        v = v_cache[slot][:, keys].double().repeat_interleave(group, dim=0)
        scores = (q[i].double()[:, None, :] @ k.transpose(1, 2))[:, 0] * scale  # [Hq, n]
        out[i] = (torch.softmax(scores, dim=-1)[:, None, :] @ v)[:, 0]
    return out
