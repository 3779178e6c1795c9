"""The server's limits (`rollout-ssd serve` options, each listed by --help and GET /server_info) and the
checks that enforce them, and `Drain`, the state of a graceful stop.

A request above a limit gets HTTP 400 naming the field; one that would overfill the queue of sequences
waiting for a KV slot gets 429 with Retry-After; while the server drains (SIGTERM) every new request
gets 503. The context rule is vLLM's: prompt + max_tokens must fit in max_model_len, else 400 naming
max_tokens (`clamp_max_tokens`: cut to what fits instead). An omitted max_tokens is its default cut to
what fits. Strings that cannot be encoded as UTF-8 (lone surrogates), bodies over `max_body_bytes`,
JSON nested deeper than MAX_JSON_DEPTH, NaN / Infinity, and numbers outside their range are 400s.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass

from rollout_ssd.serve.protocol import BadRequest

MAX_JSON_DEPTH = 32  # object / array nesting of a request body
MAX_SEED = 2 ** 63 - 1  # seeds are integers in [0, MAX_SEED]
MIN_TEMPERATURE = 1e-5  # a temperature is 0 (greedy) or in [MIN_TEMPERATURE, MAX_TEMPERATURE]
MAX_TEMPERATURE = 100.0
MIN_TOP_P = 1e-6  # top_p in [MIN_TOP_P, 1]
MAX_TOP_K = 2 ** 31 - 1
RETRY_AFTER_S = 1  # the Retry-After of a 429 (queue full) and of a 503 (draining)


@dataclass(frozen=True)
class Limits:
    """max_n: the largest `n`. max_queued_seqs: the most sequences waiting for a KV slot, all requests
    together (a request that would go over gets 429; one larger than it on its own, 400).
    max_body_bytes: the largest request body. clamp_max_tokens: cut max_tokens to the context instead
    of answering 400. drain_timeout: seconds a graceful stop waits for running requests before
    cancelling them."""

    max_n: int = 128
    max_queued_seqs: int = 1024
    max_body_bytes: int = 4 * 2 ** 20
    clamp_max_tokens: bool = False
    drain_timeout: float = 30.0

    def __post_init__(self):
        for name in ("max_n", "max_queued_seqs", "max_body_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 1, got {value!r}")
        if not self.drain_timeout >= 0:
            raise ValueError(f"--drain-timeout must be >= 0, got {self.drain_timeout!r}")

    def as_dict(self) -> dict:
        return {**asdict(self), "max_json_depth": MAX_JSON_DEPTH, "seed_range": [0, MAX_SEED],
                "temperature": f"0 or [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}]", "top_p": f"[{MIN_TOP_P:g}, 1]",
                "top_k": f"-1, 0 or [1, {MAX_TOP_K}]",
                "context_rule": "prompt + max_tokens <= max_model_len" + (" (clamped)" if self.clamp_max_tokens else "")}


# ---------------------------------------------------------------------------------------------- bodies
def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text} is out of range")
    return value


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def parse_body(body: bytes):
    """json.loads with the server's rules: finite numbers only, bounded nesting, UTF-8-encodable strings."""
    try:
        data = json.loads(body or b"{}", parse_float=_finite, parse_constant=_no_constant)
    except RecursionError:
        raise BadRequest(f"the body nests deeper than {MAX_JSON_DEPTH} levels", "body") from None
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError and the two above
        raise BadRequest(f"the body is not valid JSON: {err}", "body") from None
    _check_tree(data)
    return data


def _check_tree(data) -> None:
    """Depth and encodability of every key and string, iteratively; the error names the top-level field."""
    stack = [(data, 0, None)]
    while stack:
        value, depth, field = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise BadRequest(f"{field or 'the body'} nests deeper than {MAX_JSON_DEPTH} levels", field or "body")
        if isinstance(value, str):
            _encodable(value, field)
        elif isinstance(value, dict):
            for key, item in value.items():
                _encodable(key, field)
                stack.append((item, depth + 1, field or key))
        elif isinstance(value, list):
            stack.extend((item, depth + 1, field) for item in value)


def _encodable(text: str, field) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise BadRequest(f"{field or 'a key'} holds a string that is not valid Unicode (a lone surrogate "
                         f"such as \\ud800)", field or "body") from None


async def json_object(raw) -> dict:
    """The request body as a JSON object under the server's limits (size, nesting, finite numbers,
    encodable strings; `app.state.limits`, else the defaults); BadRequest naming the field otherwise."""
    limits = getattr(raw.app.state, "limits", None) or Limits()
    data = parse_body(await read_body(raw, limits.max_body_bytes))
    if not isinstance(data, dict):
        raise BadRequest("the body must be a JSON object", "body")
    return data


async def read_body(raw, max_bytes: int) -> bytes:
    """The request body, refused (400 naming `body`) once it is over max_bytes, without reading the rest."""
    declared = raw.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise BadRequest(f"the body has {declared} bytes; the limit is {max_bytes} (--max-body-bytes)", "body")
    chunks, size = [], 0
    async for chunk in raw.stream():
        size += len(chunk)
        if size > max_bytes:
            raise BadRequest(f"the body is over the limit of {max_bytes} bytes (--max-body-bytes)", "body")
        chunks.append(chunk)
    return b"".join(chunks)


# ---------------------------------------------------------------------------------------------- fields
def check_ranges(req, limits: Limits) -> None:
    """n, seed, temperature, top_p and top_k within their ranges (400 naming the field)."""
    if req.n > limits.max_n:
        raise BadRequest(f"n must be <= {limits.max_n} (--max-n), got {req.n}", "n")
    if req.seed is not None and not 0 <= req.seed <= MAX_SEED:
        raise BadRequest(f"seed must be an integer in [0, {MAX_SEED}], got {req.seed}", "seed")
    t = req.temperature
    if t is not None and t != 0 and not MIN_TEMPERATURE <= t <= MAX_TEMPERATURE:
        raise BadRequest(f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}], got {t}",
                         "temperature")
    if req.top_p is not None and not MIN_TOP_P <= req.top_p <= 1:
        raise BadRequest(f"top_p must be in [{MIN_TOP_P:g}, 1], got {req.top_p}", "top_p")
    if req.top_k is not None and req.top_k > MAX_TOP_K:
        raise BadRequest(f"top_k must be <= {MAX_TOP_K}, got {req.top_k}", "top_k")


def max_tokens_for(lengths: list[int], asked, default: int, max_model_len: int, clamp: bool) -> int:
    """max_tokens for prompts of these token lengths: what was asked (400 naming max_tokens when the
    longest prompt plus it exceeds the context, unless clamp), or the default cut to what fits."""
    room = max_model_len - max(lengths)  # >= 1: the engine refuses prompts that leave no room
    if asked is None:
        return max(1, min(default, room))
    if asked < 1:
        raise BadRequest(f"max_tokens must be >= 1, got {asked}", "max_tokens")
    if asked > room and not clamp:
        raise BadRequest(f"this model's context holds {max_model_len} tokens; the prompt has {max(lengths)} and "
                         f"max_tokens asks {asked} more (at most {room}; or start the server with --clamp-max-tokens)",
                         "max_tokens")
    return min(asked, room)


def check_queue(waiting: int, new: int, n: int, limits: Limits) -> None:
    """400 if a request of `new` sequences could never queue; 429 if the queue cannot take it now."""
    if new > limits.max_queued_seqs:
        field = "n" if n > 1 else "prompt"
        raise BadRequest(f"the request asks for {new} sequences (prompts x n); at most {limits.max_queued_seqs} "
                         f"may wait for a slot (--max-queued-seqs)", field)
    if waiting + new > limits.max_queued_seqs:
        raise BadRequest(f"the server is busy: {waiting} sequences wait for a slot and the queue holds "
                         f"{limits.max_queued_seqs}; retry later", None, status=429,
                         headers={"Retry-After": str(RETRY_AFTER_S)})


# ---------------------------------------------------------------------------------------------- stopping
class Drain:
    """A graceful stop: once `begin` is called, new requests get 503 (DrainMiddleware); `wait` returns
    once no HTTP request is in flight (True) or at the timeout (False); `cancel_all` ends the engine
    requests still running."""

    def __init__(self):
        self.draining = False
        self.active = 0  # HTTP requests in flight (DrainMiddleware counts them)
        self.requests: set = set()  # engine requests not yet finished (the server adds and discards)

    def begin(self) -> None:
        self.draining = True

    def wait(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self.active > 0 or self.requests:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    def cancel_all(self) -> None:
        for request in list(self.requests):
            request.cancel()


class DrainMiddleware:
    """Plain ASGI middleware: counts HTTP requests in flight, and answers 503 (Retry-After) to every new
    one but GET /metrics while the server drains."""

    def __init__(self, app, drain: Drain):
        self.app, self.drain = app, drain

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.drain.draining and scope["path"] != "/metrics":
            body = json.dumps({"error": {"message": "the server is shutting down", "type": "service_unavailable",
                                         "param": None, "code": 503}}).encode()
            await send({"type": "http.response.start", "status": 503,
                        "headers": [(b"content-type", b"application/json"), (b"retry-after", str(RETRY_AFTER_S).encode()),
                                    (b"content-length", str(len(body)).encode()), (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": body})
            return
        self.drain.active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.active -= 1
