"""SSD's draft side on its own thread (ssd/thread_client.py), the concurrent draft side on GPU machines.
On a CPU the engine would start a worker process instead; these tests route `worker=True` to the
thread (`concurrent_draft_side`) so the thread's logic runs here: the same exact outputs as the draft
side in process, failures that fall back like a dead worker's, weights copied into its own model."""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from rollout_ssd import SamplingParams
from rollout_ssd.ssd import draft_side
from rollout_ssd.ssd.draft_server import DraftServer, weights_digest
from rollout_ssd.ssd.thread_client import ThreadDraftClient
from tests.support.models import tiny_pair
from tests.support.ran import assert_ran
from tests.test_ssd_helpers import ar_engine, ssd_engine

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16], [3, 3, 3, 3]]
GREEDY = SamplingParams(temperature=0, max_new_tokens=16, n=2, ignore_eos=True)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_pair(tmp_path_factory.mktemp("ssdt"), vocab=48)


@pytest.fixture
def threaded(monkeypatch):
    monkeypatch.setattr(draft_side, "concurrent_draft_side", lambda device: "thread")


def _draft_threads() -> list:
    return [t for t in threading.enumerate() if t.name == "rollout-ssd-draft-side"]


def test_thread_draft_side_is_exact_and_leaves_no_thread(pair, threaded):
    want = [r.token_ids for r in ar_engine(pair[0], 3).sample(PROMPTS, GREEDY)]
    engine = ssd_engine(*pair, batch=3, k=3, fanout=(1, 1, 1, 2), worker=True)
    assert isinstance(engine.strategy.client, ThreadDraftClient)
    assert [r.token_ids for r in engine.sample(PROMPTS, GREEDY)] == want
    m = assert_ran(engine, "ssd", hits=True)  # the thread served SSD rounds (worker= reads a process only)
    assert m["ssd/worker_failures"] == 0
    params = SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=16, n=3, seed=4, ignore_eos=True)
    got = [r.token_ids for r in engine.sample(PROMPTS, params)]
    engine.close()
    assert _draft_threads() == []
    local = ssd_engine(*pair, batch=3, k=3, fanout=(1, 1, 1, 2))  # in process, synchronous
    assert [r.token_ids for r in local.sample(PROMPTS, params)] == got  # counter-based draws: same samples
    local.close()


def _samples_exactly_through_one_failure(engine, want, match: str) -> None:
    """The engine's greedy rollouts equal `want` although its draft side fails once (warned as `match`,
    counted once); then it is closed."""
    with pytest.warns(RuntimeWarning, match=match):
        out = engine.sample(PROMPTS, GREEDY)
    assert [r.token_ids for r in out] == want
    m = assert_ran(engine, "ssd", hits=True)  # the draft thread served SSD rounds before it failed
    assert m["ssd/worker_failures"] == 1
    engine.close()


def test_a_failing_draft_thread_falls_back_exactly(pair, threaded, monkeypatch):
    want = [r.token_ids for r in ar_engine(pair[0], 3).sample(PROMPTS, GREEDY)]
    engine = ssd_engine(*pair, batch=3, k=3, fanout=(1, 1, 1, 2), worker=True, max_restarts=0)
    server = engine.strategy.client.server
    calls = [0]
    build = server.build

    def failing(msg):
        calls[0] += 1
        if calls[0] == 4:
            raise RuntimeError("injected")
        return build(msg)

    monkeypatch.setattr(server, "build", failing)
    _samples_exactly_through_one_failure(engine, want, "draft worker failed")
    assert _draft_threads() == []


def test_update_weights_copies_into_the_threads_own_model(pair):
    _, draft = pair
    own = copy.deepcopy(draft.model)
    client = ThreadDraftClient(DraftServer(own, num_slots=2, max_model_len=64, k=3, max_branches=8))
    try:
        new = {n: t + 0.5 for n, t in draft.model.hf_parameters().items() if t.dtype.is_floating_point}
        client.update_weights(new, {}, draft_version=3)
        params = own.hf_parameters()
        assert all(torch.equal(params[n], t) for n, t in new.items())
        reply = client.digest()
        assert reply.draft_version == 3 and reply.digest == weights_digest(params)
        with pytest.raises(RuntimeError, match="no tensor 'nope'"):
            client.update_weights({"nope": torch.zeros(1)}, {}, draft_version=4)
    finally:
        client.close()
    assert _draft_threads() == []


def _with(q, value):
    q = q.clone()
    q.view(-1)[q.numel() // 2] = value
    return q


@pytest.mark.parametrize("spoil", [lambda q: -q, lambda q: _with(q, float("nan")), lambda q: _with(q, float("inf"))],
                         ids=["negative", "nan", "inf"])
def test_a_reply_with_an_invalid_q_is_refused_and_the_rollouts_stay_exact(pair, threaded, monkeypatch, spoil):
    """The target side does not trust the draft side's q (the verification's exactness rests on it): a
    negative mass, a NaN or an Inf in one chain's q is a draft-side failure, checked for all rows in one
    host read."""
    import dataclasses

    want = [r.token_ids for r in ar_engine(pair[0], 3).sample(PROMPTS, GREEDY)]
    engine = ssd_engine(*pair, batch=3, k=3, fanout=(1, 1, 1, 2), worker=True, max_restarts=0)
    server = engine.strategy.client.server
    resolve, calls = server.resolve, [0]

    def corrupt(msg):
        reply = resolve(msg)
        calls[0] += 1
        rows = list(reply.rows)
        for j, row in enumerate(rows):
            if calls[0] >= 3 and row.tokens:
                rows[j] = dataclasses.replace(row, q=spoil(row.q))
                break
        return dataclasses.replace(reply, rows=tuple(rows))

    monkeypatch.setattr(server, "resolve", corrupt)
    _samples_exactly_through_one_failure(engine, want, "invalid q")


def test_the_draft_thread_handles_no_message_while_a_cuda_graph_is_captured(pair):
    """A CUDA graph captured while another thread runs CUDA work is invalidated, and a draw from that
    thread meanwhile leaves the process's CUDA generator unusable (seen on an H200: SSD with cuda_graphs
    failed its first verify capture). The draft thread therefore handles each message under
    CUDA_CAPTURE_LOCK, which `StaticStep.capture` holds: a message sent during a capture waits for it."""
    from rollout_ssd.gpu.devices import CUDA_CAPTURE_LOCK

    _, draft = pair
    client = ThreadDraftClient(DraftServer(copy.deepcopy(draft.model), num_slots=2, max_model_len=64, k=3,
                                           max_branches=8), timeout=0.5)
    try:
        with CUDA_CAPTURE_LOCK:  # as a capture holds it
            from rollout_ssd.ssd.client import WorkerFailure

            with pytest.raises(WorkerFailure, match="no answer"):
                client.digest()  # not handled while the lock is held
        reply = client._replies.get(timeout=5)  # handled once the capture is over
        assert reply.digest == weights_digest(client.server.model.hf_parameters())
        assert client.digest().digest == reply.digest
    finally:
        client.close()
    assert _draft_threads() == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_ssd_with_cuda_graphs_and_the_draft_thread_is_exact_on_cuda(threaded, recwarn, tmp_path):
    """SSD on a GPU: the draft thread builds trees while the target captures and replays its graphed
    decode and verify steps; greedy tokens equal AR's and the draft thread never fails."""
    from rollout_ssd import EngineConfig, RolloutEngine, SpecConfig

    target, draft = tiny_pair(tmp_path, vocab=48)  # the same pair, on the GPU
    target.model.to("cuda")
    draft.model.to("cuda")
    config = EngineConfig(max_batch_size=3, max_model_len=64, cuda_graphs=True)
    ar = RolloutEngine(target, SpecConfig(method="ar"), config)  # AR on the same GPU, backend and steps
    want = [r.token_ids for r in ar.sample(PROMPTS, GREEDY)]
    ar.close()
    spec = SpecConfig(method="ssd", k=3, worker=True, strategy_rule=False, fanout=(1, 1, 1, 2))
    engine = RolloutEngine(target, spec, config, draft=draft)
    try:
        got = [r.token_ids for r in engine.sample(PROMPTS, GREEDY)]
        assert isinstance(engine.strategy.client, ThreadDraftClient)
        assert assert_ran(engine, "ssd", hits=True)["ssd/worker_failures"] == 0
        assert len(engine.runner.static.steps) > 0
    finally:
        engine.close()
    assert got == want
    assert not [w for w in recwarn if "draft worker failed" in str(w.message)]
