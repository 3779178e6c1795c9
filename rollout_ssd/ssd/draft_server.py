"""DraftServer: the draft side of SSD. It owns the draft model, its KV cache, every sequence's draft view
and the speculation cache, and answers the typed messages of ssd/messages.py.

The same object serves in process (SSDDecode calls `handle` directly, and construction runs serially
before verification) and inside the worker process (ssd/worker_process.py feeds it decoded messages, and
construction overlaps the target's verification). It trusts nothing it is sent: unknown sequences,
token ids outside the vocabulary and verdicts that do not match the chain it was told raise
`ProtocolError` (in the worker that ends the process; the target side then falls back).

Per sequence it keeps the committed tokens it knows of and the chain under verification; a verdict
(k, t*) extends the committed tokens by chain[:k] + [t*] and is looked up in the cache.

New draft weights arrive between rounds (`apply_update`, a verified weight_sync transfer; in process the
weights are written directly and `on_weights_changed` is called). Everything derived from the old
weights goes: the speculation cache is emptied and every sequence's draft KV is cut to zero, so the
next glue forward or on-demand chain recomputes it from the committed tokens under the new weights.
(Dropping is for quality, not exactness: a chain is verified against the q it was drawn from.)
"""

from __future__ import annotations

import hashlib
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
    DraftDigest,
    DraftWeightsReply,
    Message,
    ReleaseSequences,
    UpdateDraftWeights,
    Verdicts,
)
from rollout_ssd.ssd.tree import BuildStats, DraftSeq, SaguaroRule, TreeDrafter
from rollout_ssd.weight_sync import Ack, Packet, Transport, TransportError, WeightReceiver, WeightSyncError
from rollout_ssd.weight_sync.codec import checksum


class ProtocolError(ValueError):
    """A message that contradicts the draft side's state."""


def weights_digest(params: dict[str, torch.Tensor]) -> int:
    """A signed int64 digest of named tensors: sha256 over (name, dtype, shape, weight_sync checksum of the
    bytes) in name order. Equal digests mean bitwise-equal weights (up to hash collisions)."""
    h = hashlib.sha256()
    for name in sorted(params):
        t = params[name]
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|{checksum(t)};".encode())
    return int.from_bytes(h.digest()[:8], "little", signed=True)


class _OnePacket(Transport):
    """A transport holding one packet already read from shared memory; acks are kept, not sent."""

    num_receivers = 1

    def __init__(self, packet: Packet):
        self._packet: Optional[Packet] = packet
        self.acks: list[Ack] = []

    def send(self, packet: Packet) -> int:
        raise TypeError("the draft side never sends weights")

    def receive(self, timeout: Optional[float] = None) -> Packet:
        if self._packet is None:
            raise TransportError("no draft weight update is waiting")
        packet, self._packet = self._packet, None
        return packet

    def send_ack(self, ack: Ack) -> None:
        self.acks.append(ack)

    def receive_acks(self, version: int, timeout: Optional[float] = None) -> list[Ack]:
        raise TypeError("the draft side receives no acks")


def draft_max_len(max_model_len: int, k: int, max_branches: int) -> int:
    """Draft KV length per slot: the context, the glue and every branch's K tokens."""
    return max_model_len + (k + 1) + k * max_branches + 1


class DraftServer:
    def __init__(self, model: Decoder, num_slots: int, max_model_len: int, k: int, max_branches: int,
                 saguaro: SaguaroRule = SaguaroRule(), draft_version: int = 0):
        self.model = model
        self.draft_version = draft_version
        self.transfer = 0  # the last weight transfer applied (UpdateDraftWeights.transfer)
        self.last_error = ""  # why the last rejected update was rejected
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
        elif isinstance(msg, DraftDigest):
            return DraftWeightsReply(True, self.transfer, self.draft_version,
                                     weights_digest(self.model.hf_parameters()))
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

    # ------------------------------------------------------------------ draft weights
    def apply_update(self, packet: Packet, msg: UpdateDraftWeights) -> DraftWeightsReply:
        """Verify a weight_sync transfer (manifest, bucket and tensor checksums, names, shapes, dtypes,
        finite values, transfer newer than the last and, for deltas, based on exactly the weights held)
        and apply it; on any rejection nothing changes and the reply says so."""
        params = self.model.hf_parameters()
        receiver = WeightReceiver(_OnePacket(packet), version=self.transfer, reference=params)
        try:
            if packet.version != msg.transfer:
                raise WeightSyncError(f"transfer {packet.version} does not match the message's {msg.transfer}")
            receiver.receive().apply_to(params)
        except WeightSyncError as err:
            self.last_error = str(err)
            return DraftWeightsReply(False, self.transfer, self.draft_version, 0)
        self.transfer = msg.transfer
        self.on_weights_changed(msg.draft_version)
        return DraftWeightsReply(True, self.transfer, self.draft_version, 0)  # digest on request only

    def on_weights_changed(self, draft_version: int) -> None:
        """The draft's weights were replaced: drop the cache and every sequence's draft KV."""
        self.draft_version = draft_version
        self.cache = SpeculationCache()
        for st in self.seqs.values():
            st.base, st.spec = 0, []
            self.runner.rollback(st.slot, 0)

    # ------------------------------------------------------------------ helpers
    def _seq(self, seq_id: int) -> DraftSeq:
        st = self.seqs.get(seq_id)
        if st is None:
            raise ProtocolError(f"unknown sequence {seq_id}")
        return st

    def _check_tokens(self, tokens) -> None:
        if any(not 0 <= t < self.vocab for t in tokens):
            raise ProtocolError(f"token ids outside [0, {self.vocab})")
