"""SSD messages: every message survives encode -> decode, and malformed payloads are refused."""

from __future__ import annotations

import pytest
import torch

from rollout_ssd.ssd.messages import (
    DRAFTED,
    HIT,
    MISS,
    SYNC,
    AdmitRow,
    AdmitSequences,
    Barrier,
    BuildCache,
    BuildRow,
    ChainReply,
    ChainRow,
    MalformedMessage,
    Ready,
    ReleaseSequences,
    Shutdown,
    VerdictRow,
    Verdicts,
)

V = 5


def _roundtrip(msg):
    ints, floats = msg.encode()
    assert all(isinstance(x, int) for x in ints)
    return type(msg).decode(list(ints), None if floats is None else floats.clone())


def test_roundtrip_every_message():
    q = torch.softmax(torch.randn(2, V), dim=-1)
    msgs = [
        AdmitSequences((AdmitRow(3, -(2**62), 0.7, 5, 0.9, (1, 2, 3)), AdmitRow(4, 17, 0.0, 0, 1.0, (4,)))),
        ReleaseSequences((3, 9)),
        Verdicts((VerdictRow(3, 2, 4, 10, 3, True), VerdictRow(4, SYNC, 0, 7, 0, False, (1, 2))), (2, 1, 1)),
        BuildCache((BuildRow(3, (1, 2, 3), True), BuildRow(4, (), False)), (2, 1, 1)),
        Barrier(), Shutdown(), Ready(1234),
    ]
    for msg in msgs:
        assert _roundtrip(msg) == msg
    reply = ChainReply((ChainRow(3, HIT, 2, (1, 4), q), ChainRow(4, MISS, -1, (), torch.zeros(0, V)),
                        ChainRow(5, DRAFTED, 0, (0,), q[:1])), V, 0.5, 0.1, 0.25, 7)
    back = _roundtrip(reply)
    assert (back.vocab, back.build_seconds, back.glue_seconds, back.backup_seconds, back.branches) == (V, 0.5, 0.1, 0.25, 7)
    for a, b in zip(back.rows, reply.rows):
        assert (a.seq_id, a.status, a.cached, a.tokens) == (b.seq_id, b.status, b.cached, b.tokens)
        assert torch.equal(a.q, b.q)


def test_malformed_payloads_are_refused():
    ints, _ = Verdicts((VerdictRow(3, 2, 4, 10, 3, True),), (1, 1)).encode()
    with pytest.raises(MalformedMessage):
        Verdicts.decode(ints[:-1], None)  # truncated
    with pytest.raises(MalformedMessage):
        Verdicts.decode(ints + [0], None)  # trailing
    ints, floats = ChainReply((ChainRow(3, HIT, 2, (1, 4), torch.full((2, V), 0.2)),), V).encode()
    with pytest.raises(MalformedMessage):
        ChainReply.decode(ints, floats[:-1])  # q too short
    bad = list(ints)
    bad[7] = 42  # status
    with pytest.raises(MalformedMessage):
        ChainReply.decode(bad, floats)
