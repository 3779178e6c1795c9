"""Admission (rollout_ssd/admission.py, EngineConfig.admission / reserved_slots): which waiting sequences
get the free KV slots. Fair admission lets a small request start while a large one holds or waits for
the slots; fifo keeps arrival order; and neither changes a seeded request's tokens."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from rollout_ssd import EngineConfig, RolloutEngine, SamplingParams, SpecConfig
from rollout_ssd.admission import Admission, resolve_reserved
from rollout_ssd.models.loader import load_pretrained
from rollout_ssd.rl.tasks import ALPHABET
from rollout_ssd.rl.tiny import build_tiny_pair


def _seqs(rid: int, count: int):
    return [SimpleNamespace(request_id=rid, name=f"{rid}.{j}") for j in range(count)]


def _names(seqs):
    return [s.name for s in seqs]


def test_fair_gives_the_next_slot_to_the_request_holding_fewest():
    queue = Admission("fair")
    big, small = _seqs(1, 6), _seqs(2, 2)
    queue.add(big)
    queue.add(small)
    running = big[:0]
    assert _names(queue.take(3, running)) == ["1.0", "2.0", "1.1"]  # round-robin, the earlier first
    assert _names(queue.take(1, [big[0], big[1], small[0]])) == ["2.1"]  # holds 1 < 2
    assert len(queue) == 4 and _names(queue) == ["1.2", "1.3", "1.4", "1.5"]
    queue.drop({1})
    assert len(queue) == 0 and queue.take(4, []) == []


def test_fifo_keeps_arrival_order():
    queue = Admission("fifo", reserved=3)  # reserved slots apply to fair only
    queue.add(_seqs(1, 4))
    queue.add(_seqs(2, 1))
    assert _names(queue.take(3, [])) == ["1.0", "1.1", "1.2"]
    assert _names(queue.take(3, [])) == ["1.3", "2.0"]


def test_a_limit_caps_one_rounds_admissions_without_touching_the_reservation():
    """`EngineConfig.max_round_rows` also caps a round's admissions: the policy still picks which."""
    queue = Admission("fair", reserved=2)
    queue.add(_seqs(1, 8))
    assert _names(queue.take(10, [], limit=3)) == ["1.0", "1.1", "1.2"]  # 10 free, 3 a round
    queue.add(_seqs(2, 2))
    running = [SimpleNamespace(request_id=1)] * 3
    assert _names(queue.take(10, running, limit=3)) == ["2.0", "2.1"]  # the newcomer alone, though 3 were allowed
    assert _names(queue.take(10, running, limit=3)) == ["1.3", "1.4", "1.5"]  # no newcomer: the cap fills
    assert _names(queue.take(3, running, limit=5)) == ["1.6"]  # free 3, reserved 2: the reservation still holds
    fifo = Admission("fifo")
    fifo.add(_seqs(1, 4))
    assert _names(fifo.take(4, [], limit=1)) == ["1.0"] and _names(fifo.take(2, [], limit=None)) == ["1.1", "1.2"]


def test_reserved_slots_go_to_newcomers_only():
    queue = Admission("fair", reserved=2)
    big = _seqs(1, 8)
    queue.add(big)
    assert _names(queue.take(4, [])) == ["1.0", "1.1"]  # its first sequence may take a reserved slot
    running = big[:2]
    assert queue.take(2, running) == []  # the last two free slots wait for a newcomer
    queue.add(_seqs(2, 3))
    assert _names(queue.take(3, running)) == ["2.0"]  # the newcomer's first; then free=2 <= 2 is reserved
    assert resolve_reserved("auto", 128) == 8 and resolve_reserved("auto", 4) == 1
    assert resolve_reserved(5, 3) == 2 and resolve_reserved(0, 1) == 0
    with pytest.raises(ValueError, match="admission"):
        Admission("lifo")
    with pytest.raises(ValueError, match="EngineConfig.admission"):
        EngineConfig(admission="lifo")
    with pytest.raises(ValueError, match="EngineConfig.reserved_slots"):
        EngineConfig(reserved_slots=-1)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    target_dir, _ = build_tiny_pair(tmp_path_factory.mktemp("admission"), ALPHABET)
    return load_pretrained(str(target_dir), dtype="float32")


BIG = SamplingParams(n=8, temperature=1.0, max_new_tokens=48, ignore_eos=True, seed=3)
SMALL = SamplingParams(n=1, temperature=1.0, max_new_tokens=4, ignore_eos=True, seed=9)


def _race(target, admission: str):
    """A request of 8 sequences on 4 slots, then (once it runs) a request of one: (whether the big one
    was still running when the small one ended, the small one's rollouts, the big one's)."""
    engine = RolloutEngine(target, SpecConfig(method="ar"),
                           EngineConfig(max_batch_size=4, max_model_len=64, admission=admission, reserved_slots=1))
    with engine:
        started = threading.Event()
        big = engine.submit(["1+2="], BIG, listener=lambda request, finished: started.set())
        assert started.wait(60)
        small = engine.submit(["3+4="], SMALL)
        small_rollouts = small.result(timeout=120)
        big_running = not big.done()
        return big_running, small_rollouts, big.result(timeout=120)


def test_fair_admission_lets_a_small_request_through_with_unchanged_tokens(target):
    big_running, small, big = _race(target, "fair")
    assert big_running  # it ended within a few rounds of its arrival, while the 96-round request ran
    with RolloutEngine(target, SpecConfig(method="ar"), EngineConfig(max_batch_size=4, max_model_len=64)) as alone:
        assert [r.token_ids for r in small] == [r.token_ids for r in alone.sample(["3+4="], SMALL)]
        assert [r.token_ids for r in big] == [r.token_ids for r in alone.sample(["1+2="], BIG)]


def test_fifo_admission_queues_the_small_request_behind(target):
    """The same race under fifo: the small request waits until every big sequence has had a slot (two
    waves of 4), so the big request has ended by the time the small one does."""
    big_running, small, _ = _race(target, "fifo")
    assert not big_running and len(small[0].token_ids) == 4


def test_first_tokens_reach_the_listener_right_after_the_prefill(target):
    """The first listener call of a request carries only its prefill's token per sequence (a client's
    first token does not wait for the round's decode step)."""
    seen = []
    with RolloutEngine(target, SpecConfig(method="ar"), EngineConfig(max_batch_size=4, max_model_len=64)) as engine:
        request = engine.submit(["1+2="], SamplingParams(n=3, max_new_tokens=6, ignore_eos=True),
                                listener=lambda r, finished: seen.append(r.num_tokens))
        request.result(timeout=60)
    assert seen[0] == 3  # one token per sequence; before a decode step it would be 6
