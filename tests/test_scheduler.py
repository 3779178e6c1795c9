"""Continuous batching across requests (scheduler.py): `submit` from many threads joins the running
batch, cancel, pause/resume, close, progress listeners, and stop strings.

The contract checked throughout: a request's rollouts never depend on which other requests shared
its rounds, so every request run inside a shared batch gets exactly what it gets alone via `sample`
(token ids, finish reasons and text exactly; logprobs to 1e-5: float32 CPU matmuls do not give
bitwise the same row when the batch has another number of rows, so the last bits of a logprob may
differ with the batch's size, as in test_engine.py).

Rounds are observed by wrapping the engine's decode strategy (`_record_rounds`) and made
deterministic with `Gate`: a listener that holds the scheduler's thread at the end of a round
until the test has done what it wants between two rounds (submit, cancel, pause).
The model is `rl.tiny`'s character-level target/draft pair (real HF dirs with a tokenizer).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

import pytest
import torch

from rollout_ssd import EngineConfig, RolloutEngine, SamplingParams, SpecConfig
from rollout_ssd.models.loader import load_pretrained
from rollout_ssd.request import RequestCancelled
from rollout_ssd.rl.tasks import ALPHABET
from rollout_ssd.rl.tiny import build_tiny_pair
from tests.support.ran import assert_ran

THREAD = "rollout-ssd-scheduler"
MAX_LEN = 128


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    return build_tiny_pair(tmp_path_factory.mktemp("sched-tiny"), ALPHABET)


@pytest.fixture(scope="module")
def models(pair_dirs):
    """(target with its char-level tokenizer, its noisy draft copy), float32. Read only: a test that
    updates weights loads its own target."""
    target_dir, draft_dir = pair_dirs
    target = load_pretrained(str(target_dir), dtype="float32")
    draft = load_pretrained(str(draft_dir), dtype="float32", with_tokenizer=False)
    return target, draft


def _engine(target, method: str = "ar", draft=None, batch: int = 16) -> RolloutEngine:
    """ar; sd with `draft` (k = 4, no early stop: chains of 4 even where the tiny draft is unsure)."""
    spec = SpecConfig(method="ar") if method == "ar" else SpecConfig(method="sd", k=4, speculator="draft",
                                                                      stop_prob=0.0)
    return RolloutEngine(target, spec, EngineConfig(max_batch_size=batch, max_model_len=MAX_LEN),
                         draft=None if method == "ar" else draft)


def _method_engine(models, method: str, batch: int = 16) -> RolloutEngine:
    """"ar", "sd" (the noisy draft) or "sd-self" (the target as its own draft: greedy accepts all)."""
    target, draft = models
    if method == "ar":
        return _engine(target, batch=batch)
    return _engine(target, "sd", draft=target if method == "sd-self" else draft, batch=batch)


def _ran(engine: RolloutEngine, method: str) -> None:
    """An "sd" or "sd-self" engine verified proposals and accepted some of them (tests.support.ran); "ar":
    nothing to check. Before the engine closes."""
    if method != "ar":
        assert_ran(engine, "spec", accepted=True)


def _assert_same(got, ref) -> None:
    assert [(r.prompt_index, r.sample_index) for r in got] == [(r.prompt_index, r.sample_index) for r in ref]
    for g, r in zip(got, ref):
        key = (g.prompt_index, g.sample_index)
        assert g.token_ids == r.token_ids, key
        assert (g.finish_reason, g.text, g.extra, g.weight_version) == (r.finish_reason, r.text, r.extra,
                                                                         r.weight_version), key
        assert g.prompt_token_ids == r.prompt_token_ids
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(r.logprobs), rtol=0, atol=1e-5)


def _assert_idle(engine: RolloutEngine) -> None:
    assert engine.runner.cache.num_free == engine.runner.cache.num_slots
    assert engine.scheduler.counts() == {"running": 0, "waiting": 0, "requests": 0}


def _record_rounds(engine: RolloutEngine) -> list[tuple[frozenset, int, int]]:
    """Wrap the strategy's step: per round, (request ids in the batch, batch size, free KV slots)."""
    rounds = []
    step = engine.strategy.step

    def recording(running):
        rounds.append((frozenset(s.request_id for s in running), len(running), engine.runner.cache.num_free))
        return step(running)

    engine.strategy.step = recording
    return rounds


def _wait_until(cond, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def _scheduler_threads() -> set:
    return {t for t in threading.enumerate() if t.name == THREAD and t.is_alive()}


class Gate:
    """A listener that, the first time `when(request)` holds after a round, blocks the scheduler's
    thread (inside that round, after its step) until `release` is set. Records every call."""

    def __init__(self, when):
        self.when = when
        self.reached = threading.Event()
        self.release = threading.Event()
        self.calls: list[tuple[bool, int]] = []
        self.finished = threading.Event()

    def __call__(self, request, finished):
        self.calls.append((finished, request.num_tokens))
        if finished:
            self.finished.set()
        elif not self.reached.is_set() and self.when(request):
            self.reached.set()
            self.release.wait(60)


# ---- 1. requests from several threads join the running batch ---------------------------------------

JOIN_REQUESTS = [  # (prompts, params, prompt_indices); the first one runs alone before the others arrive
    (["Write digits:", "Tom has 3 apples."], SamplingParams(n=2, temperature=0.0, max_new_tokens=48), None),
    (["abc", "Anna, Sam and Maya"], SamplingParams(n=2, temperature=1.0, max_new_tokens=30, seed=7), None),
    (["Numbers only: 12+3"], SamplingParams(n=3, temperature=0.8, top_k=5, max_new_tokens=25, seed=1), None),
    (["x", "Lily has 9 books, Ben 4"], SamplingParams(temperature=1.2, top_p=0.7, max_new_tokens=40, seed=2), [5, 2]),
    (["Digits: 7"], SamplingParams(temperature=0.0, max_new_tokens=3), None),
]


@pytest.mark.parametrize("method", ["ar", "sd"])
def test_requests_from_threads_join_the_running_batch(models, method):
    """While the first request runs (held after its first round), four threads submit requests with
    other sampling parameters at once; the very next round runs all five requests' sequences in one
    batch, and every request's rollouts equal that request run alone via `sample`."""
    with _method_engine(models, method) as ref:
        alone = [ref.sample(p, s, prompt_indices=i) for p, s, i in JOIN_REQUESTS]
    assert any(r.finish_reason == "length" and len(r.token_ids) == 3 for r in alone[-1])
    with _method_engine(models, method) as engine:
        rounds = _record_rounds(engine)
        gate = Gate(lambda req: req.num_tokens > len(req.seqs))  # after its first decode round
        first = engine.submit(JOIN_REQUESTS[0][0], JOIN_REQUESTS[0][1], listener=gate)
        submitted = [first] + [None] * (len(JOIN_REQUESTS) - 1)
        barrier = threading.Barrier(len(JOIN_REQUESTS) - 1)

        def client(k):
            prompts, params, indices = JOIN_REQUESTS[k]
            barrier.wait(30)
            submitted[k] = engine.submit(prompts, params, prompt_indices=indices)

        clients = [threading.Thread(target=client, args=(k,)) for k in range(1, len(JOIN_REQUESTS))]
        try:
            assert gate.reached.wait(30)
            alone_rounds = len(rounds)
            for t in clients:
                t.start()
            for t in clients:
                t.join(30)
            assert all(r is not None for r in submitted)
            others = sum(len(r.seqs) for r in submitted[1:])
            assert engine.scheduler.counts() == {"running": len(first.seqs), "waiting": others,
                                                 "requests": len(JOIN_REQUESTS)}
        finally:
            gate.release.set()
        results = [r.result(timeout=60) for r in submitted]
        _assert_idle(engine)
        _ran(engine, method)
    assert alone_rounds >= 1 and all(ids == {first.id} for ids, _, _ in rounds[:alone_rounds])
    joined_ids, joined_size, _ = rounds[alone_rounds]
    assert joined_ids == {r.id for r in submitted}, "the submitted requests must join the next round"
    assert joined_size == len(first.seqs) + others
    assert max(size for _, size, _ in rounds) > max(len(r.seqs) for r in submitted)
    for got, ref_rollouts in zip(results, alone):
        _assert_same(got, ref_rollouts)


@pytest.mark.parametrize("method", ["ar", "sd"])
def test_finished_sequences_leave_no_holes_in_the_running_slots(models, method):
    """Requests of several lengths run in one batch: as sequences finish, the ones left move down into
    the freed KV slots, so every round's batch holds slots 0..n-1 (attention reads the cache as a view)
    and at least one sequence was moved, while every request's rollouts equal that request alone."""
    reqs = [(["Write digits:", "abc"], SamplingParams(n=2, temperature=0.0, max_new_tokens=m), None)
            for m in (4, 30)] + JOIN_REQUESTS[1:3]
    with _method_engine(models, method) as ref:
        alone = [ref.sample(p, s, prompt_indices=i) for p, s, i in reqs]
    with _method_engine(models, method) as engine:
        slots, moved = [], []
        step, move_down = engine.strategy.step, engine.runner.move_down

        def recording(running):
            slots.append(sorted(s.slot for s in running))
            return step(running)

        def moving(slot):
            moved.append(slot)
            return move_down(slot)

        engine.strategy.step, engine.runner.move_down = recording, moving
        engine.pause()
        submitted = [engine.submit(p, s, prompt_indices=i) for p, s, i in reqs]
        engine.resume()
        results = [r.result(timeout=60) for r in submitted]
        _assert_idle(engine)
        _ran(engine, method)
    assert len(set(map(len, slots))) > 2, "the batch must shrink as requests finish"
    assert all(round_slots == list(range(len(round_slots))) for round_slots in slots), slots
    assert moved  # sequences were moved down into freed slots
    for got, ref_rollouts in zip(results, alone):
        _assert_same(got, ref_rollouts)


# ---- 2. cancel ------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["ar", "sd"])
def test_cancel_frees_slots_at_the_next_round(models, method):
    """A request is cancelled while its long sequence runs (its other sequence, whose prompt nearly
    fills the context, already finished by length): the next round runs without it and its slot is
    free; the unfinished sequence ends "abort", result() raises RequestCancelled, and the concurrent
    requests get exactly what they get alone."""
    long_prompt = [3 + i % 70 for i in range(MAX_LEN - 4)]  # 4 tokens of context left
    doomed_args = ([[5, 6, 7], long_prompt], SamplingParams(temperature=1.0, max_new_tokens=100, seed=3,
                                                               ignore_eos=True))
    others = [([[8, 9, 10, 11]], SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)),
              ([[12, 13], [14]], SamplingParams(n=2, temperature=0.9, top_p=0.8, max_new_tokens=30, seed=4,
                                                ignore_eos=True))]
    with _method_engine(models, method) as ref:
        alone = [ref.sample(p, s) for p, s in others]
    with _method_engine(models, method) as engine:
        rounds = _record_rounds(engine)
        gate = Gate(lambda req: req.seqs[1].finish_reason == "length")
        engine.pause()  # all three start in the same round
        doomed = engine.submit(*doomed_args, listener=gate)
        rest = [engine.submit(p, s) for p, s in others]
        engine.resume()
        try:
            assert gate.reached.wait(30)
            doomed.cancel()
            cancelled_at = len(rounds)
        finally:
            gate.release.set()
        results = [r.result(timeout=60) for r in rest]
        assert doomed.done()
        with pytest.raises(RequestCancelled):
            doomed.result(timeout=1)
        _assert_idle(engine)
        _ran(engine, method)
        num_slots = engine.runner.cache.num_slots
    assert doomed.id in rounds[cancelled_at - 1][0]
    ids, size, free = rounds[cancelled_at]
    assert doomed.id not in ids and size == sum(len(r.seqs) for r in rest)
    assert free == num_slots - size, "the cancelled sequence's slot must be free at the next round"
    short, long_ = doomed.seqs
    assert (short.finish_reason, long_.finish_reason) == ("abort", "length")
    assert len(long_.token_ids) == 4 and 1 < len(short.token_ids) < 100 and short.slot == -1
    assert gate.finished.wait(5) and [f for f, _ in gate.calls].count(True) == 1 and gate.calls[-1][0]
    for got, ref_rollouts in zip(results, alone):
        _assert_same(got, ref_rollouts)


def test_cancel_waiting_request_never_runs(models):
    """A request waiting for a KV slot that is cancelled is dropped without being admitted; the
    running one is unaffected."""
    target, _ = models
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=60, seed=5, ignore_eos=True)
    with _engine(target, batch=2) as ref:
        alone = ref.sample([[20, 21, 22]], params)
    with _engine(target, batch=2) as engine:
        engine.pause()
        holder = engine.submit([[20, 21, 22]], params)  # takes both slots for 60 rounds
        waiting = engine.submit([[30, 31]], SamplingParams(temperature=0.0, max_new_tokens=5))
        engine.resume()
        waiting.cancel()
        assert waiting.wait(30)
        with pytest.raises(RequestCancelled):
            waiting.result()
        assert waiting.seqs[0].finish_reason == "abort" and waiting.seqs[0].token_ids == []
        _assert_same(holder.result(timeout=60), alone)
        _assert_idle(engine)


# ---- 3. pause / resume ----------------------------------------------------------------------------


def test_pause_stops_rounds_and_resume_finishes_them(models):
    """Paused mid-run, a request and one submitted during the pause make no progress for 0.3 s (no
    round at all), keep their places, and after resume both equal their unpaused runs."""
    target, _ = models
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=40, seed=11, ignore_eos=True)
    late_args = ([[40, 41, 42]], SamplingParams(temperature=0.0, max_new_tokens=20))
    with _engine(target) as ref:
        alone = ref.sample([[5, 6, 7], [9, 10]], params)
        late_alone = ref.sample(*late_args)
    with _engine(target) as engine:
        rounds = _record_rounds(engine)
        gate = Gate(lambda req: len(req.seqs[0].token_ids) >= 5)
        request = engine.submit([[5, 6, 7], [9, 10]], params, listener=gate)
        try:
            assert gate.reached.wait(30)
            engine.pause()
            tokens = [list(s.token_ids) for s in request.seqs]
            paused_at = len(rounds)
        finally:
            gate.release.set()
        late = engine.submit(*late_args)
        time.sleep(0.3)
        assert engine.scheduler.paused and not request.done() and not late.done()
        assert [s.token_ids for s in request.seqs] == tokens and late.num_tokens == 0
        assert len(rounds) == paused_at
        assert engine.scheduler.counts() == {"running": 4, "waiting": 1, "requests": 2}
        assert engine.runner.cache.num_free == engine.runner.cache.num_slots - 4  # they keep their KV
        engine.resume()
        _assert_same(request.result(timeout=60), alone)
        _assert_same(late.result(timeout=60), late_alone)
        _assert_idle(engine)


def test_weight_update_applies_while_paused(pair_dirs):
    """An update submitted while a request is paused mid-run applies without resume (the version
    advances, the request makes no progress); after resume the request continues under the new
    weights from where it was: its first tokens are the old weights' greedy run, the rest the new
    weights' greedy continuation of prompt + those tokens."""
    target_dir, draft_dir = pair_dirs
    target = load_pretrained(str(target_dir), dtype="float32")  # this test writes into its weights
    new = load_pretrained(str(draft_dir), dtype="float32", with_tokenizer=False)  # same shapes, other weights
    prompt = [5, 6, 7, 8]
    params = SamplingParams(temperature=0.0, max_new_tokens=30, ignore_eos=True)
    with _engine(target) as ref:
        (old_run,) = ref.sample([prompt], params)
    with _engine(target) as engine:
        gate = Gate(lambda req: req.num_tokens >= 6)
        request = engine.submit([prompt], params, listener=gate)
        try:
            assert gate.reached.wait(30)
            engine.pause()
        finally:
            gate.release.set()
        _wait_until(lambda: engine.scheduler.driving)  # the driver holds the paused request
        done = request.num_tokens
        engine.update_weights(list(new.model.hf_parameters().items()), version=1)
        _wait_until(lambda: engine.weight_version == 1, timeout=10)
        time.sleep(0.05)
        assert engine.scheduler.paused and request.num_tokens == done and not request.done()
        engine.resume()
        (out,) = request.result(timeout=60)
        _assert_idle(engine)
    prefix = old_run.token_ids[:done]
    with _engine(new) as ref_new:
        (cont,) = ref_new.sample([prompt + prefix], dataclasses.replace(params, max_new_tokens=30 - done))
    assert cont.token_ids != old_run.token_ids[done:], "the new weights must change the continuation"
    assert out.token_ids == prefix + cont.token_ids
    assert out.weight_version == 1 and out.extra == {"weight_versions": [0, 1]}
    torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(old_run.logprobs[:done] + cont.logprobs),
                               rtol=0, atol=1e-5)


# ---- 4. close -------------------------------------------------------------------------------------


@pytest.mark.parametrize("paused", [False, True])
def test_close_ends_live_requests_and_the_thread(models, paused):
    """close() with a running and a queued request (and, if paused, while paused) ends both
    (RequestCancelled, "abort", one finished call each), frees every slot, leaves no scheduler
    thread alive; the closed engine refuses submit and sample."""
    target, _ = models
    before = _scheduler_threads()
    engine = RolloutEngine(target, SpecConfig(method="ar"),  # fifo: the second request waits for a slot
                           EngineConfig(max_batch_size=2, max_model_len=MAX_LEN, admission="fifo"))
    params = SamplingParams(temperature=0.0, max_new_tokens=100, ignore_eos=True)
    gates = [Gate(lambda req: False), Gate(lambda req: False)]
    running = engine.submit([[5, 6], [7, 8]], params, listener=gates[0])
    queued = engine.submit([[9, 10]], params, listener=gates[1])  # no free slot: waits
    assert len(_scheduler_threads() - before) == 1
    _wait_until(lambda: running.num_tokens >= 6)
    if paused:
        engine.pause()
    engine.close()
    assert _scheduler_threads() == before
    for request, gate in zip((running, queued), gates):
        assert request.done()
        with pytest.raises(RequestCancelled):
            request.result(timeout=1)
        assert all(s.finish_reason == "abort" and s.slot == -1 for s in request.seqs)
        assert [f for f, _ in gate.calls].count(True) == 1 and gate.calls[-1][0]
    assert running.num_tokens < 200 and queued.num_tokens == 0
    assert engine.runner.cache.num_free == engine.runner.cache.num_slots
    with pytest.raises(RuntimeError, match="closed"):
        engine.submit([[5, 6]], params)
    with pytest.raises(RuntimeError, match="closed"):
        engine.sample([[5, 6]], params)
    engine.close()  # idempotent


def test_close_ends_an_inline_sample(models):
    """close() from another thread while `sample` drives the loop inline: the sample call raises
    RequestCancelled, its slots are freed, and no scheduler thread was ever started."""
    target, _ = models
    before = _scheduler_threads()
    engine = _engine(target)
    rounds = _record_rounds(engine)
    outcome = {}

    def call():
        try:
            outcome["result"] = engine.sample([[5, 6, 7]], SamplingParams(temperature=0.0, max_new_tokens=120,
                                                                          ignore_eos=True))
        except BaseException as err:  # noqa: BLE001 - the test inspects it
            outcome["error"] = err

    caller = threading.Thread(target=call)
    caller.start()
    _wait_until(lambda: len(rounds) >= 3)
    engine.close()
    caller.join(30)
    assert not caller.is_alive()
    assert isinstance(outcome.get("error"), RequestCancelled), outcome
    assert engine.runner.cache.num_free == engine.runner.cache.num_slots
    assert _scheduler_threads() == before


# ---- 5. stop strings ------------------------------------------------------------------------------

STOP_PROMPTS = ["Write digits:", "Tom has 3 apples.", "abc"]


def _stop_cut(rollout, stops, tok):
    """(m, s): the first m whose decoded token_ids[:m] contains a stop string, and the stop string that
    occurs first there; None if none ever does."""
    for m in range(1, len(rollout.token_ids) + 1):
        text = tok.decode(rollout.token_ids[:m], skip_special_tokens=True)
        hits = [x for x in stops if x in text]
        if hits:
            return m, min(hits, key=lambda x: (text.find(x), x))
    return None


def _record_lengths(engine) -> dict:
    """Wrap the strategy's step: per (prompt, sample), its token count after every round."""
    lengths: dict = {}
    step = engine.strategy.step

    def recording(running):
        emitted = step(running)
        for s in running:
            lengths.setdefault((s.prompt_index, s.sample_index), [1]).append(len(s.token_ids))
        return emitted

    engine.strategy.step = recording
    return lengths


def _inside_a_round(lengths: list[int], m: int) -> bool:
    """Whether token m was emitted together with later tokens in one round."""
    return any(a < m < b for a, b in zip(lengths, lengths[1:]))


@pytest.mark.parametrize("method", ["ar", "sd", "sd-self"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_stop_strings_cut_exactly(models, method, temperature):
    """A stop string taken from the unconstrained run of prompt 0 (completing inside a speculative
    run for SD) ends each rollout whose text contains it at exactly the token that completes it:
    token ids and logprobs are that prefix of the unconstrained run, finish "stop", text is the
    unconstrained text cut before it, extra["stop_string"] names it. With two stop strings the one
    that occurs first wins, whatever their order; rollouts without either are unchanged."""
    target, _ = models
    tok = target.tokenizer
    params = SamplingParams(n=1 if temperature == 0 else 2, temperature=temperature, max_new_tokens=40, seed=12)
    with _method_engine(models, method) as engine:
        lengths = _record_lengths(engine)
        free = engine.sample(STOP_PROMPTS, params)
        _ran(engine, method)
    with _engine(target) as ar:
        free_ar = ar.sample(STOP_PROMPTS, params)
    if temperature == 0:
        assert [r.token_ids for r in free] == [r.token_ids for r in free_ar]  # SD is lossless
    text0 = free[0].text
    assert len(free[0].token_ids) == 40  # (its text may be shorter: a sampled <pad> or <unk> decodes to "")

    def usable(i, size):
        s = text0[i:i + size]
        m = _stop_cut(free[0], [s], tok)[0]
        return text0.find(s) == i and (method == "ar" or _inside_a_round(lengths[0, 0], m))

    early_at = next(i for i in range(3, 20) if usable(i, 2))
    early = text0[early_at:early_at + 2]
    late_at = next(i for i in range(early_at + 4, 36) if text0.find(text0[i:i + 3]) == i)
    late = text0[late_at:late_at + 3]
    for stops in ((early,), (late, early)):
        with _method_engine(models, method) as engine:
            out = engine.sample(STOP_PROMPTS, dataclasses.replace(params, stop=stops))
        hits = 0
        for got, ref in zip(out, free):
            cut = _stop_cut(ref, stops, tok)
            if cut is None:
                _assert_same([got], [ref])
                continue
            m, s = cut
            hits += 1
            assert got.token_ids == ref.token_ids[:m] and got.finish_reason == "stop"
            assert got.extra == {"stop_string": s} and got.text == ref.text[:ref.text.find(s)]
            torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(ref.logprobs[:m]), rtol=0, atol=1e-5)
        assert out[0].extra["stop_string"] == early and out[0].text == text0[:early_at] and hits >= 1
        assert len(out[0].token_ids) == _stop_cut(free[0], [early], tok)[0] < 40


def test_stop_string_validation(models):
    """Stop strings need a tokenizer (ValueError naming SamplingParams.stop, nothing queued); an empty
    stop string or a non-string is rejected; a single string becomes a 1-tuple."""
    target, _ = models
    with _engine(dataclasses.replace(target, tokenizer=None)) as engine:
        for call in (engine.sample, engine.submit):
            with pytest.raises(ValueError, match=r"SamplingParams\.stop"):
                call([[5, 6, 7]], SamplingParams(stop=("ab",), max_new_tokens=4))
        assert engine.scheduler.counts() == {"running": 0, "waiting": 0, "requests": 0}
        (r,) = engine.sample([[5, 6, 7]], SamplingParams(max_new_tokens=4))  # still serves
        assert len(r.token_ids) <= 4
    for bad in ("", ("ab", ""), ("ab", 3), [""]):
        with pytest.raises(ValueError, match=r"SamplingParams\.stop"):
            SamplingParams(stop=bad)
    assert SamplingParams(stop="ab").stop == ("ab",)
    assert SamplingParams(stop=["ab", "c"]).stop == ("ab", "c")


# ---- 6. listeners ---------------------------------------------------------------------------------


def test_listener_progress_and_a_failing_listener(models, caplog):
    """A listener is called on the scheduler's thread after rounds that emitted tokens (finished=False,
    the token count growing) and exactly once with finished=True, last; a listener that raises every
    time is logged, keeps being called, and breaks neither its own request nor the others."""
    target, _ = models
    good_args = ([[5, 6, 7], [8]], SamplingParams(n=2, temperature=1.0, max_new_tokens=20, seed=21, ignore_eos=True))
    bad_args = ([[9, 10, 11]], SamplingParams(temperature=0.0, max_new_tokens=25))
    with _engine(target) as ref:
        good_alone, bad_alone = ref.sample(*good_args), ref.sample(*bad_args)
    calls, bad_calls = [], []
    finished = threading.Event()

    def listener(request, done):
        calls.append((done, request.num_tokens, threading.current_thread().name))
        if done:
            finished.set()

    def failing(request, done):
        bad_calls.append(done)
        raise RuntimeError("listener boom")

    with caplog.at_level(logging.ERROR, logger="rollout_ssd.request"), _engine(target) as engine:
        engine.pause()
        good = engine.submit(*good_args, listener=listener)
        bad = engine.submit(*bad_args, listener=failing)
        engine.resume()
        _assert_same(good.result(timeout=60), good_alone)
        _assert_same(bad.result(timeout=60), bad_alone)
        assert finished.wait(10)
        _wait_until(lambda: True in bad_calls, timeout=10)
        time.sleep(0.05)
        _assert_idle(engine)
    assert [done for done, _, _ in calls].count(True) == 1 and calls[-1][0]
    progress = [n for done, n, _ in calls if not done]
    assert len(progress) >= 10 and progress == sorted(set(progress)), "one call per round that emitted tokens"
    assert calls[-1][1] == good.num_tokens == 4 * 20
    assert {name for _, _, name in calls} == {THREAD}
    assert bad_calls.count(True) == 1 and bad_calls[-1] and bad_calls.count(False) >= 5
    assert any("listener failed" in r.getMessage() and r.exc_info for r in caplog.records)
