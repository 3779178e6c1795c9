"""SSD with the draft in its own worker process: greedy SSD == greedy AR, and faults.

Faults: the worker is killed (SIGKILL) or frozen (SIGSTOP, caught by the reply timeout) in the middle of a
generation: every rollout still completes, greedy outputs still equal AR's, the failure is counted and
warned about once, the worker restarts at the next admission, and no process is left behind.
"""

from __future__ import annotations

import multiprocessing
import os
import signal

import pytest

from rollout_ssd import SamplingParams
from rollout_ssd.ssd.draft_server import weights_digest
from tests.support.models import tiny_pair
from tests.support.ran import assert_ran
from tests.test_ssd_helpers import ar_engine, ssd_engine

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16], [3, 3, 3, 3]]
GREEDY = SamplingParams(temperature=0, max_new_tokens=16, n=2, ignore_eos=True)

# every test here starts a worker process; a worker that fails and falls back in process (with a warning)
# would let a test of the worker pass on the fallback, so the warning is an error unless a test expects it
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("error:SSD draft worker failed:RuntimeWarning")]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_pair(tmp_path_factory.mktemp("ssdw"), vocab=48)


@pytest.fixture(scope="module")
def ar_out(pair):
    return [r.token_ids for r in ar_engine(pair[0], 3).sample(PROMPTS, GREEDY)]


def _children() -> list:
    """Live child processes, except multiprocessing's own resource tracker (one per interpreter, started
    by the spawn context; it exits with the interpreter and holds nothing of ours)."""
    try:
        import psutil
    except ImportError:
        return multiprocessing.active_children()
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(p.cmdline()):
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def _inject(engine, after_steps: int, fault):
    """Run `fault(worker_pid)` once, after `after_steps` rounds."""
    strategy = engine.strategy
    step, calls = strategy.step, [0]

    def wrapped(running):
        calls[0] += 1
        if calls[0] == after_steps:
            fault(strategy.client.pid)
        return step(running)

    strategy.step = wrapped


def test_worker_greedy_equals_ar(pair, ar_out):
    affinity = os.sched_getaffinity(0)
    engine = ssd_engine(*pair, batch=3, k=3, fanout=(1, 1, 1, 2), worker=True)
    assert not engine.strategy.client.in_process and engine.strategy.client.process.is_alive()
    out = engine.sample(PROMPTS, GREEDY)
    assert [r.token_ids for r in out] == ar_out
    m = assert_ran(engine, "ssd", hits=True, misses=True, worker=True)
    assert m["ssd/T_p"] > 0
    # a second call reuses the same worker
    assert [r.token_ids for r in engine.sample(PROMPTS, GREEDY)] == ar_out
    engine.close()
    assert _children() == []
    assert os.sched_getaffinity(0) == affinity


@pytest.mark.parametrize("fault", ["kill", "freeze"])
def test_worker_fault_falls_back_and_restarts(pair, ar_out, fault):
    engine = ssd_engine(*pair, batch=3, k=3, fanout=(1, 1, 1, 2), worker=True, worker_timeout=2.0)
    first_pid = engine.strategy.client.pid
    sig = signal.SIGKILL if fault == "kill" else signal.SIGSTOP
    _inject(engine, 5, lambda pid: os.kill(pid, sig))
    with pytest.warns(RuntimeWarning, match="draft worker failed"):
        out = engine.sample(PROMPTS, GREEDY)
    assert [r.token_ids for r in out] == ar_out  # nothing lost, duplicated or changed
    assert all(len(r.token_ids) == GREEDY.max_new_tokens for r in out)
    assert engine.metrics()["ssd/worker_failures"] == 1
    # the running rollouts finished with the in-process draft (SD); the next admission (a later wave of
    # this continuous batch) restarted the worker, which re-admitted every live sequence
    client = engine.strategy.client
    assert not client.in_process and client.pid != first_pid and client.process.is_alive()
    assert_ran(engine, "sd")  # the fallback's rounds
    assert [p.pid for p in _children()] == [client.pid]  # the failed worker is gone
    engine.metrics(reset=True)
    out2 = engine.sample(PROMPTS, GREEDY)
    assert [r.token_ids for r in out2] == ar_out
    assert engine.strategy.client.pid == client.pid
    assert_ran(engine, "ssd", hits=True, worker=True)  # the restarted worker served the next call
    engine.close()
    assert _children() == []


def test_worker_law_matches_in_process_at_temperature(pair):
    """Sampled outputs with the worker equal the in-process ones: the draft's draws are counter-based
    (ssd/rng.py) and verification's generator is the sequence's own, so the process boundary changes
    nothing but timing."""
    params = SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=16, n=3, seed=4, ignore_eos=True)
    cfg = dict(k=3, fanout=(2, 1, 1, 2), C=0.5)
    local = ssd_engine(*pair, batch=4, **cfg)
    expect = [r.token_ids for r in local.sample(PROMPTS, params)]
    assert_ran(local, "ssd", hits=True, worker=False)
    local.close()
    engine = ssd_engine(*pair, batch=4, worker=True, **cfg)
    got = [r.token_ids for r in engine.sample(PROMPTS, params)]
    assert_ran(engine, "ssd", hits=True, worker=True)  # the worker served the whole run
    engine.close()
    assert got == expect
    assert _children() == []


def test_worker_that_cannot_start_falls_back(pair, ar_out):
    with pytest.warns(RuntimeWarning, match="draft worker failed"):
        engine = ssd_engine(*pair, batch=3, k=3, fanout=(1, 1, 1, 2), worker=True, startup_timeout=0.05,
                            max_restarts=0)
    assert engine.strategy.client.in_process
    assert [r.token_ids for r in engine.sample(PROMPTS, GREEDY)] == ar_out
    assert_ran(engine, "sd", worker=False)  # the fallback (SD in process) ran the rounds
    engine.close()
    assert _children() == []


def test_a_target_update_of_a_shared_tensor_reaches_the_worker(tmp_path):
    """A draft that shares its embedding with the target (as the built-in draft does) holds a copy of it in
    the worker; a target update that changes it must reach the worker (the draft side notices the change
    from the tensor's version counter), and one that leaves it alone must not be re-sent."""
    from rollout_ssd.ssd.draft_server import weights_digest

    target, draft = tiny_pair(tmp_path, vocab=48)
    draft.model.embed = target.model.embed  # shared storage, as `share_embedding_from` gives
    engine = ssd_engine(target, draft, batch=2, k=3, worker=True)
    try:
        ssd = engine.strategy
        assert "model.embed_tokens.weight" in ssd.draft._shared_names
        before = ssd.draft_digest()
        embed = target.model.hf_parameters()["model.embed_tokens.weight"]
        norm = target.model.hf_parameters()["model.norm.weight"]
        engine.update_weights([("model.norm.weight", norm + 0.5)], version=1)  # not shared: nothing to send
        assert ssd.draft_digest() == before
        engine.update_weights([("model.embed_tokens.weight", embed + 0.25)], version=2)
        after = ssd.draft_digest()
        assert after != before and after == weights_digest(draft.model.hf_parameters())
        assert [r.token_ids for r in engine.sample(PROMPTS[:2], GREEDY)] == \
            [r.token_ids for r in ar_engine(target, 2).sample(PROMPTS[:2], GREEDY)]
        assert_ran(engine, "ssd", worker=True)
    finally:
        engine.close()


def test_target_takes_the_workers_core_in_rounds_that_leave_it_idle(pair, ar_out):
    """SSD rounds verify on the target's own core with one thread (the worker builds on the other); AR
    and SD rounds, which leave the worker idle, verify on every core; greedy stays AR's on every path."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPU cores")
    import itertools

    import torch

    from rollout_ssd.ssd.chooser import Plan

    wide = (os.sched_getaffinity(0), torch.get_num_threads())  # before the worker takes a core
    engine = ssd_engine(*pair, batch=3, k=3, fanout=(1, 1, 1, 2), worker=True)
    # made and between calls the calling thread is wide: another engine it drives runs on every core
    assert (os.sched_getaffinity(0), torch.get_num_threads()) == wide
    ssd = engine.strategy
    turns = itertools.cycle([Plan.SSD_DRAFT, Plan.AR, Plan.SSD_DRAFT, Plan.SD, Plan.AR])
    ssd.chooser.choose = lambda batch, fallback=None, tail=False, cold=False: next(turns)
    seen, verify = [], ssd._verify
    ssd._verify = lambda running, rnd, plan: (seen.append((plan, os.sched_getaffinity(0), torch.get_num_threads())),
                                               verify(running, rnd, plan))[1]
    asked, share = [], ssd._share

    def recording_share(plan):
        in_process, cores = share(plan)
        asked.append((plan, in_process))
        return in_process, cores

    ssd._share = recording_share
    requests, request = [], ssd.draft.request_chains
    ssd.draft.request_chains = lambda *a: (requests.append(1), request(*a))[1]
    assert [r.token_ids for r in engine.sample(PROMPTS, GREEDY)] == ar_out
    assert (os.sched_getaffinity(0), torch.get_num_threads()) == wide
    ssd.chooser.choose = lambda batch, fallback=None, tail=False, cold=False: Plan.SSD_DRAFT  # a call whose every round narrows
    assert [r.token_ids for r in engine.sample(PROMPTS[:1], GREEDY)] == ar_out[:2]
    assert (os.sched_getaffinity(0), torch.get_num_threads()) == wide
    ssd.chooser.choose = lambda batch, fallback=None, tail=False, cold=False: next(turns)
    # SD rounds draft in this process with the SD engine's speculator (the worker would draft on its one
    # core, over the whole vocabulary) and never ask the worker; SSD rounds ask it
    assert ssd.sd is not None and all(in_process == (plan is Plan.SD) for plan, in_process in asked)
    assert len(requests) == sum(plan.asks_draft_side and plan is not Plan.SD for plan, _ in asked)
    narrow = ({min(wide[0])}, 1)
    assert {p for p, _, _ in seen} == {Plan.SSD_DRAFT, Plan.AR, Plan.SD}
    for plan, cores, threads in seen:
        assert (cores, threads) == (narrow if plan.is_ssd else wide), plan
    # a draft update reaches both: the worker gets the weights, the in-process speculator (it drafts
    # with the target side's copy, now written) drops the draft KV the old weights built
    dropped, weights_changed = [], ssd.sd.weights_changed
    ssd.sd.weights_changed = lambda: (dropped.append(1), weights_changed())[1]
    engine.update_draft_weights(list(pair[1].model.hf_parameters().items()), version=2)
    assert dropped == [1] and ssd.draft_digest() == weights_digest(ssd.draft_model.hf_parameters())
    assert [r.token_ids for r in engine.sample(PROMPTS, GREEDY)] == ar_out
    for plan in ("ssd+neural", "sd"):
        assert_ran(engine, plan, worker=True)
    engine.close()
    assert (os.sched_getaffinity(0), torch.get_num_threads()) == wide


def _sd_engine_outputs(pair, params):
    """The SD engine's outputs (K = 3, batch 3) for PROMPTS: what the SSD engine's in-process paths match."""
    from rollout_ssd import EngineConfig, RolloutEngine, SpecConfig

    sd = RolloutEngine(pair[0], SpecConfig(method="sd", k=3), EngineConfig(max_batch_size=3, max_model_len=128),
                       draft=pair[1])
    with sd:
        return sd.sample(PROMPTS, params)


def test_sd_rounds_beside_a_worker_are_the_sd_engines_rounds_at_temperature(pair):
    """With a worker holding a core, the SSD engine's SD rounds run the SD engine's own speculator in
    process: with the same seeds they give exactly the SD engine's tokens and logprobs at T > 0 (an exact
    check of the path's law: same draft law, same streams, same verification)."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPU cores (the in-process SD rounds exist beside a pinned worker)")
    from rollout_ssd.ssd.chooser import Plan

    params = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=12, n=2, seed=7, ignore_eos=True)
    want = _sd_engine_outputs(pair, params)
    engine = ssd_engine(*pair, batch=3, k=3, worker=True)
    engine.strategy.chooser.choose = lambda batch, fallback=None, tail=False, cold=False: Plan.SD
    got = engine.sample(PROMPTS, params)
    assert_ran(engine, "sd", accepted=True, worker=True)
    assert engine.strategy.sd is not None and engine.metrics()["ssd/strategy_rounds"].keys() == {"sd"}
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert [r.logprobs for r in got] == [r.logprobs for r in want]
    engine.close()


def test_an_sd_round_timing_the_caps_one_core_verify_drafts_whole_chains_and_verifies_narrow(pair, ar_out):
    """Where the chooser wants the SSD cap's one-core verify time (`Chooser.narrow_verify`), the SD
    round itself verifies on the target's own core with chains drafted whole (K tokens, no early stop:
    the SSD verify's shape), and its verify is timed as "verify_narrow", not as SD's "plain_verify";
    other SD rounds verify on every core. A round of first rounds neither drafts whole nor narrows.
    Greedy stays AR's."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPU cores (the in-process SD rounds exist beside a pinned worker)")
    import itertools

    import torch

    from rollout_ssd.ssd.chooser import Plan

    wide = (os.sched_getaffinity(0), torch.get_num_threads())
    engine = ssd_engine(*pair, batch=3, k=3, worker=True)
    ssd = engine.strategy
    ssd._sd_spare.stop_prob = 0.9  # the draft's chains mostly stop early, unless drafted whole
    ssd.chooser.choose = lambda batch, fallback=None, tail=False, cold=False: Plan.SD
    turns = itertools.cycle([False, True])
    ssd.chooser.narrow_verify = lambda batch, cores: next(turns)
    rounds, propose, verify = [], ssd._propose_sd, ssd._verify

    def proposing(running, ks, whole=False):
        rnd = propose(running, ks, whole)
        rounds.append({"whole": whole, "cold": rnd.cold, "ks": list(ks), "lengths": [len(c) for c in rnd.chains]})
        return rnd

    ssd._propose_sd = proposing
    ssd._verify = lambda running, rnd, plan: (rounds[-1].update(share=(os.sched_getaffinity(0), torch.get_num_threads())),
                                               verify(running, rnd, plan))[1]
    est = ssd.telemetry.estimates
    timed, observe = [], est.observe_time  # (round, time name)
    est.observe_time = lambda name, seconds, batch: (timed.append((len(rounds) - 1, name)), observe(name, seconds, batch))[1]
    assert [r.token_ids for r in engine.sample(PROMPTS, GREEDY)] == ar_out
    assert_ran(engine, "sd", worker=True)
    narrow = [r for r in rounds if r["whole"] and not r["cold"]]
    others = [r for r in rounds if not r["whole"] and not r["cold"]]
    warm = [r for r in rounds if not r["cold"]]  # the chooser is asked in these only
    assert narrow and others and [r["whole"] for r in warm] == [i % 2 == 1 for i in range(len(warm))]
    assert any(r["cold"] for r in rounds) and not any(r["whole"] for r in rounds if r["cold"])
    assert all(r["share"] == ({min(wide[0])}, 1) and r["lengths"] == r["ks"] for r in narrow)
    assert all(r["share"] == wide for r in rounds if r not in narrow)  # a cold round verifies wide
    assert any(n < k for r in others for n, k in zip(r["lengths"], r["ks"]))  # early stops elsewhere
    names = [name for _, name in timed]
    assert names.count("verify_narrow") == len(narrow) and names.count("plain_verify") == len(others)
    for i, r in enumerate(rounds):  # a narrow round times its verify, and no SD time
        in_round = {name for j, name in timed if j == i}
        assert ("verify_narrow" in in_round) == (r in narrow) and not (r in narrow and in_round & {"plain_verify", "plain_draft"})
    assert (os.sched_getaffinity(0), torch.get_num_threads()) == wide
    engine.close()


def _count_here(engine) -> list:
    """Per SSD round with a miss: (rows drafted in the target's process, rows the worker drafted)."""
    from rollout_ssd.ssd.messages import DRAFTED

    ssd, seen = engine.strategy, []
    propose = ssd._propose

    def recording(*a):
        rnd = propose(*a)
        if "draft" in rnd.paths and not rnd.cold:
            seen.append((rnd.drafted_here[0] if rnd.drafted_here else 0,
                         sum(row.status == DRAFTED for row in rnd.reply.rows)))
        return rnd

    ssd._propose = recording
    return seen


def test_ssd_misses_beside_a_worker_are_drafted_by_the_sd_speculator_at_temperature(pair):
    """Beside a worker holding a core, an SSD round's misses are drafted in the target's process by the
    SD engine's speculator on every core (the worker only builds the next cache from them). With no
    cache built, every round is a miss: the tokens and logprobs are then exactly the SD engine's at
    T > 0 with the same seeds (an exact check of that path's law)."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPU cores (misses are drafted here beside a pinned worker)")
    params = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=12, n=2, seed=11, ignore_eos=True)
    want = _sd_engine_outputs(pair, params)
    engine = ssd_engine(*pair, batch=3, k=3, fanout=(1, 1, 1, 2), worker=True)
    build = engine.strategy.draft.build
    engine.strategy.draft.build = lambda running, chains, ks, _build, fanout: build(running, chains, ks, False, fanout)
    seen = _count_here(engine)
    got = engine.sample(PROMPTS, params)
    m = assert_ran(engine, "ssd+neural", hits=False, accepted=True, worker=True)  # cold rounds: none warm
    assert m["ssd/strategy_rounds"].keys() == {"ssd+neural"}
    assert seen and all(here > 0 and worker == 0 for here, worker in seen)
    # with no cache ever built, every SSD round is of the catch-up kind, which times nothing (telemetry):
    # neither SD's drafting here ("plain_draft") nor the verify
    est = engine.strategy.telemetry.estimates
    assert sum(est._times["plain_draft"].counts.values()) == 0 and sum(est._times["verify"].counts.values()) == 0
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert [r.logprobs for r in got] == [r.logprobs for r in want]
    engine.close()
    assert _children() == []


def test_saguaro_keeps_the_misses_in_the_worker(pair, ar_out):
    """With Saguaro on (C < 1) the worker drafts the misses itself (its chains bend towards the next
    cache; the SD speculator's do not); greedy stays AR's with hits and misses both present."""
    engine = ssd_engine(*pair, batch=3, k=3, fanout=(1, 1, 1, 2), worker=True, C=0.5)
    seen = _count_here(engine)
    assert [r.token_ids for r in engine.sample(PROMPTS, GREEDY)] == ar_out
    assert seen and all(here == 0 and worker > 0 for here, worker in seen)
    assert engine.strategy.sd is None
    assert_ran(engine, "ssd", hits=True, misses=True, worker=True)
    engine.close()


def test_beside_a_worker_the_target_prefills_on_every_core_before_the_worker(pair, ar_out, monkeypatch):
    """On a CPU split with the worker (every round SSD): the target's prefill runs on every core; the
    worker is told of the new sequences at their first round, and the in-process speculator (made with
    the engine, taken up at the first round that drafts SSD's misses with it) prefills on every core only
    once the worker has answered that round, so the two prefills never share a core; greedy stays AR's."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPU cores")
    import torch

    from rollout_ssd.spec.draft_model import DraftModelSpeculator
    from rollout_ssd.ssd.messages import AdmitSequences

    wide = (os.sched_getaffinity(0), torch.get_num_threads())
    engine = ssd_engine(*pair, batch=3, k=3, worker=True)
    ssd, events = engine.strategy, []
    assert ssd.sd is None and ssd._sd_spare is not None  # in use from its first round; made (its KV cache) with the engine
    spare = ssd._sd_spare
    where = lambda: (os.sched_getaffinity(0), torch.get_num_threads())  # noqa: E731
    prefill, client = ssd.runner.prefill, ssd.draft.client
    send, request = client.send, client.request
    ssd.runner.prefill = lambda *a, **kw: (events.append(("prefill", *where())), prefill(*a, **kw))[1]
    client.send = lambda msg: (events.append(("admit",)) if isinstance(msg, AdmitSequences) else None, send(msg))[1]
    client.request = lambda msg: (request(msg), events.append(("reply",)))[0]
    sd_admit = DraftModelSpeculator.on_admit
    monkeypatch.setattr(DraftModelSpeculator, "on_admit",
                        lambda self, seqs: (events.append(("sd prefill", *where())), sd_admit(self, seqs))[1])
    assert [r.token_ids for r in engine.sample(PROMPTS, GREEDY)] == ar_out
    assert events[:4] == [("prefill", *wide), ("admit",), ("reply",), ("sd prefill", *wide)]
    assert all(e[1:] == wide for e in events if e[0] in ("prefill", "sd prefill"))
    assert ssd.sd is spare and ssd._sd_spare is None  # the one made with the engine, taken up
    assert_ran(engine, "ssd", worker=True)
    engine.close()


def test_the_worker_is_told_of_sequences_at_their_first_round_that_asks_it(pair, ar_out):
    """Beside a worker process, admission waits for the first round that asks the worker for chains:
    while the rule runs AR its prefill would share the target's cores. Sequences that end within AR
    rounds are never sent (nor released); the others are sent at the first SSD round with every
    committed token, and greedy stays AR's."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPU cores")
    from rollout_ssd.ssd.chooser import Plan
    from rollout_ssd.ssd.messages import AdmitSequences, ReleaseSequences

    engine = ssd_engine(*pair, batch=3, k=3, worker=True)
    ssd, sent, rounds = engine.strategy, [], [0]
    client = ssd.draft.client
    send, request = client.send, client.request
    client.send = lambda msg: (sent.append((rounds[0], msg)), send(msg))[1]
    client.request = lambda msg: (sent.append((rounds[0], msg)), request(msg))[1]

    def choose(batch, fallback=None, tail=False, cold=False):
        rounds[0] += 1
        return Plan.AR if rounds[0] <= 6 else Plan.SSD_DRAFT

    ssd.chooser.choose = choose
    # first call: 6 tokens each (the prefill samples the first), all in AR rounds
    assert [r.token_ids for r in engine.sample(PROMPTS[:1], SamplingParams(temperature=0, max_new_tokens=6,
                                                                           n=2, ignore_eos=True))] \
        == [t[:6] for t in ar_out[:2]]
    assert sent == [] and ssd.draft.unsent == {} and ssd.draft.live == {}
    rounds[0] = 0
    assert [r.token_ids for r in engine.sample(PROMPTS, GREEDY)] == ar_out
    admits = [(r, m) for r, m in sent if isinstance(m, AdmitSequences)]
    assert admits and admits[0][0] == 7  # sent in the first SSD round, not at admission
    first = admits[0][1].rows
    assert len(first) == 3 and all(len(row.tokens) > len(p) for row, p in zip(first, [PROMPTS[0]] * 2 + [PROMPTS[1]]))
    released = {row for _, m in sent if isinstance(m, ReleaseSequences) for row in m.seq_ids}
    assert released <= {row.seq_id for _, m in admits for row in m.rows}
    assert_ran(engine, "ssd+neural", worker=True)
    engine.close()


def test_the_sd_round_that_makes_the_in_process_speculator_times_nothing(pair, ar_out):
    """Beside a worker the SD speculator is made at the first round that drafts with it, and prefills
    the live sequences there: that round is a one-off (timed as a first round, like a cold start), so
    SD's estimates come from its later rounds only; greedy stays AR's."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPU cores")
    from rollout_ssd.ssd.chooser import Plan

    engine = ssd_engine(*pair, batch=3, k=3, worker=True)
    ssd, rounds = engine.strategy, [0]

    def choose(batch, fallback=None, tail=False, cold=False):
        rounds[0] += 1
        return Plan.AR if rounds[0] <= 3 else Plan.SD

    ssd.chooser.choose = choose
    ssd.trace = trace = []
    params = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)
    assert [r.token_ids for r in engine.sample(PROMPTS[:1], params)] == ar_out[:1]
    sd_rounds = [r for r in trace if r["strategy"] == "sd"]
    assert ssd.sd is not None and len(sd_rounds) >= 2
    est = ssd.chooser.estimates
    assert est.times_measured("plain_verify", 1) == len(sd_rounds) - 1
    # SD's drafting is timed where a chain was drafted (not in a last round with no room left for one)
    assert len(sd_rounds) - 2 <= est.times_measured("plain_draft", 1) <= len(sd_rounds) - 1
    assert_ran(engine, "sd", worker=True)
    engine.close()


def test_a_worker_started_ahead_is_taken_by_its_engine_or_dismissed(pair, ar_out, monkeypatch, tmp_path):
    """`from_pretrained` starts the worker's interpreter before it loads the models; the engine's draft
    side takes that process (greedy still equals AR), and a construction that fails ends it."""
    import time

    from rollout_ssd import RolloutEngine, SpecConfig
    from rollout_ssd.ssd import worker_client

    started = []

    class Recorded(worker_client._WorkerProcess):
        def __init__(self, *args):
            super().__init__(*args)
            started.append(self)

    monkeypatch.setattr(worker_client, "_WorkerProcess", Recorded)
    spec = SpecConfig(method="ssd", k=3, strategy_rule=False, rule_cache=False)
    with RolloutEngine.from_pretrained(pair[0].source, draft=pair[1].source, spec=spec, dtype="float32",
                                       max_batch_size=3, max_model_len=128) as engine:
        assert len(started) == 1 and engine.strategy.client.pid == started[0].pid  # the spare, taken
        assert worker_client._spare is None
        assert [r.token_ids for r in engine.sample(PROMPTS, GREEDY)] == ar_out
        assert_ran(engine, "ssd", worker=True)
    assert not started[0].is_alive()
    with pytest.raises(ValueError):
        RolloutEngine.from_pretrained(pair[0].source, draft=str(tmp_path / "no-such-draft"), spec=spec, dtype="float32")
    assert len(started) == 2 and worker_client._spare is None
    deadline = time.monotonic() + 10
    while started[1].is_alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not started[1].is_alive()
    assert _children() == []


def test_a_spare_worker_whose_parent_is_gone_exits():
    """A spare waits on its stdin: a parent that exits without dismissing it leaves it end-of-file."""
    import subprocess
    import sys
    import time

    code = ("import os\nfrom rollout_ssd.ssd import worker_client as w\nw.prestart()\n"
            "print(w._spare.pid, flush=True)\nos._exit(0)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    pid = int(out.stdout.split()[-1])
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    os.kill(pid, signal.SIGKILL)
    pytest.fail(f"the spare worker {pid} outlived its parent by 60 s")
