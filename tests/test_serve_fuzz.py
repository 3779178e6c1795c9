"""Every endpoint of `rollout-ssd serve --method sd`, fuzzed from the server's own OpenAPI schema
(`/openapi.json`) with hypothesis: bodies drawn from each request schema, then mutated (a field given an
arbitrary JSON value, an unknown field, a required field dropped), with strings that include lone
surrogates and integers and floats far outside their ranges. Whatever comes in: no 5xx, every 400 names
a field, and the server keeps serving (the same greedy answer at the end as at the start).

Bounded: derandomized, a fixed number of examples per endpoint, a short context (--max-model-len 32)
and n <= 2, so the test takes well under a minute. Bodies for /init_weight_transfer_engine get
world_size 1 (so no example joins a network group for its timeout: every one is refused after the
checks of init_info's types); /pause is followed by /resume."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
hypothesis = pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests.support.ran import assert_ran, served  # noqa: E402
from tests.test_serve import Served  # noqa: E402

pytestmark = pytest.mark.slow
EXAMPLES = {"/v1/completions": 150, "/v1/chat/completions": 60, "/update_weights_from_disk": 25,
            "/init_weight_transfer_engine": 25}  # every other endpoint (no body): 3

CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}:{{ m['content'] }}\n{% endfor %}"
CHARS = st.one_of(st.sampled_from("ab 1+=?x\n"), st.characters(codec="utf-8"), st.characters(categories=["Cs"]))
TEXT = st.text(CHARS, max_size=12)
INTS = st.one_of(st.integers(-3, 40), st.integers(-(2 ** 70), 2 ** 70))
FLOATS = st.one_of(st.floats(-3, 3, allow_nan=False), st.floats(allow_nan=False, allow_infinity=False),
                   st.sampled_from([0.0, 1e-30, 1.0, 1e30]))
JSON = st.recursive(st.one_of(st.none(), st.booleans(), INTS, FLOATS, TEXT),
                    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(TEXT, inner, max_size=4)),
                    max_leaves=12)


def from_schema(schema: dict, spec: dict, depth: int = 0):
    """A hypothesis strategy for values of a JSON Schema (the subset pydantic emits)."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[1]
        return from_schema(spec["components"]["schemas"][name], spec, depth)
    if "anyOf" in schema:
        return st.one_of([from_schema(s, spec, depth) for s in schema["anyOf"]])
    if "const" in schema or "enum" in schema:
        return st.sampled_from(schema.get("enum") or [schema["const"]])
    kind = schema.get("type")
    if kind is None or depth > 4:
        return JSON
    if kind == "object":
        props = schema.get("properties", {})
        if not props:
            return st.dictionaries(TEXT, JSON, max_size=3)
        required = set(schema.get("required", ()))
        return st.fixed_dictionaries({k: from_schema(v, spec, depth + 1) for k, v in props.items() if k in required},
                                     optional={k: from_schema(v, spec, depth + 1) for k, v in props.items()
                                               if k not in required})
    if kind == "array":
        return st.lists(from_schema(schema.get("items", {}), spec, depth + 1),
                        min_size=schema.get("minItems", 0), max_size=4)
    return {"string": TEXT, "integer": INTS, "number": FLOATS, "boolean": st.booleans(), "null": st.none()}[kind]


def mutated(body_strategy):
    """A conforming body, or one with a field's value replaced, an unknown field, or a field dropped."""

    @st.composite
    def build(draw):
        body = draw(body_strategy)
        how = draw(st.sampled_from(["as is", "as is", "retype", "unknown", "drop"]))
        if how == "retype" and body:
            body[draw(st.sampled_from(sorted(body)))] = draw(JSON)
        elif how == "unknown":
            body[draw(TEXT)] = draw(JSON)
        elif how == "drop" and body:
            del body[draw(st.sampled_from(sorted(body)))]
        return body

    return build()


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory):
    from rollout_ssd.rl.tasks import ALPHABET
    from rollout_ssd.rl.tiny import build_tiny_pair

    target, draft = build_tiny_pair(tmp_path_factory.mktemp("fuzz_tiny"), ALPHABET)
    config = json.loads((target / "tokenizer_config.json").read_text())
    config["chat_template"] = CHAT_TEMPLATE  # so that chat requests reach generation too
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    server = Served("--target", str(target), "--draft", str(draft), "--method", "sd", "--k", "3",
                    "--served-model-name", "tiny", "--max-model-len", "32", "--max-n", "2",
                    "--max-batch-size", "4", "--max-queued-seqs", "8")
    yield server
    server.close()


def _call(server, method: str, path: str, body) -> httpx.Response:
    if path == "/init_weight_transfer_engine" and isinstance(body, dict) and isinstance(body.get("init_info"), dict):
        body["init_info"]["world_size"] = 1
    content = None if body is None else json.dumps(body).encode()  # ensure_ascii: lone surrogates as \\udXXX
    resp = server.http.request(method.upper(), path, content=content, headers={"content-type": "application/json"})
    if path == "/pause":
        server.post("/resume")
    return resp


def _check(resp: httpx.Response, path: str, body) -> None:
    shown = json.dumps(body)[:300]
    assert resp.status_code in (200, 400, 429), (path, shown, resp.status_code, resp.text[:300])
    if resp.status_code == 400:
        param = resp.json()["error"]["param"]
        assert isinstance(param, str) and param, (path, shown, resp.text[:300])
    elif resp.headers.get("content-type", "").startswith("text/event-stream"):
        assert resp.text.rstrip().endswith("data: [DONE]") and '"internal_error"' not in resp.text, (shown, resp.text)


def _fuzz(server, spec: dict, path: str, method: str, op: dict) -> None:
    schema = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
    bodies = st.none() if schema is None else mutated(from_schema(schema, spec))

    @settings(max_examples=EXAMPLES.get(path, 3), deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(body=bodies)
    def fuzz(body):
        _check(_call(server, method, path, body), path, body)

    fuzz()


def test_every_endpoint_fuzzed_from_the_openapi_schema(fuzz_server):
    spec = fuzz_server.http.get("/openapi.json").json()
    ops = [(path, method, op) for path, item in spec["paths"].items() for method, op in item.items()]
    assert {p for p, *_ in ops} >= {"/v1/completions", "/v1/chat/completions", "/update_weights_from_disk",
                                    "/init_weight_transfer_engine", "/server_info", "/pause", "/metrics"}
    greedy = {"prompt": "1+2=", "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    counters = fuzz_server.metrics()
    before = fuzz_server.post("/v1/completions", greedy).json()["choices"][0]["token_ids"]
    for path, method, op in ops:
        _fuzz(fuzz_server, spec, path, method, op)
    assert fuzz_server.proc.poll() is None
    assert fuzz_server.post("/v1/completions", greedy).json()["choices"][0]["token_ids"] == before
    assert "Traceback" not in "".join(fuzz_server.log)
    assert_ran(served(counters, fuzz_server.metrics()), "sd")
