"""DraftServer: the draft side of SSD. It owns the draft model, its KV cache, every sequence's draft view
and the speculation cache, and answers the typed messages of ssd/messages.py.

The same object serves in process (SSDDecode calls `handle` directly, and construction runs serially
before verification) and inside the worker process (ssd/worker.py feeds it decoded messages, and
construction overlaps the target's verification). It trusts nothing it is sent: unknown sequences,
token ids outside the vocabulary and verdicts that do not match the chain it was told raise
`ProtocolError` (in the worker that ends the process; the target side then falls back).

Per sequence it keeps the committed tokens it knows of and the chain under verification; a verdict
(k, t*) extends the committed tokens by chain[:k] + [t*] and is looked up in the cache.
"""

from __future__ import annotations

import time
from typing import Optional

import torch

from rollout_ssd.models.decoder import Decoder
from rollout_ssd.runner import ModelRunner
from rollout_ssd.ssd.cache import SpeculationCache
from rollout_ssd.ssd.messages import (
    DRAFTED,
    HIT,
    MISS,
    SYNC,
    AdmitSequences,
    Barrier,
    BarrierReply,
    BuildCache,
    ChainReply,
    ChainRow,
    Message,
    ReleaseSequences,
    Verdicts,
)
from rollout_ssd.ssd.tree import BuildStats, DraftSeq, SaguaroRule, TreeDrafter


class ProtocolError(ValueError):
    """A message that contradicts the draft side's state."""


def draft_max_len(max_model_len: int, k: int, max_branches: int) -> int:
    """Draft KV length per slot: the context, the glue and every branch's K tokens."""
    return max_model_len + (k + 1) + k * max_branches + 1


class DraftServer:
    def __init__(self, model: Decoder, num_slots: int, max_model_len: int, k: int, max_branches: int,
                 saguaro: SaguaroRule = SaguaroRule()):
        self.model = model
        self.vocab = model.cfg.vocab_size
        self.k = k
        self.max_branches = max_branches
        self.runner = ModelRunner(model, num_slots=num_slots, max_len=draft_max_len(max_model_len, k, max_branches))
        self.drafter = TreeDrafter(model, self.runner, k, saguaro)
        self.cache = SpeculationCache()
        self.seqs: dict[int, DraftSeq] = {}
        self._last_build = BuildStats()

    def handle(self, msg: Message) -> Optional[Message]:
        if isinstance(msg, Verdicts):
            return self.resolve(msg)
        if isinstance(msg, BuildCache):
            self.build(msg)
        elif isinstance(msg, AdmitSequences):
            self.admit(msg)
        elif isinstance(msg, ReleaseSequences):
            self.release(msg)
        elif isinstance(msg, Barrier):
            return BarrierReply()
        else:
            raise ProtocolError(f"the draft side does not handle {type(msg).__name__}")
        return None

    # ------------------------------------------------------------------ lifecycle
    def admit(self, msg: AdmitSequences) -> None:
        new = []
        for row in msg.rows:
            if row.seq_id in self.seqs:
                raise ProtocolError(f"sequence {row.seq_id} is already admitted")
            if not row.tokens:
                raise ProtocolError(f"sequence {row.seq_id} has an empty context")
            self._check_tokens(row.tokens)
            if len(row.tokens) >= self.runner.max_len:
                raise ProtocolError(f"sequence {row.seq_id}: context of {len(row.tokens)} tokens is too long")
            st = DraftSeq(row.seq_id, self.runner.allocate(), row.key, row.temperature, row.top_k, row.top_p,
                          list(row.tokens))
            self.seqs[row.seq_id] = st
            new.append(st)
        if new:
            self.runner.prefill([st.slot for st in new], [st.committed for st in new])
            for st in new:
                st.base = len(st.committed)

    def release(self, msg: ReleaseSequences) -> None:
        for seq_id in msg.seq_ids:
            st = self.seqs.pop(seq_id, None)
            if st is not None:
                self.runner.free(st.slot)
                self.cache.drop(seq_id)

    # ------------------------------------------------------------------ per round
    def resolve(self, msg: Verdicts) -> ChainReply:
        """Apply each verdict, look it up, and draft on demand where asked."""
        rows: list[Optional[ChainRow]] = []
        to_draft: list[int] = []
        cached_at: list[int] = []
        for i, v in enumerate(msg.rows):
            st = self._seq(v.seq_id)
            cached = -1
            hit = None
            if v.k == SYNC:
                self._check_tokens(v.tail)
                st.committed += v.tail
                self.cache.drop(v.seq_id)
            else:
                if not 0 <= v.k <= len(st.chain):
                    raise ProtocolError(f"sequence {v.seq_id}: verdict k={v.k} for a chain of {len(st.chain)}")
                self._check_tokens((v.bonus,))
                st.committed += st.chain[: v.k] + [v.bonus]
                if self.cache.has(v.seq_id):
                    cached = self.cache.fanout_at(v.seq_id, v.k)
                hit = self.cache.take(v.seq_id, v.k, v.bonus, v.length)
            if len(st.committed) != v.num_committed:
                raise ProtocolError(f"sequence {v.seq_id}: the draft has {len(st.committed)} committed tokens, "
                                    f"the target {v.num_committed}")
            st.chain = []
            cached_at.append(cached)
            if v.length <= 0:
                rows.append(ChainRow(v.seq_id, HIT if hit is not None else MISS, cached, (), torch.zeros(0, self.vocab)))
            elif hit is not None:
                rows.append(ChainRow(v.seq_id, HIT, cached, tuple(hit.tokens), hit.q))
            elif v.draft_on_miss:
                rows.append(None)
                to_draft.append(i)
            else:
                rows.append(ChainRow(v.seq_id, MISS, cached, (), torch.zeros(0, self.vocab)))
        t0 = time.perf_counter()
        if to_draft:
            seqs = [self.seqs[msg.rows[i].seq_id] for i in to_draft]
            chains = self.drafter.draft(seqs, [msg.rows[i].length for i in to_draft], msg.fanout)
            for i, (tokens, q) in zip(to_draft, chains):
                rows[i] = ChainRow(msg.rows[i].seq_id, DRAFTED, cached_at[i], tuple(tokens), q)
        backup = time.perf_counter() - t0
        last = self._last_build
        self._last_build = BuildStats()
        return ChainReply(tuple(rows), self.vocab, last.seconds, last.glue_seconds, backup, last.branches)

    def build(self, msg: BuildCache) -> None:
        """Remember each chain; construct the cache for those flagged."""
        todo = []
        for row in msg.rows:
            st = self._seq(row.seq_id)
            self._check_tokens(row.chain)
            if len(row.chain) > self.k:
                raise ProtocolError(f"sequence {row.seq_id}: chain of {len(row.chain)} > k={self.k}")
            st.chain = list(row.chain)
            self.cache.drop(row.seq_id)
            if row.build:
                todo.append(st)
        if len(msg.fanout) != self.k + 1 or sum(msg.fanout) > self.max_branches or min(msg.fanout, default=0) < 0:
            raise ProtocolError(f"fan-out {msg.fanout} does not fit k={self.k}, max_branches={self.max_branches}")
        if todo:
            entries = self.drafter.build(todo, msg.fanout, self._last_build)
            for seq_id, e in entries.items():
                self.cache.put(seq_id, e)

    # ------------------------------------------------------------------ helpers
    def _seq(self, seq_id: int) -> DraftSeq:
        st = self.seqs.get(seq_id)
        if st is None:
            raise ProtocolError(f"unknown sequence {seq_id}")
        return st

    def _check_tokens(self, tokens) -> None:
        if any(not 0 <= t < self.vocab for t in tokens):
            raise ProtocolError(f"token ids outside [0, {self.vocab})")
