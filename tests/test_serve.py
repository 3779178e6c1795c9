"""`rollout-ssd serve` with real clients (the unchanged `openai` SDK, httpx, TRL's async-GRPO client) on
loopback: outputs equal `RolloutEngine.sample` token for token, concurrency, disconnects, bad input,
metrics, weight updates. Every server runs in a subprocess that the fixture always terminates."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from rollout_ssd import RolloutEngine, SamplingParams, SpecConfig  # noqa: E402
from rollout_ssd.rl.tasks import ALPHABET  # noqa: E402
from rollout_ssd.rl.tiny import build_tiny_pair  # noqa: E402
from tests.support.ran import assert_ran, served  # noqa: E402

pytestmark = pytest.mark.slow
PROMPTS = ["What is 12+7?", "Tom has 3 apples.", "x"]


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    return build_tiny_pair(tmp_path_factory.mktemp("serve_tiny"), ALPHABET)


class Served:
    def __init__(self, *args: str, env=None):
        cmd = [sys.executable, "-m", "rollout_ssd.cli", "serve", "--port", "0", "--dtype", "float32", "--threads", "1",
               *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, **(env or {})})
        self.url, lines, deadline = None, [], time.monotonic() + 120
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "listening on " in line:
                self.url = line.split("listening on ", 1)[1].strip()
                break
        if self.url is None:
            self.close()
            raise RuntimeError("server did not start:\n" + "".join(lines))
        self.log = lines
        threading.Thread(target=lambda: lines.extend(self.proc.stdout), daemon=True).start()  # drain the pipe
        self.http = httpx.Client(base_url=self.url, timeout=60)

    def client(self, **kw):
        return openai.OpenAI(base_url=self.url + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0, **kw)

    def post(self, path, body=None, content=None, **kw):
        return self.http.post(path, json=body, content=content, **kw)

    def metrics(self) -> dict:
        from prometheus_client.parser import text_string_to_metric_families

        out = {}
        for family in text_string_to_metric_families(self.http.get("/metrics").text):
            for sample in family.samples:
                key = sample.name + (json.dumps(sample.labels, sort_keys=True) if sample.labels else "")
                out[key] = sample.value
        return out

    def close(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def sd_server(tiny_pair):
    target, draft = tiny_pair
    server = Served("--target", str(target), "--draft", str(draft), "--method", "sd", "--k", "3",
                    "--served-model-name", "tiny")
    yield server
    server.close()


@pytest.fixture(scope="module")
def sd_engine(tiny_pair):
    target, draft = tiny_pair
    with RolloutEngine.from_pretrained(str(target), draft=str(draft), spec=SpecConfig(method="sd", k=3),
                                       dtype="float32") as engine:
        yield engine


def _ids(engine, prompts):
    return [engine.target.tokenizer(p).input_ids for p in prompts]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_openai_completions_equal_engine_sample(sd_server, sd_engine, temperature):
    ids = _ids(sd_engine, PROMPTS)
    before = sd_server.metrics()
    out = sd_server.client().completions.create(
        model="tiny", prompt=ids, n=3, max_tokens=12, temperature=temperature, logprobs=0, seed=5,
        extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True, "top_k": 0})
    ref = sd_engine.sample(ids, SamplingParams(n=3, temperature=temperature, max_new_tokens=12, seed=5))
    assert_ran(served(before, sd_server.metrics()), "spec", accepted=True)  # the server's SD rounds
    assert len(out.choices) == len(ref) == 9
    for choice, r in zip(out.choices, ref, strict=True):  # prompt-major, like vLLM
        extra = choice.model_extra
        assert extra["token_ids"] == r.token_ids and extra["prompt_token_ids"] == r.prompt_token_ids
        assert choice.logprobs.token_logprobs == r.logprobs  # bitwise: JSON floats round-trip exactly
        assert choice.logprobs.tokens == [f"token_id:{t}" for t in r.token_ids]
        assert choice.text == r.text and choice.finish_reason == r.finish_reason
        assert extra["weight_version"] == 0
    assert out.usage.completion_tokens == sum(len(r.token_ids) for r in ref)


def test_text_prompt_stop_string_and_streaming(sd_server, sd_engine):
    client, before = sd_server.client(), sd_server.metrics()
    full = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=20, temperature=0)
    text = full.choices[0].text
    assert len(text) >= 6
    stop = text[3:5]
    cut = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=20, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == text[:text.find(stop)]
    assert cut.choices[0].model_extra["stop_reason"] == stop
    stream = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=20, temperature=0, stream=True,
                                       extra_body={"return_token_ids": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == text
    streamed_ids = [t for c in chunks for t in c.choices[0].model_extra.get("token_ids", [])]
    assert streamed_ids == sd_engine.sample([PROMPTS[0]], SamplingParams(temperature=0, max_new_tokens=20))[0].token_ids
    assert chunks[-1].choices[0].finish_reason == "length"
    assert_ran(served(before, sd_server.metrics()), "spec")


def test_streamed_stop_strings_never_leak_while_siblings_run(sd_server):
    """n samples with a stop string: a sample that stops while its siblings still run must stream
    exactly its non-streamed text (cut before the stop string), never a piece of the stop string."""
    client, before = sd_server.client(), sd_server.metrics()
    body = dict(model="tiny", prompt=PROMPTS[1], n=6, max_tokens=24, temperature=1.0, seed=11)
    free = [c.text for c in client.completions.create(**body).choices]
    # a character some samples hold early and others not at all, so samples end at different rounds
    stop = next(ch for ch in sorted(set("".join(t[:8] for t in free))) if 0 < sum(ch in t for t in free) < len(free))
    cut = client.completions.create(**body, stop=[stop]).choices
    assert {c.finish_reason for c in cut} == {"stop", "length"}
    streamed = [""] * len(cut)
    for chunk in client.completions.create(**body, stop=[stop], stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == [c.text for c in cut] == [t[:t.find(stop)] if stop in t else t for t in free]
    assert_ran(served(before, sd_server.metrics()), "spec")  # stops landed inside SD rounds' runs


def test_bad_requests_are_400_naming_the_field(sd_server):
    # ran-check: request validation is tested; the one good request only shows the server still answers
    cases = [
        (None, b"{not json", "body"),
        ({"model": "other", "prompt": "x"}, None, "model"),
        ({"prompt": "x", "max_tokens": -3}, None, "max_tokens"),
        ({"prompt": "x" * 400, "max_tokens": 4}, None, "prompt"),
        ({"prompt": "x", "frobnicate": 1}, None, "frobnicate"),
        ({"prompt": "x", "temperature": -1}, None, "temperature"),
        ({"prompt": "x", "min_p": 0.1}, None, "min_p"),
        ({"prompt": "x", "logprobs": 3}, None, "logprobs"),
        ({"prompt": [[1, 2], [10 ** 9]]}, None, "prompt"),
        ({"max_tokens": 3}, None, "prompt"),
    ]
    for body, content, param in cases:
        resp = sd_server.post("/v1/completions", body, content=content)
        assert resp.status_code == 400, (body, resp.text)
        assert resp.json()["error"]["param"] == param, (body, resp.text)
    resp = sd_server.post("/v1/chat/completions", {"messages": [], "model": "tiny"})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages"
    resp = sd_server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages"  # the tiny model has no template
    ok = sd_server.post("/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 1


def test_sixteen_concurrent_clients_equal_alone(sd_server, sd_engine):
    ids = _ids(sd_engine, ["1+1=", "Ann has 4 pens", "a", "What is 9*9?"])
    jobs = [(ids[i % 4], 4 + 3 * (i % 5), 0.0 if i % 2 else 1.0, i) for i in range(16)]
    results = [None] * len(jobs)

    def run(i):
        prompt, max_tokens, temperature, seed = jobs[i]
        results[i] = sd_server.post("/v1/completions", {
            "prompt": prompt, "n": 2, "max_tokens": max_tokens, "temperature": temperature, "seed": seed,
            "logprobs": 0, "return_token_ids": True}).json()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    before = sd_server.metrics()
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert_ran(served(before, sd_server.metrics()), "spec", accepted=True)
    for (prompt, max_tokens, temperature, seed), body in zip(jobs, results, strict=True):
        ref = sd_engine.sample([prompt], SamplingParams(n=2, max_new_tokens=max_tokens, temperature=temperature,
                                                        seed=seed))
        # Tokens exactly. Rows batched with other requests may round differently in float32 (GEMM row
        # padding, reduction order), so logprobs agree to float32 rounding, not bitwise; a sampled token
        # could flip only if its uniform fell within ~1e-6 of a CDF boundary (odds < 1e-3 over this test).
        assert [c["token_ids"] for c in body["choices"]] == [r.token_ids for r in ref]
        for choice, r in zip(body["choices"], ref, strict=True):
            torch.testing.assert_close(torch.tensor(choice["logprobs"]["token_logprobs"]), torch.tensor(r.logprobs),
                                       rtol=0, atol=1e-5)
    m = sd_server.metrics()
    assert m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0


@pytest.mark.parametrize("stream", [False, True])
def test_disconnect_frees_the_slot_and_others_are_unharmed(sd_server, sd_engine, stream):
    """A client that gives up mid-request: once its 16 sequences hold slots the server is paused (so
    the request cannot finish first), the client times out and closes its connection, and the
    request's slots are freed while still paused; after resume the server serves others unharmed."""
    key = 'rollout_ssd:requests_total{"outcome": "aborted"}'
    before = sd_server.metrics()
    outcome = {}

    def give_up():
        try:
            with httpx.stream("POST", sd_server.url + "/v1/completions", timeout=2.0, json={
                    "prompt": "a", "n": 16, "max_tokens": 240, "ignore_eos": True, "temperature": 1.0,
                    "stream": stream}) as resp:
                for _ in resp.iter_bytes():
                    pass
        except httpx.ReadTimeout:
            outcome["timed_out"] = True

    client = threading.Thread(target=give_up)
    client.start()
    try:
        deadline = time.monotonic() + 30
        while sd_server.metrics()["vllm:num_requests_running"] < 16 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert sd_server.post("/pause").status_code == 200
        assert sd_server.metrics()["vllm:num_requests_running"] == 16  # paused mid-request, slots held
        client.join(30)
        assert outcome.get("timed_out")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            m = sd_server.metrics()
            if m[key] - before[key] == 1 and m["vllm:num_requests_running"] == 0:
                break
            time.sleep(0.05)
        assert m[key] - before[key] == 1 and m["vllm:num_requests_running"] == 0  # freed while paused
    finally:
        sd_server.post("/resume")
    other = sd_server.post("/v1/completions", {"prompt": "a", "max_tokens": 6, "temperature": 0, "return_token_ids": True})
    ref = sd_engine.sample(["a"], SamplingParams(temperature=0, max_new_tokens=6))[0]
    assert other.json()["choices"][0]["token_ids"] == ref.token_ids
    m = sd_server.metrics()
    assert_ran(served(before, m), "spec")  # the aborted request and the next ran SD rounds
    # generation tokens counted for the aborted request are fewer than it asked for
    assert m["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] < 16 * 240


def test_metrics_use_vllm_names_and_match_engine_counters(tiny_pair):
    target, draft = tiny_pair
    server = Served("--target", str(target), "--draft", str(draft), "--method", "sd", "--k", "3")
    try:
        body = {"prompt": "What is 12+7?", "n": 2, "max_tokens": 16, "temperature": 0}
        assert server.post("/v1/completions", body).status_code == 200
        m = server.metrics()
    finally:
        server.close()
    with RolloutEngine.from_pretrained(str(target), draft=str(draft), spec=SpecConfig(method="sd", k=3),
                                       dtype="float32") as engine:
        engine.sample(["What is 12+7?"], SamplingParams(n=2, max_new_tokens=16, temperature=0))
        ref = assert_ran(engine, "spec", accepted=True)
        stats = engine.stats
    assert_ran(served({}, m), "spec", accepted=True)
    assert m["vllm:spec_decode_num_draft_tokens_total"] == stats.proposed > 0
    assert m["vllm:spec_decode_num_accepted_tokens_total"] == stats.accepted
    assert m["vllm:spec_decode_num_drafts_total"] == stats.spec_rounds
    per_pos = sum(v for k, v in m.items() if k.startswith("vllm:spec_decode_num_accepted_tokens_per_pos_total"))
    assert per_pos == stats.accepted
    ratio = m["vllm:spec_decode_num_accepted_tokens_total"] / m["vllm:spec_decode_num_draft_tokens_total"]
    assert ratio == pytest.approx(ref["spec/accepted_per_proposed"], rel=1e-12)
    assert m['rollout_ssd:strategy_info{"method": "sd", "strategy": "sd"}'] == 1


def test_weights_from_disk_and_over_gloo(tiny_pair, tmp_path):
    """/update_weights_from_disk and the weight-sync group (/init_weight_transfer_engine + a learner's
    WeightSender over gloo): /weight_info and each choice's weight_version advance, and greedy outputs
    equal an in-process engine holding the same weights."""
    from safetensors.torch import save_file

    target, _ = tiny_pair
    server = Served("--target", str(target), "--method", "ar")
    try:
        with RolloutEngine.from_pretrained(str(target), dtype="float32") as engine:
            params = engine.target.model.hf_parameters()
            torch.manual_seed(0)
            new = {k: (v + 0.05 * torch.randn_like(v)).contiguous() for k, v in params.items()}
            (tmp_path / "ckpt").mkdir()
            save_file(new, str(tmp_path / "ckpt" / "model.safetensors"))
            body = {"prompt": "What is 12+7?", "max_tokens": 12, "temperature": 0, "return_token_ids": True}
            before = server.post("/v1/completions", body).json()["choices"][0]
            resp = server.post("/update_weights_from_disk", {"model_path": str(tmp_path / "ckpt")})
            assert resp.status_code == 200 and resp.json()["weight_version"] == 1
            assert server.http.get("/weight_info").json() == {"weight_version": 1}
            after = server.post("/v1/completions", body).json()["choices"][0]
            engine.update_weights(new.items(), version=1)
            ref = engine.sample(["What is 12+7?"], SamplingParams(temperature=0, max_new_tokens=12))[0]
            assert after["weight_version"] == 1 and after["token_ids"] == ref.token_ids != before["token_ids"]
            bad = server.post("/update_weights_from_disk", {"model_path": str(tmp_path / "missing")})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "model_path"

            # version 2 over gloo from a learner process
            init = f"file://{tmp_path / 'rendezvous'}"
            learner = subprocess.Popen([sys.executable, "-c", _LEARNER, init, str(tmp_path / "ckpt"), "2"],
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            try:
                resp = server.post("/init_weight_transfer_engine", {"init_info": {
                    "init_method": init, "rank_offset": 1, "world_size": 2, "timeout": 60}})
                assert resp.status_code == 200, resp.text
                out, _ = learner.communicate(timeout=120)
                assert learner.returncode == 0, out + "".join(server.log)
            finally:
                if learner.poll() is None:
                    learner.kill()
            deadline = time.monotonic() + 30
            while server.http.get("/weight_info").json()["weight_version"] != 2 and time.monotonic() < deadline:
                time.sleep(0.1)
            scaled = {k: v * 1.1 for k, v in new.items()}
            engine.update_weights(scaled.items(), version=2)
            ref = engine.sample(["What is 12+7?"], SamplingParams(temperature=0, max_new_tokens=12))[0]
            synced = server.post("/v1/completions", body).json()["choices"][0]
            assert synced["weight_version"] == 2 and synced["token_ids"] == ref.token_ids
    finally:
        server.close()


_LEARNER = """
import sys, torch, torch.distributed as dist, os
from safetensors.torch import load_file
from rollout_ssd.weight_sync import DistributedTransport, SenderConfig, WeightSender
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
dist.init_process_group("gloo", init_method=sys.argv[1], rank=0, world_size=2)
state = load_file(sys.argv[2] + "/model.safetensors")
sender = WeightSender(DistributedTransport(src=0, timeout=60), SenderConfig(dtype=torch.float32))
stats = sender.sync(((k, v * 1.1) for k, v in state.items()),
                    int(sys.argv[3]), timeout=60)
assert stats.acknowledged, stats
dist.destroy_process_group()
"""


def test_api_key_pause_resume_and_trl_async_client(tiny_pair):
    target, _ = tiny_pair
    server = Served("--target", str(target), "--method", "ar", "--api-key", "sekret")
    try:
        assert server.http.get("/health").status_code == 200  # health stays open
        denied = server.post("/v1/completions", {"prompt": "x"})
        assert denied.status_code == 401
        out = server.client(api_key="sekret").completions.create(model=str(target), prompt="x", max_tokens=3)
        assert len(out.choices) == 1
        vllm_client = pytest.importorskip("trl.experimental.async_grpo.vllm_client")
        import requests
        from accelerate import PartialState

        PartialState()  # TRL's client logs through accelerate, which its trainer has set up by then

        headers = {"Authorization": "Bearer sekret"}
        original = requests.Session.request

        def with_key(self, method, url, **kw):
            kw["headers"] = {**headers, **(kw.get("headers") or {})}
            return original(self, method, url, **kw)

        requests.Session.request = with_key  # TRL's client sends no key; add it for this server
        try:
            client = vllm_client.VLLMClient(server.url, server_timeout=30)
            client.wait_for_server_ready(poll_interval_s=0.1)
            assert client.get_max_model_len() == 256
            assert client.get_dtype() == "torch.float32"
            assert client.get_world_size() == 1
            client.pause()
            result = {}
            thread = threading.Thread(target=lambda: result.update(r=server.post(
                "/v1/completions", {"prompt": "x", "max_tokens": 4}, headers=headers)))
            thread.start()
            time.sleep(0.6)
            assert "r" not in result  # paused: no round ran
            assert server.http.get("/is_paused", headers=headers).json() == {"is_paused": True}
            client.resume()
            thread.join(30)
            assert result["r"].status_code == 200 and len(result["r"].json()["choices"]) == 1
        finally:
            requests.Session.request = original
    finally:
        server.close()


def test_threads_and_memory_flat_over_200_requests(sd_server):
    psutil = pytest.importorskip("psutil")
    proc = psutil.Process(sd_server.proc.pid)
    body = {"prompt": "What is 2+2?", "max_tokens": 4, "temperature": 1.0}
    for _ in range(20):
        assert sd_server.post("/v1/completions", body).status_code == 200
    threads, rss, before = proc.num_threads(), proc.memory_info().rss, sd_server.metrics()
    for i in range(200):
        resp = sd_server.post("/v1/completions", {**body, "seed": i, "stream": i % 4 == 0})
        assert resp.status_code == 200
    assert_ran(served(before, sd_server.metrics()), "spec")  # the requests ran SD rounds
    assert proc.num_threads() <= threads + 2
    assert proc.memory_info().rss - rss < 64 * 2 ** 20  # a leak of one rollout per request would still be
    # far below this; it catches per-request growth of engines, threads' stacks or cached responses


def test_chat_on_the_default_model_equals_engine_sample():
    server = Served("--target", "smollm2-135m-instruct", "--method", "ar")
    try:
        client = server.client()
        out = client.chat.completions.create(
            model="smollm2-135m-instruct", messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=16, temperature=0, logprobs=True, n=2, extra_body={"return_token_ids": True})
        stream = client.chat.completions.create(
            model="smollm2-135m-instruct", messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=16, temperature=0, stream=True)
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    finally:
        server.close()
    with RolloutEngine.from_pretrained("smollm2-135m-instruct", dtype="float32") as engine:
        ref = engine.sample(["What is the capital of France?"],
                            SamplingParams(n=2, temperature=0, max_new_tokens=16, chat=True))
    assert len(out.choices) == len(ref) == 2
    for choice, r in zip(out.choices, ref, strict=True):
        assert choice.model_extra["token_ids"] == r.token_ids
        assert [c.logprob for c in choice.logprobs.content] == r.logprobs
        assert choice.message.content == r.text
    assert out.model_extra["prompt_token_ids"] == ref[0].prompt_token_ids
    assert streamed == ref[0].text
