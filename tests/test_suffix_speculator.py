"""Tests for the suffix speculator (rollout_ssd.spec.suffix) and the random speculator (spec.random_spec).

All proposals are deterministic, so every check is exact: hand-built sequences, known texts, known
continuation counts. Work is measured with the speculator's operation counter, never with a clock.
"""

from __future__ import annotations

import random

import pytest
import torch

from rollout_ssd.params import SamplingParams
from rollout_ssd.sampling import sequence_generator
from rollout_ssd.sequence import Sequence
from rollout_ssd.spec.random_spec import DRAFT_STREAM, RandomConfig, RandomSpeculator
from rollout_ssd.spec.suffix import SuffixConfig, SuffixSpeculator
from rollout_ssd.spec.verify import PointDraft

PROMPT = [100, 101, 102, 103, 104, 105, 106, 107]
ALWAYS = SuffixConfig(min_confidence=0.0)  # propose whenever a match exists


def make_seq(prompt, completion=(), i=0, j=0, seed=0, stop=()) -> Sequence:
    params = SamplingParams(temperature=1.0, max_new_tokens=100_000, seed=seed)
    return Sequence(
        prompt_index=i,
        sample_index=j,
        prompt_token_ids=list(prompt),
        params=params,
        generator=sequence_generator(seed, i, j),
        stop_ids=frozenset(stop),
        max_total_len=1_000_000,
        token_ids=list(completion),
    )


def emit(spec, seq, tokens):
    """One round: the engine appends the verified tokens, then tells the speculator."""
    seq.token_ids.extend(tokens)
    spec.on_verified([seq], [0])


# ---- config ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        {"min_match": 0},
        {"min_match": 3, "max_match": 2},
        {"max_match": 2.5},
        {"min_confidence": 1.5},
        {"min_confidence": -0.1},
        {"prior_count": -1.0},
        {"prior_count": float("inf")},
        {"max_rollouts_per_prompt": -1},
        {"max_prompts": 1.0},
        {"min_match": True},
    ],
)
def test_suffix_config_rejects_bad_values(options):
    with pytest.raises(ValueError):
        SuffixConfig(**options)


def test_configs_reject_unknown_options():
    with pytest.raises(TypeError):
        SuffixConfig(max_len=3)
    with pytest.raises(TypeError):
        RandomConfig(vocab_size=10, seed=1)
    for bad in (0, -3, 2.0, True):
        with pytest.raises(ValueError):
            RandomConfig(vocab_size=bad)


# ---- sources --------------------------------------------------------------------------------------


def test_repeated_prompt_text_is_proposed():
    spec = SuffixSpeculator(ALWAYS)
    seq = make_seq([10, 11, 12, 13, 14, 15, 16, 17, 90, 91, 10, 11, 12])
    spec.on_admit([seq])
    proposal = spec.propose([seq], [4])
    assert proposal.tokens == [[13, 14, 15, 16]]
    assert isinstance(proposal.q, PointDraft)


def test_the_sequences_own_repetition_is_proposed():
    spec = SuffixSpeculator(ALWAYS)
    seq = make_seq([1, 2], [5, 6, 7, 8, 9])
    spec.on_admit([seq])
    emit(spec, seq, [5, 6, 7])
    assert spec.propose([seq], [4]).tokens == [[8, 9, 5, 6]]


def test_a_siblings_completion_is_proposed_while_running_and_after_it_finished():
    spec = SuffixSpeculator(ALWAYS)
    a, b = make_seq(PROMPT, j=0), make_seq(PROMPT, j=1)
    spec.on_admit([a, b])
    emit(spec, a, [20, 21, 22, 23])
    emit(spec, a, [24, 25, 26, 27, 28])  # incremental: only these are added
    emit(spec, b, [20, 21, 22])
    assert spec.propose([b], [4]).tokens == [[23, 24, 25, 26]]
    a.finish_reason = "stop"
    spec.on_release(a)
    assert spec.num_live_groups == 1  # b still runs: its group (and a's text in it) stays
    emit(spec, b, [23, 24])
    assert spec.propose([b], [3]).tokens == [[25, 26, 27]]


def test_sibling_texts_do_not_leak_across_prompts():
    spec = SuffixSpeculator(ALWAYS)
    a, other = make_seq(PROMPT, [20, 21, 22, 23, 24]), make_seq([7, 7, 7], [20, 21, 22], i=1)
    spec.on_admit([a, other])
    assert spec.num_live_groups == 2
    assert spec.propose([other], [4]).tokens == [[]]


def test_earlier_rollouts_of_the_same_prompt_are_used_across_calls():
    spec = SuffixSpeculator(ALWAYS)
    first = make_seq(PROMPT, i=0)  # call 1
    spec.on_admit([first])
    emit(spec, first, [30, 31, 32, 33, 34, 35, 36])
    spec.on_release(first)
    assert spec.num_live_groups == 0 and spec.remembered(PROMPT) == [[30, 31, 32, 33, 34, 35, 36]]

    later = make_seq(PROMPT, i=5)  # call 2: another prompt index, the same prompt text
    spec.on_admit([later])
    assert spec.propose([later], [3]).tokens == [[30, 31, 32]]  # straight from the prompt's end
    emit(spec, later, [30, 31, 32, 33])
    assert spec.propose([later], [2]).tokens == [[34, 35]]


def test_remember_feeds_memory_and_a_live_group_at_once():
    spec = SuffixSpeculator(ALWAYS)
    seq = make_seq(PROMPT, [40, 41])
    spec.on_admit([seq])
    assert spec.propose([seq], [3]).tokens == [[]]
    spec.remember(PROMPT, [40, 41, 42, 43, 44])
    assert spec.propose([seq], [3]).tokens == [[42, 43, 44]]
    assert spec.remembered(PROMPT) == [[40, 41, 42, 43, 44]]


def test_forget_all_drops_earlier_rollouts_but_keeps_the_running_text():
    spec = SuffixSpeculator(ALWAYS)
    spec.remember(PROMPT, [50, 51, 52, 53])
    seq = make_seq(PROMPT, [60, 61, 62, 63, 64, 60, 61])
    spec.on_admit([seq])
    spec.forget_all()
    assert spec.num_remembered_prompts == 0
    assert spec.propose([seq], [2]).tokens == [[62, 63]]  # its own text survives
    emit(spec, seq, [62, 63, 64, 50, 51])
    assert spec.propose([seq], [2]).tokens == [[]]  # 50 51 -> 52 53 was forgotten


# ---- proposal rules -------------------------------------------------------------------------------


def test_confidence_rule_shortens_chains_when_continuations_disagree():
    cfg = SuffixConfig(min_match=2, max_match=6, min_confidence=0.3, prior_count=1.0)
    agree, disagree = SuffixSpeculator(cfg), SuffixSpeculator(cfg)
    for _ in range(2):
        agree.remember(PROMPT, [1, 2, 3, 4, 5, 6, 7, 8])
    disagree.remember(PROMPT, [1, 2, 3, 4, 5, 6, 7, 8])
    disagree.remember(PROMPT, [1, 2, 3, 9, 9, 9, 9, 9])
    seq_a, seq_d = make_seq(PROMPT, [1, 2, 3]), make_seq(PROMPT, [1, 2, 3])

    tokens, conf = agree.chain(seq_a, 5)
    assert tokens == [4, 5, 6, 7, 8]
    assert conf[0] == pytest.approx(2 / (2 + 1 / 6))  # two agreeing sightings after a 6-token match
    assert conf == pytest.approx([conf[0] ** (i + 1) for i in range(5)])

    tokens, conf = disagree.chain(seq_d, 5)
    c1, c_rest = 1 / (2 + 1 / 6), 1 / (1 + 1 / 6)  # a 1-1 split, then single sightings
    assert tokens == [9, 9, 9]  # the tie goes to the fresher rollout; the chain stops once C_i < 0.3
    assert conf == pytest.approx([c1, c1 * c_rest, c1 * c_rest**2])
    assert c1 * c_rest**3 < 0.3

    strict = SuffixSpeculator(SuffixConfig(min_confidence=0.5))
    strict.remember(PROMPT, [1, 2, 3, 4, 5, 6, 7, 8])
    strict.remember(PROMPT, [1, 2, 3, 9, 9, 9, 9, 9])
    assert strict.propose([make_seq(PROMPT, [1, 2, 3])], [5]).tokens == [[]]


def test_ties_go_to_the_freshest_source_and_counts_beat_freshness():
    spec = SuffixSpeculator(ALWAYS)
    spec.remember(PROMPT, [1, 2, 3, 4])
    spec.remember(PROMPT, [1, 2, 3, 5])
    assert spec.chain(make_seq(PROMPT, [1, 2, 3]), 1)[0] == [5]
    spec.remember(PROMPT, [1, 2, 3, 4])
    assert spec.chain(make_seq(PROMPT, [1, 2, 3]), 1)[0] == [4]  # 2 sightings against 1


def test_shorter_matches_earn_less_confidence():
    cfg = SuffixConfig(min_match=1, max_match=6, min_confidence=0.0, prior_count=1.0)
    spec = SuffixSpeculator(cfg)
    long_seq = make_seq([1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6])  # 6-token match of "1..6" -> 7
    short_seq = make_seq([9, 7, 0, 8, 8, 8, 8, 9])  # only "9" matches (-> 7)
    assert spec.chain(long_seq, 1) == ([7], [pytest.approx(1 / (1 + 1 / 6))])
    assert spec.chain(short_seq, 1) == ([7], [pytest.approx(1 / (1 + 1))])


def test_k_is_respected_and_zero_gives_an_empty_proposal():
    spec = SuffixSpeculator(ALWAYS)
    text = list(range(200, 240))
    seqs = [make_seq(PROMPT, text + text[:5], j=j) for j in range(5)]
    spec.on_admit(seqs)
    ks = [0, 1, 3, 8, 30]
    proposal = spec.propose(seqs, ks)
    assert [len(t) for t in proposal.tokens] == ks
    assert proposal.tokens[4] == text[5:35]
    with pytest.raises(ValueError):
        spec.propose(seqs, ks[:2])
    with pytest.raises(ValueError):
        spec.propose(seqs[:1], [-1])


def test_a_stop_token_ends_the_chain():
    spec = SuffixSpeculator(ALWAYS)
    seq = make_seq(PROMPT, [1, 2, 3, 99, 4, 5, 1, 2], stop=(99,))
    assert spec.propose([seq], [5]).tokens == [[3, 99]]


# ---- cost and memory ------------------------------------------------------------------------------


def test_per_round_work_is_bounded_on_a_4k_token_sequence():
    cfg = SuffixConfig()
    orders = cfg.max_match - cfg.min_match + 1  # D
    spec = SuffixSpeculator(cfg)
    rng = random.Random(0)
    seq = make_seq(PROMPT)
    spec.on_admit([seq])
    k, worst, rounds = 4, 0, 0
    while len(seq.token_ids) < 4096:
        new = [rng.randrange(40) for _ in range(rng.randint(1, k + 1))]  # a small vocabulary: many matches
        before = spec.index_ops
        emit(spec, seq, new)
        spec.propose([seq], [k])
        worst = max(worst, spec.index_ops - before)
        rounds += 1
    # Updates: D per new token; lookups: at most D per proposed token (longest first, then shorter).
    assert worst <= (k + 1) * orders + k * orders
    assert spec.index_ops <= (len(PROMPT) + 4100) * orders + rounds * k * orders


def test_building_a_group_from_memory_is_linear_in_its_text():
    cfg = SuffixConfig(max_rollouts_per_prompt=4)
    orders = cfg.max_match - cfg.min_match + 1
    spec = SuffixSpeculator(cfg)
    for r in range(6):
        spec.remember(PROMPT, [r] * 500)
    before = spec.index_ops
    spec.on_admit([make_seq(PROMPT)])
    assert spec.index_ops - before <= (len(PROMPT) + 4 * 500) * orders  # only the M kept rollouts


def test_memory_keeps_m_rollouts_per_prompt_and_p_prompts_lru():
    spec = SuffixSpeculator(SuffixConfig(min_confidence=0.0, max_rollouts_per_prompt=2, max_prompts=3))
    prompts = {name: [ord(name)] * 4 for name in "ABCD"}
    for r in range(3):
        spec.remember(prompts["A"], [10 + r, 20 + r, 30 + r])
    assert spec.remembered(prompts["A"]) == [[11, 21, 31], [12, 22, 32]]  # the newest M
    spec.remember(prompts["B"], [1, 2, 3])
    spec.remember(prompts["C"], [1, 2, 3])
    seq = make_seq(prompts["A"])
    spec.on_admit([seq])  # a use: A becomes the most recent
    spec.on_release(seq)  # an empty completion is not remembered
    assert spec.remembered(prompts["A"]) == [[11, 21, 31], [12, 22, 32]]
    spec.remember(prompts["D"], [1, 2, 3])
    assert spec.num_remembered_prompts == 3
    assert spec.remembered(prompts["B"]) == []  # least recently used: evicted
    assert all(spec.remembered(prompts[n]) for n in "ACD")
    # the evicted rollout of A is no longer proposed; the kept ones are
    assert spec.propose([make_seq(prompts["A"], [10])], [2]).tokens == [[]]
    assert spec.propose([make_seq(prompts["A"], [11])], [2]).tokens == [[21, 31]]


def test_zero_bounds_turn_the_memory_off():
    spec = SuffixSpeculator(SuffixConfig(max_prompts=0))
    spec.remember(PROMPT, [1, 2, 3])
    assert spec.num_remembered_prompts == 0


def test_release_drops_the_live_group_but_keeps_the_text():
    spec = SuffixSpeculator(ALWAYS)
    seqs = [make_seq(PROMPT, [j, j + 1, j + 2], j=j) for j in range(3)]
    spec.on_admit(seqs)
    assert spec.num_live_groups == 1
    for seq in seqs:
        spec.on_release(seq)
    assert spec.num_live_groups == 0
    assert spec.remembered(PROMPT) == [[0, 1, 2], [1, 2, 3], [2, 3, 4]]
    spec.on_release(make_seq([5, 5], [6, 7]))  # never admitted: remembered all the same
    assert spec.remembered([5, 5]) == [[6, 7]]


# ---- random speculator ----------------------------------------------------------------------------


def _gen_state(seq):
    return seq.generator.get_state().clone()


def test_random_is_reproducible_per_sequence_and_independent_of_the_batch():
    cfg = RandomConfig(vocab_size=1000)
    batch = [make_seq(PROMPT, i=i, j=j, seed=7) for i in range(2) for j in range(2)]
    spec = RandomSpeculator(cfg)
    spec.on_admit(batch)
    round1 = spec.propose(batch, [3, 3, 3, 3]).tokens
    round2 = spec.propose(batch, [2, 0, 4, 1]).tokens

    alone = RandomSpeculator(cfg)
    seq = make_seq(PROMPT, i=1, j=0, seed=7)  # batch[2], on its own
    assert alone.propose([seq], [3]).tokens == [round1[2]]
    assert alone.propose([seq], [4]).tokens == [round2[2]]

    expected = torch.randint(0, 1000, (3,), generator=sequence_generator(7, 1, 0, stream=DRAFT_STREAM))
    assert round1[2] == expected.tolist()
    assert len({tuple(t) for t in round1}) == 4  # each sequence has its own stream
    assert all(0 <= t < 1000 for row in round1 + round2 for t in row)
    assert isinstance(spec.propose(batch[:1], [1]).q, PointDraft)


def test_random_never_touches_the_verification_generator_and_k0_draws_nothing():
    spec = RandomSpeculator(RandomConfig(vocab_size=50))
    seq = make_seq(PROMPT, seed=3)
    before = _gen_state(seq)
    spec.on_admit([seq])
    assert spec.propose([seq], [0]).tokens == [[]]
    tokens = spec.propose([seq], [5]).tokens
    assert torch.equal(_gen_state(seq), before)
    assert tokens == RandomSpeculator(RandomConfig(vocab_size=50)).propose([make_seq(PROMPT, seed=3)], [5]).tokens


def test_random_streams_are_made_on_admit_and_dropped_on_release():
    spec = RandomSpeculator(RandomConfig(vocab_size=50))
    a, b = make_seq(PROMPT, j=0), make_seq(PROMPT, j=1)
    spec.on_admit([a, b])
    spec.on_admit([a])  # admitting again does not restart the stream
    first = spec.propose([a], [4]).tokens
    spec.on_admit([a])
    assert spec.propose([a], [4]).tokens != first
    assert spec.num_tracked == 2
    spec.on_release(a)
    assert spec.num_tracked == 1
    with pytest.raises(ValueError):
        spec.propose([b], [1, 1])
