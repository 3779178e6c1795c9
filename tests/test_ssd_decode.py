"""SSD decode strategy, in process: greedy SSD == greedy AR token for token (hits and misses both
exercised), the speculation cache equals an independent serial draft decode of every branch, and the law
of short continuations equals the exact target law on the hit path, the miss path with each backup, with
Saguaro C < 1, at T = 1 and at T = 0.7 with top-p.

Statistical tests: Pearson chi-square of the empirical law of (t4, t5, t6) against the exact target law
(enumerated from the target's logits), cells pooled as tests/support/stats.py says; each fails by chance
with probability 1e-3 (the p-value threshold), so the 6 law cases together fail spuriously < 0.6% of runs.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from rollout_ssd import SamplingParams
from rollout_ssd.sampling import sample_from_probs, target_probs
from rollout_ssd.ssd.chooser import Plan
from rollout_ssd.ssd.draft_server import DraftServer
from rollout_ssd.ssd.messages import HIT, SYNC, AdmitRow, AdmitSequences, BuildCache, BuildRow, VerdictRow, Verdicts
from rollout_ssd.ssd.rng import draft_key, draft_uniform_reference, draft_uniforms
from rollout_ssd.ssd.rule import StrategyConfig, StrategyRule
from rollout_ssd.ssd.saguaro import saguaro_probs, top_f_mask
from rollout_ssd.ssd.tree import SaguaroRule
from tests.support.laws import decoder_next_logits, exact_law
from tests.support.models import tiny_pair
from tests.support.ran import assert_ran
from tests.support.stats import assert_fits
from tests.test_ssd_helpers import ar_engine, ssd_engine

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16], [3, 3, 3, 3]]


@pytest.fixture(scope="module")
def pair48(tmp_path_factory):
    return tiny_pair(tmp_path_factory.mktemp("ssd48"), vocab=48)


@pytest.fixture(scope="module")
def pair6(tmp_path_factory):
    return tiny_pair(tmp_path_factory.mktemp("ssd6"), vocab=6, seed=3, draft_noise=0.6, logit_scale=2.0)


def test_counter_rng_matches_reference_and_is_uniform():
    key = draft_key(5, 1, 2)
    idx = torch.arange(2000)
    u = draft_uniforms(torch.full((2000,), key), idx)
    assert [draft_uniform_reference(key, i) for i in range(5)] == u[:5].tolist()
    assert float(u.min()) >= 0 and float(u.max()) < 1 and abs(float(u.mean()) - 0.5) < 0.03


@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_ssd_equals_ar(pair48, batch):
    target, draft = pair48
    params = SamplingParams(temperature=0, max_new_tokens=20, n=2, ignore_eos=True)
    ar = ar_engine(target, batch).sample(PROMPTS, params)
    engine = ssd_engine(target, draft, batch, k=3, fanout=(1, 1, 1, 2))
    out = engine.sample(PROMPTS, params)
    assert len(out) == len(ar) == len(PROMPTS) * params.n
    assert [b.token_ids for b in out] == [a.token_ids for a in ar]
    for a, b in zip(ar, out, strict=True):
        assert torch.allclose(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-4)
    assert_ran(engine, "ssd+neural", hits=True, misses=True)  # SSD rounds, with hits and misses
    engine.close()


def test_greedy_ssd_planner_and_rule_equal_ar(pair48):
    """Theorem 12 planner fan-outs and the strategy rule (which may switch strategies mid-run)."""
    target, draft = pair48
    params = SamplingParams(temperature=0, max_new_tokens=40, n=3, ignore_eos=True)
    ar = ar_engine(target, 4).sample(PROMPTS, params)
    engine = ssd_engine(target, draft, 4, k=3, strategy_rule=True, backup="suffix")
    out = engine.sample(PROMPTS, params)
    assert [b.token_ids for b in out] == [a.token_ids for a in ar]
    m = assert_ran(engine, "ssd+neural")  # ssd/fanout is published for every plan: SSD's rounds are counted here
    assert sum(m["ssd/fanout"]) >= 4 and m["ssd/strategy"] in m["ssd/scores"]
    engine.close()


def test_ar_rounds_time_decode_not_verify(pair48):
    """An AR round is a one-token step: its time is AR's decode time, never a K+1-token verify's (when AR
    rounds fed the verify estimate, it sank towards the decode time and SD/SSD scored too high)."""
    target, draft = pair48
    engine = ssd_engine(target, draft, 3, k=3, strategy_rule=True)
    ssd = engine.strategy
    chooser = ssd.chooser
    chooser.rule = StrategyRule(StrategyConfig(candidates=chooser.rule.config.candidates, fixed="ar"))
    seen = []
    observe = chooser.estimates.observe_time
    chooser.estimates.observe_time = lambda name, seconds, batch: (seen.append((chooser.current.label, name)),
                                                                  observe(name, seconds, batch))
    engine.sample(PROMPTS[:3], SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True))
    verify = [s for s, name in seen if name == "verify"]
    decode = [s for s, name in seen if name == "decode"]
    # round 1 (cold: timed nothing) and the decide_after rounds the rule measures before deciding
    # speculate, then AR only
    assert verify == ["ssd+neural"] * ssd.config.decide_after
    ar_rounds = engine.metrics()["ssd/strategy_rounds"]["ar"]
    assert ar_rounds >= 4 and decode.count("ar") == ar_rounds  # every AR round times a decode step
    assert_ran(engine, "ssd+neural")
    engine.close()


def test_first_rounds_do_not_feed_acceptance_estimates(pair48):
    """Each sequence's first round (the cold one after its prompt, whose tokens are the easiest) is left
    out of the acceptance and tokens-per-round estimates the rule scores SD and SSD with, and a round of
    first rounds only times nothing (one-off costs); later rounds feed both."""
    target, draft = pair48
    engine = ssd_engine(target, draft, 3, k=3, strategy_rule=True)
    ssd = engine.strategy
    estimates = ssd.chooser.estimates
    ssd.chooser.rule = StrategyRule(StrategyConfig(candidates=ssd.chooser.rule.config.candidates, fixed="sd"))
    seen, after_step = [], []
    observe, step = estimates.observe_round, ssd.step
    estimates.observe_round = lambda path, sequences, *a: (seen.append((path, sequences)),
                                                          observe(path, sequences, *a))
    ssd.step = lambda running: (step(running), after_step.append((len(seen), list(times))))[0]
    times, observe_time = [], estimates.observe_time
    estimates.observe_time = lambda name, *a: (times.append(name), observe_time(name, *a))
    engine.sample(PROMPTS[:3], SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True))
    assert len(after_step) >= 5 and after_step[0] == (0, [])  # round 1 is every sequence's first
    assert "verify" in after_step[1][1] and "draft" in after_step[1][1]
    # AR's step is calibrated on each of the decide_after timed rounds before the first decision, then
    # FIRST_CALIBRATION_GAP rounds later
    warmup = ssd.config.decide_after
    assert [n.count("decode") for _, n in after_step[1:warmup + 2]] == list(range(1, warmup + 1)) + [warmup]
    assert after_step[-1][1].count("decode") == warmup
    assert seen and all(path in ("draft", "hit") for path, _ in seen)
    assert sum(n for _, n in seen) >= 3 * 2  # the later rounds of all three sequences are observed
    assert_ran(engine, "sd")
    engine.close()


@pytest.mark.parametrize("ar_gain", [1.5, 1.1])
def test_rule_measures_ar_then_sd_then_ssd_and_drops_a_clear_loser_early(pair48, monkeypatch, ar_gain):
    """A fresh engine's rounds at a batch size: AR (its first round, of first rounds, times nothing; the
    second does), SD, then SSD (its first round, with no cache built yet, times nothing), which after its
    first timed round scores 1.0 against AR's 1.5 (more than decide_margin, 0.3, below: dropped at once)
    or 1.1 (run for decide_after timed rounds); then the rule decides (AR) and AR stays."""
    import rollout_ssd.ssd.rule as strategy_module

    target, draft = pair48
    engine = ssd_engine(target, draft, 3, k=3, strategy_rule=True)
    ssd = engine.strategy
    monkeypatch.setattr(strategy_module, "strategy_scores",
                        lambda inputs, names: {n: ar_gain if n == "ar" else 1.0 for n in names})
    plans, choose = [], ssd.chooser.choose

    def recording(batch, fallback=None, tail=False, cold=False):
        plans.append((batch, choose(batch, fallback, tail, cold)))
        return plans[-1][1]

    ssd.chooser.choose = recording
    engine.sample(PROMPTS[:3], SamplingParams(temperature=0, max_new_tokens=28, ignore_eos=True))
    at_three = [plan.label for batch, plan in plans if batch == 3]  # the tail's smaller batches explore anew
    ssd_rounds = 1 if ar_gain > 1 + ssd.config.decide_margin else ssd.config.decide_after
    # SD: decide_after timed rounds (it scores 1.0, within decide_margin of 1.1, or 1 round below 1.5 / 1.3)
    explored = ["ar", "ar"] + ["sd"] * ssd_rounds + ["ssd+neural"] * (1 + ssd_rounds)  # SSD's first: untimed
    assert at_three[:len(explored)] == explored and set(at_three[len(explored):]) == {"ar"}
    assert len(at_three) > len(explored)
    for plan in ("ar", "sd", "ssd+neural"):
        assert_ran(engine, plan)
    engine.close()


def test_hysteresis_keeps_the_choice_made_at_each_batch_size(pair48, monkeypatch):
    """AR best at 16 sequences, SSD at 4: back at 16 after a tail at 4 the rule runs AR at once (its
    choice there), not SSD until AR wins switch_after decisions in a row; a batch size never decided
    at is decided at once."""
    import rollout_ssd.ssd.rule as strategy_module

    target, draft = pair48
    engine = ssd_engine(target, draft, 3, k=3, strategy_rule=True)
    ssd = engine.strategy
    # more rounds than the exploration can take (AR 2, SD and SSD decide_after + 1 each), whatever it measures
    engine.sample(PROMPTS[:3], SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True))
    assert ssd.chooser.decided
    for plan in ("ar", "sd", "ssd+neural"):  # the rule measured each before deciding
        assert_ran(engine, plan)
    monkeypatch.setattr(strategy_module, "strategy_scores", lambda inputs, names: {
        n: (2.0 if n == "ar" else 1.0) if inputs.batch_size >= 8 else (0.5 if n == "ar" else 1.0) for n in names})
    # the warm-up ran at 1-3 sequences; 4, 12 and 16 are decided here for the first time (every plan
    # timed there first: nothing left to explore)
    for batch in (4, 12, 16):
        for name in ("decode",) + ("plain_verify", "plain_draft", "verify") * ssd.config.decide_after:
            ssd.chooser.estimates.observe_time(name, 0.05, batch)
    assert [ssd.chooser.choose(b).label for b in (16, 4, 16, 12, 16, 4)] == \
        ["ar", "ssd+neural", "ar", "ar", "ar", "ssd+neural"]
    engine.close()


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_ar_rounds_are_the_ar_engines_steps(pair48, temperature, top_p):
    """Rounds the rule runs as AR are the AR engine's decode steps: same seed, same tokens and logprobs
    as the AR engine at T > 0 (through `verify` with empty chains they were draws of the same law, but
    from a dearer path); then alternating with SSD rounds (the worker catches up), greedy == AR."""
    target, draft = pair48
    params = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=12, ignore_eos=True, seed=5)
    ar = ar_engine(target, 3).sample(PROMPTS[:3], params)
    engine = ssd_engine(target, draft, 3, k=3, strategy_rule=True)
    ssd = engine.strategy
    ssd.chooser.choose = lambda batch, fallback=None, tail=False, cold=False: Plan.AR
    verified = []
    ssd.verify_round = lambda *a: verified.append(a)  # chain verification (decode.verify_round): not for AR
    ssd.trace = trace = []
    out = engine.sample(PROMPTS[:3], params)
    assert not verified
    # the per-round record (bench/probes/trace_rule.py): one per round, its tokens the rounds' tokens
    assert len(trace) == 11 and {r["strategy"] for r in trace} == {"ar"} and [r["batch"] for r in trace] == [3] * 11
    assert sum(r["emitted"] for r in trace) == 33 and trace[0]["cold"] and not any(r["cold"] for r in trace[1:])
    assert all(r["seconds"] >= r["verify_seconds"] > 0 for r in trace)
    del ssd.verify_round
    assert [o.token_ids for o in out] == [a.token_ids for a in ar]
    assert torch.allclose(torch.tensor([o.logprobs for o in out]), torch.tensor([a.logprobs for a in ar]), atol=1e-5)
    assert engine.metrics()["ssd/strategy_rounds"] == {"ar": 11}  # the first token comes from the prefill
    turns = itertools.cycle([Plan.AR, Plan.SSD_DRAFT, Plan.AR, Plan.AR, Plan.SD])
    ssd.chooser.choose = lambda batch, fallback=None, tail=False, cold=False: next(turns)
    greedy = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
    assert [o.token_ids for o in engine.sample(PROMPTS, greedy)] == \
        [a.token_ids for a in ar_engine(target, 3).sample(PROMPTS, greedy)]
    for plan in ("ssd+neural", "sd"):
        assert_ran(engine, plan)
    engine.close()


# ---- cache construction == independent serial decode of every branch ---------------------------

def _serial_q(model, tokens: list[int], st_params, bend: int, rule: SaguaroRule) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft alone on `tokens` (a fresh causal forward): q (bent like the tree does) after the last one."""
    temperature, top_k, top_p = st_params
    hidden = model.forward_train(torch.tensor([tokens]))
    logits = model.logits(hidden[:, -1])  # [1, V]
    q = target_probs(logits, torch.tensor([temperature]), torch.tensor([top_k]), torch.tensor([top_p]))
    if temperature > 0 and bend > 0:
        c = rule.values(q)
        if c is not None:
            q = saguaro_probs(q, top_f_mask(logits, bend), c)
    return logits, q


@pytest.mark.parametrize("temperature,top_p,C", [(0.0, 1.0, 1.0), (0.8, 0.9, 0.5), (1.0, 1.0, None)])
def test_cache_equals_serial_branch_decode(pair48, temperature, top_p, C):
    target, draft = pair48
    model = draft.model
    k, fanout = 3, (3, 2, 1, 2)
    rule = SaguaroRule(C=C, c_min=0.3)
    server = DraftServer(model, num_slots=4, max_model_len=64, k=k, max_branches=sum(fanout), saguaro=rule)
    prompts = [[1, 2, 3, 4, 5, 6], [9, 8], [20, 21, 22]]
    chains = [[7, 30, 2], [11], []]
    keys = [draft_key(0, i, 0) for i in range(3)]
    server.handle(AdmitSequences(tuple(AdmitRow(i, keys[i], temperature, 0, top_p, tuple(p[:-1]))
                                       for i, p in enumerate(prompts))))
    # the last prompt token arrives as a SYNC, as it does after the target samples it
    server.handle(Verdicts(tuple(VerdictRow(i, SYNC, 0, len(p), 0, False, (p[-1],)) for i, p in enumerate(prompts)),
                           fanout))
    server.handle(BuildCache(tuple(BuildRow(i, tuple(c), True) for i, c in enumerate(chains)), fanout))
    checked = 0
    for i, (prompt, chain) in enumerate(zip(prompts, chains)):
        entries = server.cache._entries[i]
        depths = len(chain) + 1
        assert len(entries.fanout) == depths
        for (j, t), r in entries.index.items():
            context = prompt + chain[:j] + [t]
            # the candidates are the draft's top-F_j at depth j, skipping the sent token
            glue_logits, _ = _serial_q(model, prompt + chain[:j], (temperature, 0, top_p), 0, rule)
            order = [x for x in torch.sort(glue_logits[0], descending=True, stable=True).indices.tolist()
                     if j == len(chain) or x != chain[j]]
            f = fanout[j] if j < len(chain) else fanout[-1]
            assert t in order[:f]
            for step in range(k):
                logits, q = _serial_q(model, context, (temperature, 0, top_p), fanout[step], rule)
                assert torch.allclose(entries.q[r, step], q[0], atol=1e-5)
                if temperature == 0:
                    expect = int(logits.argmax())
                else:
                    u = draft_uniforms(torch.tensor([keys[i]]), torch.tensor([len(context)]))
                    expect = int(sample_from_probs(q, u))
                assert int(entries.tokens[r, step]) == expect
                context = context + [expect]
                checked += 1
    assert checked == k * sum(len(server.cache._entries[i].index) for i in range(3))
    # a verdict now finds its branch
    (j, t), r = next(iter(server.cache._entries[0].index.items()))
    expect = server.cache._entries[0].tokens[r].tolist()
    reply = server.handle(Verdicts((VerdictRow(0, j, t, len(prompts[0]) + j + 1, k, True),), fanout))
    assert reply.rows[0].status == HIT and list(reply.rows[0].tokens) == expect


# ---- the law of short continuations ------------------------------------------------------------

LAW_CASES = {
    # name: (SpecConfig SSD kwargs, temperature, top_p, backup)
    "hit-path": (dict(k=2, fanout=(4, 4, 5)), 1.0, 1.0, None),
    "miss-neural": (dict(k=2, fanout=(0, 1, 1)), 1.0, 1.0, None),
    "miss-suffix": (dict(k=2, fanout=(0, 1, 1), backup="suffix"), 1.0, 1.0, "suffix"),
    "miss-random": (dict(k=2, fanout=(1, 0, 1), backup="random"), 1.0, 1.0, "random"),
    "saguaro-C0.3-T0.7-topp": (dict(k=2, fanout=(2, 1, 2), C=0.3), 0.7, 0.8, None),
    "adaptive-C-T0.7-topp": (dict(k=2, fanout=(2, 2, 2), C="adaptive", c_min=0.2, backup="random"), 0.7, 0.9,
                             "random"),
}


@pytest.mark.parametrize("case", list(LAW_CASES))
def test_law_matches_target(pair6, case):
    target, draft = pair6
    kwargs, temperature, top_p, backup_name = LAW_CASES[case]
    vocab = 6
    assert kwargs.get("backup", "neural") == (backup_name or "neural")  # the engine builds the backup speculator
    prompt = [1, 4, 2]
    n = 1500
    engine = ssd_engine(target, draft, batch=500, max_model_len=16, **kwargs)
    out = engine.sample([prompt], SamplingParams(n=n, temperature=temperature, top_p=top_p, max_new_tokens=6,
                                                 ignore_eos=True, seed=11))
    m = engine.metrics()
    engine.close()
    counts = torch.zeros(vocab, vocab, vocab)
    for r in out:
        assert len(r.token_ids) == 6
        counts[r.token_ids[3], r.token_ids[4], r.token_ids[5]] += 1
    assert_ran(m, "ssd", hits=True, misses=True)  # both paths exercised
    if case == "hit-path":
        assert m["ssd/hit_rate_warm"] > 0.8
    if case.startswith("miss"):
        assert m["ssd/hit_rate_warm"] < 0.6
    law = exact_law(decoder_next_logits(target.model), prompt, 6, vocab, temperature, top_p=top_p)
    assert_fits(counts, law.sum(dim=(0, 1, 2)), alpha=1e-3)  # P(t4, t5, t6); fails by chance w.p. 1e-3


def test_an_sd_round_after_rounds_the_draft_sat_out_times_its_verify_not_its_drafting(pair48):
    """SD's drafting time ("plain_draft") is what the rule weighs SD by; the draft's first SD round after
    AR rounds first catches up on every token they emitted (a SYNC of the AR run's length, or the
    in-process speculator's catch-up forward), so that round times its verify only, and the next, caught-up
    one times both (when every SD round's drafting was timed, a kept AR choice stood on inflated SD times:
    bench/RESULTS.md, twenty-seventh session). Here the draft side answers SD's chains (no worker process)."""
    target, draft = pair48
    engine = ssd_engine(target, draft, 3, k=3, strategy_rule=True)
    ssd = engine.strategy
    script = iter([Plan.SD, Plan.SD, Plan.AR, Plan.AR, Plan.AR, Plan.AR, Plan.SD, Plan.SD] + [Plan.SD] * 64)
    ssd.chooser.choose = lambda batch, *args, **kwargs: next(script)
    estimates = ssd.chooser.estimates
    rounds, times, observe_time, step = [], [], estimates.observe_time, ssd.step
    estimates.observe_time = lambda name, *a: (times.append(name), observe_time(name, *a))

    def timed_step(running):
        del times[:]
        out = step(running)
        rounds.append(list(times))
        return out

    ssd.step = timed_step
    engine.sample(PROMPTS[:3], SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True))
    assert_ran(engine, "sd")
    engine.close()
    assert rounds[0] == []  # every sequence's first round times nothing
    assert "plain_verify" in rounds[1] and "plain_draft" in rounds[1]
    assert "plain_verify" in rounds[6] and "plain_draft" not in rounds[6]  # 4 AR tokens to catch up on
    assert "plain_verify" in rounds[7] and "plain_draft" in rounds[7]


def test_the_in_process_speculator_says_when_its_catch_up_was_more_than_a_rounds(pair48):
    """`DraftModelSpeculator.lagged`: its last `propose` fed some row more tokens than a round emits (its
    longest chain + 1: the draft sat out rounds); a round's own catch-up (the last emitted token, or two) is not."""
    from rollout_ssd.sequence import Sequence
    from rollout_ssd.spec.draft_model import CATCH_UP_TOKENS, DraftModelSpeculator

    _, draft = pair48
    sd = DraftModelSpeculator(draft.model, num_slots=2, max_len=64)
    params = SamplingParams(temperature=0, max_new_tokens=32)
    seqs = [Sequence(i, 0, list(p), params, torch.Generator(), frozenset(), 64) for i, p in enumerate(PROMPTS[:2])]
    sd.on_admit(seqs)

    def verified(accepted, bonus):  # a round of SD: each chain's first accepted[i] tokens, then a bonus token
        prop = sd.propose(seqs, [3, 3])
        for seq, chain, a, t in zip(seqs, prop.tokens, accepted, bonus):
            seq.append(list(chain[:a]) + [t], [0.0] * (a + 1))
        sd.on_verified(seqs, accepted)
        return sd.last_catch_up, sd.lagged

    for seq, t in zip(seqs, [20, 21]):
        seq.append([t], [0.0])  # the prefill's token
    assert verified([3, 0], [40, 41]) == (1, False)
    assert verified([1, 2], [42, 43]) == (CATCH_UP_TOKENS, False)  # a whole chain accepted: its last one too
    assert verified([0, 0], [44, 45]) == (1, False)
    for seq in seqs:
        seq.append([16, 17, 18, 19], [0.0] * 4)  # AR rounds it sat out
    assert verified([0, 0], [12, 13]) == (5, True)
    assert verified([0, 0], [14, 15]) == (1, False)


def test_which_drafting_times_a_caught_up_draft_leaves_out():
    """`RoundTelemetry`'s drafting times: a round whose draft caught up on rounds it sat out (`Chains.lagged`:
    the draft side's SYNC, or an SD round's speculator) times none of them; SSD misses drafted here by a
    speculator that caught up on rows that were hits time SSD's wait ("draft") but not SD's drafting
    ("plain_draft"): catching up on hits is SSD's recurring cost, not what an SD round's drafting costs."""
    from types import SimpleNamespace

    from rollout_ssd.ssd.draft_side import Chains
    from rollout_ssd.ssd.telemetry import RoundTelemetry

    def timed_names(plan, lagged, drafted_here, reply=True):
        rnd = Chains.empty([False, False])
        rnd.paths, rnd.wait_seconds, rnd.lagged, rnd.drafted_here = ["draft", "hit"], 0.01, lagged, drafted_here
        rnd.reply = SimpleNamespace(build_seconds=0.0, glue_seconds=0.0, backup_seconds=0.003) if reply else None
        seen = []
        telemetry = RoundTelemetry(None, None, None, backup_name=None)
        telemetry._observe_draft_times(plan, rnd, [0, 1], 0.02, lambda name, seconds, batch: seen.append(name))
        return sorted(seen)

    assert timed_names(Plan.SSD_DRAFT, False, (1, 0.008, False)) == ["draft", "drafting", "plain_draft"]
    assert timed_names(Plan.SSD_DRAFT, False, (1, 0.008, True)) == ["draft", "drafting"]
    assert timed_names(Plan.SSD_DRAFT, True, (1, 0.008, False)) == []
    assert timed_names(Plan.SD, False, None, reply=False) == ["plain_draft"]
    assert timed_names(Plan.SD, True, None, reply=False) == []
