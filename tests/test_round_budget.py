"""`EngineConfig.max_round_rows` (rollout_ssd/round_budget.py): a round steps at most that many running
sequences, those that waited longest, so each steps once every ceil(running / B) rounds; and which round a
sequence steps in changes none of its tokens, on every method: AR, SD and SSD (the cache's hits and misses),
greedy and seeded at T = 1 (each sequence's randomness is its own), with logprobs equal to float32 rounding."""

from __future__ import annotations

import json

import pytest

from rollout_ssd import EngineConfig, RolloutEngine, SamplingParams, SpecConfig
from rollout_ssd.round_budget import RoundBudget
from rollout_ssd.sequence import Sequence
from tests.support.models import tiny_pair
from tests.support.ran import assert_ran

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16]]


def _seq(slot: int) -> Sequence:
    return Sequence(0, slot, [1], SamplingParams(), None, frozenset(), 8, slot=slot)


def test_the_longest_waiting_step_first_and_every_sequence_in_turn():
    budget = RoundBudget(2)
    running = [_seq(s) for s in range(5)]
    picks = [[s.slot for s in budget.pick(running)] for _ in range(3)]
    assert picks == [[0, 1], [2, 3], [0, 4]]  # 4 waited two rounds; 0 one (ties: the lower slot)
    newcomer = _seq(7)
    running = running[1:] + [newcomer]  # slot 0 finished, a newcomer took slot 7
    assert [s.slot for s in budget.pick(running)] == [1, 7]  # 7 never stepped: it goes first (with 1)
    assert RoundBudget(None).pick(running) == running and RoundBudget(9).pick(running) == running
    for bad in (0, -1, 2.0, True, "4"):
        with pytest.raises(ValueError, match="max_round_rows"):
            RoundBudget(bad)
        with pytest.raises(ValueError, match="EngineConfig.max_round_rows"):
            EngineConfig(max_round_rows=bad)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_pair(tmp_path_factory.mktemp("budget"), vocab=48)


def _engine(pair, method: str, max_round_rows):
    ssd = {"worker": method == "ssd-worker", "strategy_rule": False, "fanout": (2, 2, 2, 3)}
    spec = SpecConfig(method=method.removesuffix("-worker"), k=3, **(ssd if method.startswith("ssd") else {}))
    return RolloutEngine(pair[0], spec, EngineConfig(max_batch_size=6, max_model_len=96, max_round_rows=max_round_rows),
                         draft=None if method == "ar" else pair[1])


@pytest.mark.parametrize("method", ["ar", "sd", "ssd", pytest.param("ssd-worker", marks=pytest.mark.slow)])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_round_budget_changes_no_token(pair, method, temperature):
    params = SamplingParams(n=2, temperature=temperature, max_new_tokens=20, ignore_eos=True, seed=3)
    out, sizes = {}, []
    for rows in (None, 2):
        engine = _engine(pair, method, rows)
        if rows:
            step = engine.strategy.step
            engine.strategy.step = lambda running, step=step: (sizes.append(len(running)), step(running))[1]
        with engine:
            out[rows] = engine.sample(PROMPTS, params)
            if method == "sd":
                assert_ran(engine, "spec")
            elif method.startswith("ssd"):
                assert_ran(engine, "ssd", hits=True, worker=method == "ssd-worker")
    assert sizes and max(sizes) == 2 and sum(sizes) >= 6 * 19 // 4  # 6 sequences, 2 a round, budgeted
    # the same tokens; logprobs to float32 rounding (a forward of 2 rows may round unlike one of 6). At
    # T = 1 a token could flip only if its uniform fell within ~1e-6 of a CDF boundary: odds < 1e-3 here
    assert [r.token_ids for r in out[2]] == [r.token_ids for r in out[None]]
    for a, b in zip(out[2], out[None], strict=True):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-5


def test_the_budget_caps_admissions_and_the_trace_shows_each_round(pair, tmp_path, monkeypatch):
    """With max_round_rows = 2, no round admits or steps more than 2 sequences (RoundTrace's record), and
    every sequence is admitted once."""
    trace = tmp_path / "rounds.jsonl"
    monkeypatch.setenv("ROLLOUT_SSD_ROUND_TRACE", str(trace))
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=6, ignore_eos=True)
    with _engine(pair, "sd", 2) as engine:
        out = engine.sample(PROMPTS, params)
        assert_ran(engine, "spec")
    rows = [json.loads(line) for line in trace.read_text().splitlines()]
    assert sum(r["admitted"] for r in rows) == 6 and all(len(r.token_ids) == 6 for r in out)
    assert max(r["admitted"] for r in rows) == 2 and max(r["stepped"] for r in rows) == 2
    assert [r["admitted"] for r in rows[:3]] == [2, 2, 2]  # 6 free slots, filled 2 a round
    assert all(r["round_s"] >= r["prefill_s"] >= 0 for r in rows)
    assert sum(r["admitted_tokens"] for r in rows) == 2 * sum(map(len, PROMPTS))
