"""Typed messages between the target side (SSDDecode) and the draft side (DraftServer), one dataclass per
command, and their encoding as tensors: a flat int64 payload (floats as their float64 bit patterns) plus,
for chain replies, a flat float32 payload (the q rows). Nothing is ever pickled: a peer's bytes are only
ever read as int64 / float32 arrays, and every count is checked against the payload length.

Per round (docs/THEORY.md §2):
  target -> draft  Verdicts      per sequence: the verdict (k, t*) of the chain it last verified, or the
                                 tokens committed since the draft last heard of it; the chain length wanted
  draft -> target  ChainReply    per sequence: HIT (chain + q from the speculation cache), DRAFTED (the
                                 draft model ran on demand) or MISS (the target's fast backup covers it)
  target -> draft  BuildCache    the chains now sent for verification; the draft builds the next cache
                                 from them while the target verifies (no reply)
Around it: AdmitSequences (prefill; no reply), ReleaseSequences, Barrier -> BarrierReply, Shutdown,
and Ready (draft -> target, once, after loading).
Draft weights (between rounds): UpdateDraftWeights -> DraftWeightsReply (the new tensors travel as a
weight_sync transfer in a file of the worker's shared-memory directory; the message holds only its
sizes), and DraftDigest -> DraftWeightsReply (a digest of every draft weight, to check it from outside).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import ClassVar

import torch

HIT, DRAFTED, MISS = 0, 1, 2
SYNC = -1  # VerdictRow.k for "no verdict: here are the committed tokens you have not seen"


class MalformedMessage(ValueError):
    """A peer sent a payload that does not decode."""


def _f2i(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _i2f(x: int) -> float:
    return struct.unpack("<d", struct.pack("<q", int(x)))[0]


class _Reader:
    def __init__(self, ints: list[int]):
        self.ints, self.pos = ints, 0

    def take(self, n: int = 1) -> list[int]:
        if n < 0 or self.pos + n > len(self.ints):
            raise MalformedMessage(f"payload too short: need {n} ints at {self.pos}, have {len(self.ints)}")
        out = self.ints[self.pos: self.pos + n]
        self.pos += n
        return out

    def one(self) -> int:
        return self.take(1)[0]

    def done(self) -> None:
        if self.pos != len(self.ints):
            raise MalformedMessage(f"payload has {len(self.ints) - self.pos} trailing ints")


class Message:
    KIND: ClassVar[int]

    def encode(self) -> tuple[list[int], torch.Tensor | None]:
        """(int64 payload, float32 payload or None)."""
        return [], None

    @classmethod
    def decode(cls, ints: list[int], floats: torch.Tensor | None) -> "Message":
        _Reader(ints).done()
        return cls()


@dataclass(frozen=True)
class AdmitRow:
    seq_id: int
    key: int  # draft RNG key (ssd/rng.py)
    temperature: float
    top_k: int
    top_p: float
    tokens: tuple[int, ...]  # the context to prefill (the draft then holds all of it)


@dataclass(frozen=True)
class AdmitSequences(Message):
    KIND: ClassVar[int] = 1
    rows: tuple[AdmitRow, ...]

    def encode(self):
        out = [len(self.rows)]
        for r in self.rows:
            out += [r.seq_id, r.key, _f2i(r.temperature), r.top_k, _f2i(r.top_p), len(r.tokens), *r.tokens]
        return out, None

    @classmethod
    def decode(cls, ints, floats):
        rd = _Reader(ints)
        rows = []
        for _ in range(rd.one()):
            seq_id, key, temp, top_k, top_p, n = rd.take(6)
            rows.append(AdmitRow(seq_id, key, _i2f(temp), top_k, _i2f(top_p), tuple(rd.take(n))))
        rd.done()
        return cls(tuple(rows))


@dataclass(frozen=True)
class ReleaseSequences(Message):
    KIND: ClassVar[int] = 2
    seq_ids: tuple[int, ...]

    def encode(self):
        return [len(self.seq_ids), *self.seq_ids], None

    @classmethod
    def decode(cls, ints, floats):
        rd = _Reader(ints)
        ids = tuple(rd.take(rd.one()))
        rd.done()
        return cls(ids)


@dataclass(frozen=True)
class VerdictRow:
    seq_id: int
    k: int  # accepted tokens of the chain last sent, or SYNC
    bonus: int  # t* (unused for SYNC)
    num_committed: int  # committed tokens after this verdict (a consistency check)
    length: int  # chain length wanted for the next round (0: none)
    draft_on_miss: bool  # run the draft model on a miss (else report MISS)
    tail: tuple[int, ...] = ()  # SYNC: committed tokens the draft has not seen


@dataclass(frozen=True)
class Verdicts(Message):
    KIND: ClassVar[int] = 3
    rows: tuple[VerdictRow, ...]
    fanout: tuple[int, ...]  # the current plan F_0..F_k (Saguaro's bend for on-demand chains)

    def encode(self):
        out = [len(self.fanout), *self.fanout, len(self.rows)]
        for r in self.rows:
            out += [r.seq_id, r.k, r.bonus, r.num_committed, r.length, int(r.draft_on_miss), len(r.tail), *r.tail]
        return out, None

    @classmethod
    def decode(cls, ints, floats):
        rd = _Reader(ints)
        fanout = tuple(rd.take(rd.one()))
        rows = []
        for _ in range(rd.one()):
            seq_id, k, bonus, n, length, on_miss, n_tail = rd.take(7)
            rows.append(VerdictRow(seq_id, k, bonus, n, length, bool(on_miss), tuple(rd.take(n_tail))))
        rd.done()
        return cls(tuple(rows), fanout)


@dataclass(frozen=True)
class ChainRow:
    seq_id: int
    status: int  # HIT | DRAFTED | MISS
    cached: int  # bonus candidates the cache held at the verdict's depth (-1: no cache was built)
    tokens: tuple[int, ...]
    q: torch.Tensor  # [len(tokens), V] float32


@dataclass(frozen=True)
class ChainReply(Message):
    KIND: ClassVar[int] = 4
    rows: tuple[ChainRow, ...]
    vocab: int
    build_seconds: float = 0.0  # the last cache construction (glue + tree), T_p's numerator
    glue_seconds: float = 0.0  # its fixed part
    backup_seconds: float = 0.0  # on-demand drafting in this reply, T_b's numerator
    branches: int = 0  # branches in the last construction

    def encode(self):
        out = [self.vocab, _f2i(self.build_seconds), _f2i(self.glue_seconds), _f2i(self.backup_seconds),
               self.branches, len(self.rows)]
        qs = []
        for r in self.rows:
            out += [r.seq_id, r.status, r.cached, len(r.tokens), *r.tokens]
            qs.append(r.q.reshape(-1).float())
        floats = torch.cat(qs) if qs else torch.zeros(0)
        return out, floats

    @classmethod
    def decode(cls, ints, floats):
        rd = _Reader(ints)
        vocab, build, glue, backup, branches, n = rd.take(6)
        floats = floats if floats is not None else torch.zeros(0)
        rows, at = [], 0
        for _ in range(n):
            seq_id, status, cached, length = rd.take(4)
            tokens = tuple(rd.take(length))
            if at + length * vocab > floats.numel() or status not in (HIT, DRAFTED, MISS):
                raise MalformedMessage("chain reply q payload or status is inconsistent")
            rows.append(ChainRow(seq_id, status, cached, tokens, floats[at: at + length * vocab].view(length, vocab)))
            at += length * vocab
        rd.done()
        if at != floats.numel():
            raise MalformedMessage("chain reply has trailing floats")
        return cls(tuple(rows), vocab, _i2f(build), _i2f(glue), _i2f(backup), branches)


@dataclass(frozen=True)
class BuildRow:
    seq_id: int
    chain: tuple[int, ...]  # the chain sent for verification this round
    build: bool  # construct its cache (else only remember the chain)


@dataclass(frozen=True)
class BuildCache(Message):
    KIND: ClassVar[int] = 5
    rows: tuple[BuildRow, ...]
    fanout: tuple[int, ...]  # F_0..F_k for this construction

    def encode(self):
        out = [len(self.fanout), *self.fanout, len(self.rows)]
        for r in self.rows:
            out += [r.seq_id, int(r.build), len(r.chain), *r.chain]
        return out, None

    @classmethod
    def decode(cls, ints, floats):
        rd = _Reader(ints)
        fanout = tuple(rd.take(rd.one()))
        rows = []
        for _ in range(rd.one()):
            seq_id, build, n = rd.take(3)
            rows.append(BuildRow(seq_id, tuple(rd.take(n)), bool(build)))
        rd.done()
        return cls(tuple(rows), fanout)


@dataclass(frozen=True)
class Barrier(Message):
    """Asks for a BarrierReply once everything sent before it has been handled."""

    KIND: ClassVar[int] = 6


@dataclass(frozen=True)
class BarrierReply(Message):
    KIND: ClassVar[int] = 7


@dataclass(frozen=True)
class Shutdown(Message):
    KIND: ClassVar[int] = 8


@dataclass(frozen=True)
class Ready(Message):
    KIND: ClassVar[int] = 9
    pid: int = 0

    def encode(self):
        return [self.pid], None

    @classmethod
    def decode(cls, ints, floats):
        rd = _Reader(ints)
        pid = rd.one()
        rd.done()
        return cls(pid)


@dataclass(frozen=True)
class UpdateDraftWeights(Message):
    """New draft weights, applied between rounds. The payload is a weight_sync transfer (JSON manifest +
    uint8 buckets, full or exact-delta tensors with checksums) in the file `draft_update.<transfer>` of
    the worker's directory: the manifest at offset 0, then each bucket at the next 64-byte boundary.
    transfer: strictly increasing per worker (the transfer's weight_sync version); draft_version: the
    engine's draft version after this update (reported back, never checked against the manifest)."""

    KIND: ClassVar[int] = 10
    transfer: int
    draft_version: int
    manifest_nbytes: int
    bucket_nbytes: tuple[int, ...]

    def encode(self):
        return [self.transfer, self.draft_version, self.manifest_nbytes, len(self.bucket_nbytes),
                *self.bucket_nbytes], None

    @classmethod
    def decode(cls, ints, floats):
        rd = _Reader(ints)
        transfer, version, manifest_nbytes, n = rd.take(4)
        sizes = tuple(rd.take(n))
        rd.done()
        if transfer < 1 or version < 0 or manifest_nbytes < 1 or any(s < 0 for s in sizes):
            raise MalformedMessage("draft weight update has negative sizes or versions")
        return cls(transfer, version, manifest_nbytes, sizes)

    def layout(self) -> tuple[list[int], int]:
        """(offset of each bucket in the file, total file size)."""
        offsets, end = [], self.manifest_nbytes
        for n in self.bucket_nbytes:
            start = -(-end // 64) * 64
            offsets.append(start)
            end = start + n
        return offsets, end


@dataclass(frozen=True)
class DraftDigest(Message):
    """Asks for a DraftWeightsReply describing the weights the draft side holds now."""

    KIND: ClassVar[int] = 11


@dataclass(frozen=True)
class DraftWeightsReply(Message):
    KIND: ClassVar[int] = 12
    accepted: bool  # the update was applied (always True for DraftDigest)
    transfer: int  # the last transfer applied (0: none since start)
    draft_version: int
    digest: int  # weights_digest() of every draft weight, as a signed int64

    def encode(self):
        return [int(self.accepted), self.transfer, self.draft_version, self.digest], None

    @classmethod
    def decode(cls, ints, floats):
        rd = _Reader(ints)
        accepted, transfer, version, digest = rd.take(4)
        rd.done()
        return cls(bool(accepted), transfer, version, digest)


MESSAGES: dict[int, type[Message]] = {
    m.KIND: m for m in (AdmitSequences, ReleaseSequences, Verdicts, ChainReply, BuildCache, Barrier, BarrierReply,
                        Shutdown, Ready, UpdateDraftWeights, DraftDigest, DraftWeightsReply)
}
# requests that get an answer
REPLIES = {Verdicts: ChainReply, Barrier: BarrierReply, UpdateDraftWeights: DraftWeightsReply,
           DraftDigest: DraftWeightsReply}
