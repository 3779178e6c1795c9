"""ModelRunner: a model's forwards over its KV cache for a batch of slots.

It knows nothing of sampling or speculation: it turns (slot, new tokens[, positions, mask or spans]) into
logits and keeps the cache lengths right. Everything runs under `torch.inference_mode`.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from rollout_ssd.kv_cache import KVCache
from rollout_ssd.models.attention import cache_dtype
from rollout_ssd.models.decoder import Decoder, ForwardBatch

# A prefill of many long prompts is split so one padded forward holds at most this many tokens.
PREFILL_TOKENS_PER_FORWARD = 4096


class ModelRunner:
    def __init__(self, model: Decoder, num_slots: int, max_len: int):
        cfg = model.cfg
        self.model = model
        self.device = model.embed.device
        self.static = None  # GraphedSteps, once `use_static_steps` is called
        self.cache = KVCache(cfg.num_layers, num_slots, max_len, cfg.num_kv_heads, cfg.head_dim,
                             dtype=cache_dtype(model), device=self.device)

    def use_static_steps(self, buckets=None, graphs: Optional[bool] = None, compiled=False,
                         pad_t: Optional[int] = None) -> None:
        """Run equal-length batches (and, with pad_t, ragged verify rows padded to pad_t tokens) through
        static-shape steps per batch bucket (rollout_ssd/gpu/graphs.py), captured as CUDA graphs on a
        CUDA device, compiled on a CPU with `compiled` ("frozen" or True, "live"); rows they do not
        cover, and explicit positions or masks still run eagerly. On a CPU without
        `compiled` the static steps run eagerly (what the tests check). Head-only logits (a draft's
        restricted head) have steps of their own."""
        from rollout_ssd.gpu.graphs import BUCKETS, GraphedSteps

        self.static = GraphedSteps(self.model, self.cache, buckets or BUCKETS, graphs=graphs, compiled=compiled,
                                   pad_t=pad_t)

    @property
    def max_len(self) -> int:
        return self.cache.max_len

    def allocate(self) -> int:
        return self.cache.allocate()

    def free(self, slot: int) -> None:
        self.cache.free(slot)

    def move_down(self, slot: int) -> int:
        return self.cache.move_down(slot)

    def length(self, slot: int) -> int:
        return self.cache.lengths[slot]

    def rollback(self, slot: int, length: int) -> None:
        self.cache.rollback(slot, length)

    @torch.inference_mode()
    def extend(self, slots: Sequence[int], tokens: Sequence[Sequence[int]],
               positions: Optional[torch.Tensor] = None, mask: Optional[torch.Tensor] = None,
               last_only: bool = False, head_only: bool = False, spans: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Append tokens[b] to slot b and return float32 logits [B, T, V] (or [B, V] at each row's last
        new token if last_only). positions: optional [B, T] (default: consecutive after the cache);
        mask: optional [B, T, L] bool over cache positions, or spans: optional [B, T, S, 2] int half-open
        key spans per query (`ForwardBatch`; default: causal). head_only: logits over the LM head's rows
        only (`Decoder.head_logits`: a restricted head's width, not the vocabulary's)."""
        b = len(slots)
        if b == 0:
            raise ValueError("extend needs at least one row")
        num_new = [len(t) for t in tokens]
        if min(num_new) < 1:
            raise ValueError("every row needs at least one new token")
        t_max = max(num_new)
        static = self.static is not None and positions is None and mask is None and spans is None
        t = self.static.step_tokens(slots, num_new) if static else None
        # the positions this forward writes (a static step pads each row to t; padded rows write the
        # scratch slot's first positions), backed first
        if self.cache.backs_ahead:
            ends = [self.cache.lengths[s] + max(n, t or 0) for s, n in zip(slots, num_new)]
            self.cache.back([*slots, self.cache.scratch_slot], ends + [max(t_max, t or 0)])
        if static:
            out = None if t is None else self.static.run(list(slots), tokens, last_only, head_only, t=t)
            if out is not None:  # None: no step for these rows, or its compile failed (then eager from now on)
                return out
        starts = [self.cache.lengths[s] for s in slots]
        tok = torch.zeros(b, t_max, dtype=torch.long)
        for i, row in enumerate(tokens):
            tok[i, : len(row)] = torch.as_tensor(row, dtype=torch.long)
        if positions is None:
            positions = torch.tensor(starts)[:, None] + torch.arange(t_max)[None, :]
        # inputs are built on the host and moved once (a no-op on a CPU)
        dev = self.device
        tok, positions = tok.to(dev, non_blocking=True), positions.to(dev, non_blocking=True)
        if mask is not None:
            mask = mask.to(dev, non_blocking=True)
        if spans is not None:
            spans = spans.to(dev, non_blocking=True)
        batch = ForwardBatch(tok, positions, num_new, list(slots), starts, mask, spans)
        hidden = self.model(batch, self.cache)
        logits = self.model.head_logits if head_only else self.model.logits
        if last_only:
            idx = torch.tensor(num_new, device=dev) - 1
            return logits(hidden[torch.arange(b, device=dev), idx])
        return logits(hidden)

    def prefill(self, slots: Sequence[int], prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        """Ragged batched prefill; returns the logits after each prompt's last token [B, V]. A prompt that
        an earlier row into an empty slot already holds (a GRPO group's n samples of one prompt) is computed
        once: its KV is copied into the other empty slots and its logits row repeated."""
        source: dict[tuple, int] = {}  # prompt -> the row that computes it
        rows = []  # per row: the row whose KV and logits it takes (itself where it computes them)
        for i, (slot, p) in enumerate(zip(slots, prompts)):
            key = tuple(p) if self.cache.lengths[slot] == 0 else (None, i)
            rows.append(source.setdefault(key, i))
        unique = sorted(set(rows))
        if len(unique) == len(rows):
            return self._prefill(slots, prompts)
        logits = self._prefill([slots[i] for i in unique], [prompts[i] for i in unique])
        for i, j in enumerate(rows):
            if i != j:
                self.cache.copy(slots[j], slots[i], len(prompts[i]))
        at = {j: n for n, j in enumerate(unique)}
        return logits[torch.tensor([at[j] for j in rows], device=logits.device)]

    def _prefill(self, slots: Sequence[int], prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        out, group = [], []
        for i, p in enumerate(prompts):
            longest = max([len(prompts[j]) for j in group] + [len(p)])
            if group and longest * (len(group) + 1) > PREFILL_TOKENS_PER_FORWARD:
                out.append(self.extend([slots[j] for j in group], [prompts[j] for j in group], last_only=True))
                group = []
            group.append(i)
        if group:
            out.append(self.extend([slots[j] for j in group], [prompts[j] for j in group], last_only=True))
        return torch.cat(out, dim=0)

    def decode(self, slots: Sequence[int], tokens: Sequence[int], head_only: bool = False) -> torch.Tensor:
        """One new token per row; returns logits [B, V] (head_only: over the LM head's rows)."""
        return self.extend(slots, [[t] for t in tokens], last_only=True, head_only=head_only)
