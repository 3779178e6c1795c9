"""`rollout-ssd serve` under hostile load: the limits (serve/limits.py) refuse what is above them with a
400 naming the field or, for a full queue, 429 with Retry-After; no input is a 500; SIGTERM drains (503
for new requests, running ones finish) and the process exits with nothing left behind. The checks of
limits.py are unit-tested first (fast); the rest runs real servers (slow)."""

from __future__ import annotations

import json
import signal
import threading
import time

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from rollout_ssd.serve.limits import MAX_JSON_DEPTH, Limits, check_queue, max_tokens_for, parse_body  # noqa: E402
from rollout_ssd.serve.protocol import BadRequest  # noqa: E402
from tests.support.ran import assert_ran, served  # noqa: E402
from tests.test_serve import Served  # noqa: E402


def _param(fn, *args) -> tuple[int, str]:
    with pytest.raises(BadRequest) as err:
        fn(*args)
    return err.value.status, err.value.param


def test_body_rules():
    assert parse_body(b'{"a": [1, 2.5, "x"]}') == {"a": [1, 2.5, "x"]}
    assert _param(parse_body, b'{"prompt": "\\ud800"}') == (400, "prompt")  # valid JSON, not encodable
    assert _param(parse_body, b'{"stop": ["ok", "\\udfff"]}') == (400, "stop")
    assert _param(parse_body, b'{"\\ud800": 1}') == (400, "body")
    assert _param(parse_body, b'{"temperature": NaN}') == (400, "body")
    assert _param(parse_body, b'{"temperature": 1e400}') == (400, "body")
    assert _param(parse_body, b"\xff\xfe{") == (400, "body")
    assert _param(parse_body, b"[" * 100000) == (400, "body")  # deeper than the interpreter's recursion
    nested = b'{"chat_template_kwargs": ' + b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1) + b"}"
    assert _param(parse_body, nested) == (400, "chat_template_kwargs")


def test_context_rule_and_queue():
    assert max_tokens_for([10, 20], None, 16, 64, clamp=False) == 16
    assert max_tokens_for([10, 60], None, 16, 64, clamp=False) == 4  # an omitted max_tokens is cut to fit
    assert max_tokens_for([10, 20], 44, 16, 64, clamp=False) == 44
    assert _param(max_tokens_for, [10, 20], 45, 16, 64, False) == (400, "max_tokens")
    assert max_tokens_for([10, 20], 10 ** 9, 16, 64, clamp=True) == 44
    limits = Limits(max_queued_seqs=8)
    check_queue(4, 4, 4, limits)
    assert _param(check_queue, 5, 4, 4, limits) == (429, None)
    assert _param(check_queue, 0, 9, 9, limits) == (400, "n")
    assert _param(check_queue, 0, 9, 1, limits) == (400, "prompt")
    with pytest.raises(ValueError, match="--max-n"):
        Limits(max_n=0)


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    from rollout_ssd.rl.tasks import ALPHABET
    from rollout_ssd.rl.tiny import build_tiny_pair

    return build_tiny_pair(tmp_path_factory.mktemp("limits_tiny"), ALPHABET)


@pytest.fixture(scope="module")
def sd_server(tiny_pair):
    target, draft = tiny_pair
    server = Served("--target", str(target), "--draft", str(draft), "--method", "sd", "--k", "3",
                    "--max-model-len", "64", "--max-batch-size", "2", "--max-queued-seqs", "6",
                    "--max-body-bytes", "65536")
    yield server
    server.close()


HOSTILE = [  # (body or raw bytes, the field the 400 names)
    ({"prompt": "hi", "n": 100000, "max_tokens": 4}, "n"),
    (b'{"prompt": "\\ud800", "max_tokens": 4}', "prompt"),
    ({"prompt": "hi", "max_tokens": 1000000000}, "max_tokens"),
    ({"prompt": "hi", "seed": -5}, "seed"),
    ({"prompt": "hi", "seed": 2 ** 70}, "seed"),
    (b'{"prompt": "hi", "temperature": NaN}', "body"),
    (b'{"prompt": "hi", "top_p": 1e999}', "body"),
    ({"prompt": "hi", "temperature": 1e-30}, "temperature"),
    ({"prompt": "hi", "top_p": 1e-30}, "top_p"),
    ({"prompt": "hi", "top_k": 10 ** 30}, "top_k"),
    ({"prompt": "hi", "n": "3"}, "n"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": "hi", "stop": [1]}, "stop"),
    ({"prompt": "hi", "user": "\udfff"}, "user"),
    ({"prompt": ["a"] * 7}, "prompt"),  # 7 sequences: more than the queue of 6 can ever hold
    (b"[" * 50000, "body"),
    ({"prompt": "x" * 70000}, "body"),  # over --max-body-bytes
    ({"prompt": "hi", "max_tokens": None, "logprobs": 10 ** 40}, "logprobs"),
]


@pytest.mark.slow
def test_hostile_requests_get_400_naming_the_field(sd_server):
    for body, param in HOSTILE:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        resp = sd_server.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert resp.status_code == 400, (body if isinstance(body, dict) else body[:40], resp.text)
        assert resp.json()["error"]["param"] == param, (body if isinstance(body, dict) else body[:40], resp.text)
        if isinstance(body, dict) and body.get("n") == 100000:
            assert "--max-n" in resp.json()["error"]["message"]  # the n limit, not only the queue's
    chat = sd_server.post("/v1/chat/completions", content=b'{"messages": [{"role": "user", "content": "\\ud800"}]}')
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages"
    info = sd_server.http.get("/server_info").json()
    assert info["limits"]["max_n"] == 128 and info["limits"]["max_queued_seqs"] == 6
    assert info["admission"] == {"policy": "fair", "reserved_slots": 1, "kv_slots": 2, "max_round_rows": None}
    before = sd_server.metrics()
    ok = sd_server.post("/v1/completions", {"prompt": "hi", "max_tokens": 60, "temperature": 0})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] <= 60  # 2 + 60 <= 64 fits
    assert_ran(served(before, sd_server.metrics()), "sd")  # the server that refused the rest speculates


@pytest.mark.slow
def test_full_queue_is_429_with_retry_after(sd_server):
    """Paused, three requests of 2 sequences fill the queue of 6: the next gets 429 with Retry-After;
    after resume all three finish and the retry is served."""
    # ran-check: the queue's refusal is what is tested; the SD path is checked in the test above
    results = []

    def send():
        results.append(sd_server.post("/v1/completions", {"prompt": "hi", "n": 2, "max_tokens": 3}))

    assert sd_server.post("/pause").status_code == 200
    threads = [threading.Thread(target=send) for _ in range(3)]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while sd_server.metrics()["vllm:num_requests_waiting"] < 6 and time.monotonic() < deadline:
            time.sleep(0.02)
        busy = sd_server.post("/v1/completions", {"prompt": "hi", "max_tokens": 3})
        assert busy.status_code == 429 and busy.headers["retry-after"] == "1", busy.text
        assert busy.json()["error"]["type"] == "rate_limit_error"
    finally:
        sd_server.post("/resume")
        for t in threads:
            t.join(60)
    assert [r.status_code for r in results] == [200] * 3
    assert sd_server.post("/v1/completions", {"prompt": "hi", "max_tokens": 3}).status_code == 200


@pytest.mark.slow
def test_a_small_request_is_not_queued_behind_a_large_one(sd_server):
    """The issue's head-of-line case at the largest request this server queues: 6 sequences of 60 tokens on 2
    KV slots (one reserved for newcomers). A one-line greedy request sent meanwhile is answered while the
    large one still runs (under fifo it would wait for all 6 sequences to have had a slot)."""
    big, before = {}, sd_server.metrics()
    thread = threading.Thread(target=lambda: big.update(r=sd_server.post("/v1/completions", {
        "prompt": "hi", "n": 6, "max_tokens": 60, "ignore_eos": True, "temperature": 1.0})))
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while sd_server.metrics()["vllm:num_requests_running"] < 1 and time.monotonic() < deadline:
            time.sleep(0.005)
        small = sd_server.post("/v1/completions", {"prompt": "hi", "max_tokens": 4, "temperature": 0})
        assert small.status_code == 200 and thread.is_alive()
    finally:
        thread.join(120)
    assert big["r"].status_code == 200 and len(big["r"].json()["choices"]) == 6
    assert_ran(served(before, sd_server.metrics()), "sd")


def _children(pid: int) -> list:
    psutil = pytest.importorskip("psutil")
    return psutil.Process(pid).children(recursive=True)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ar", "ssd"])
def test_sigterm_drains_then_exits(tiny_pair, method):
    """SIGTERM while a request streams: a new request gets 503, the running one finishes with all its
    tokens, then the process exits 0 and leaves no process behind (SSD: its draft worker)."""
    target, draft = tiny_pair
    extra = ["--draft", str(draft)] if method == "ssd" else []
    server = Served("--target", str(target), "--method", method, *extra, "--max-model-len", "256")
    try:
        children = _children(server.proc.pid)
        body = {"prompt": "hi", "n": 16, "max_tokens": 250, "ignore_eos": True, "stream": True, "return_token_ids": True}
        tokens = [0] * 16
        refused = None
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as resp:
            for line in resp.iter_lines():
                if not line.startswith("data: {"):
                    continue
                for choice in json.loads(line[6:])["choices"]:
                    tokens[choice["index"]] += len(choice.get("token_ids") or [])
                if refused is None:  # the request runs: stop the server now
                    server.proc.send_signal(signal.SIGTERM)
                    deadline = time.monotonic() + 10
                    while server.http.get("/health").status_code != 503 and time.monotonic() < deadline:
                        time.sleep(0.01)  # until the signal handler has run
                    refused = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                                         timeout=30)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert tokens == [250] * 16  # not cut: it finished within the drain timeout
        assert server.proc.wait(60) == 0
        assert not [p for p in children if p.is_running() and p.status() != "zombie"]
    finally:
        server.close()
