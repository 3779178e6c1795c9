"""The ASGI app of `rollout-ssd serve`: OpenAI-compatible generation over one `RolloutEngine`.

Every HTTP request becomes one engine request (`RolloutEngine.submit`), which joins the running
batch at the next round; the engine's background scheduler drives the rounds, so HTTP handlers only
wait. A client that disconnects cancels its request (its KV slots are freed before the next round);
the other requests are untouched. Weight updates (from a checkpoint on disk, or a torch.distributed
weight-sync group) are applied between rounds, and every choice reports the version it was sampled
under (control.py: pause/resume and the weight-update endpoints). Bad requests get HTTP 400 with
OpenAI's error shape, `param` naming the field; the limits (limits.py: n, the context, the queue of
sequences waiting for a slot, the body) are 400s and a full queue 429; while the server drains for a
graceful stop, 503. Request bodies are parsed by hand (limits.json_object) and documented in the
OpenAPI schema (`/openapi.json`) by their pydantic models.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from functools import partial
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from rollout_ssd.serve.control import BODIES, control_routes
from rollout_ssd.serve.limits import (
    Drain,
    DrainMiddleware,
    Limits,
    check_queue,
    check_ranges,
    json_object,
    max_tokens_for,
)
from rollout_ssd.serve.metrics import prometheus_text
from rollout_ssd.serve.protocol import (
    BadRequest,
    ChatRequest,
    CompletionRequest,
    check_chat,
    check_completion,
    completion_prompts,
    sampling_params,
)
from rollout_ssd.serve.render import Renderer, TextStream, new_id

log = logging.getLogger(__name__)

# how often a waiting handler checks whether its client is still there
DISCONNECT_POLL_S = 0.25


def _error(status: int, message: str, param: Optional[str] = None, kind: str = "invalid_request_error"):
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status_code=status)


def _validation_param(err: ValidationError) -> tuple[str, str]:
    first = err.errors()[0]
    loc = [str(x) for x in first.get("loc", ())]
    # a union's member name (e.g. 'str', 'list[int]') follows the field's own name in the location
    param = loc[0] if loc else "body"
    where = ".".join(loc) or "body"
    if first.get("type") == "extra_forbidden":
        return param, f"unknown field {where!r}"
    return param, f"{where}: {first.get('msg')}"


class _ApiKey:
    """Plain ASGI middleware (Starlette's BaseHTTPMiddleware would hide client disconnects from the
    handlers): every path but /health and /metrics needs 'Authorization: Bearer KEY'."""

    OPEN = ("/health", "/metrics")

    def __init__(self, app, key: str):
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in self.OPEN:
            given = dict(scope.get("headers") or ()).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                await _error(401, "missing or wrong API key", kind="authentication_error")(scope, receive, send)
                return
        await self.app(scope, receive, send)


class Server:
    """The app's state: the engine, its tokenizer and name, and the request counters /metrics exports."""

    def __init__(self, engine, model_name: str, default_max_tokens: int = 16, limits: Limits = Limits(),
                 drain: Optional[Drain] = None):
        self.engine, self.limits, self.drain = engine, limits, drain or Drain()
        self.model_name = model_name
        self.default_max_tokens = default_max_tokens
        self.tokenizer = engine.target.tokenizer
        self.renderer = Renderer(self.tokenizer, model_name, engine.target.model.cfg.eos_token_ids)
        self.counts = {"finished": 0, "aborted": 0, "rejected": 0, "prompt_tokens": 0,
                       "generation_tokens": 0}
        self.receiver_attached = False

    async def body(self, raw: Request, schema: type[BaseModel]):
        data = await json_object(raw)
        try:
            return schema.model_validate(data)
        except ValidationError as err:
            param, message = _validation_param(err)
            raise BadRequest(message, param) from None

    def check_model(self, model: Optional[str]) -> None:
        if model is not None and model != self.model_name:
            raise BadRequest(f"unknown model {model!r}; this server serves {self.model_name!r}", "model")

    def seed(self, seed: Optional[int]) -> int:
        return secrets.randbits(63) if seed is None else seed

    def prompt_ids(self, prompts, field: str = "prompt") -> list[list[int]]:
        """Token ids of the prompts, with the engine's checks (400 naming `field`)."""
        try:
            return self.engine.tokenize(prompts)
        except (ValueError, TypeError) as err:
            raise BadRequest(str(err), field) from None

    def max_tokens(self, ids: list[list[int]], asked: Optional[int], default: int, field: str = "max_tokens") -> int:
        try:
            return max_tokens_for([len(p) for p in ids], asked, default, self.engine.max_model_len,
                                  self.limits.clamp_max_tokens)
        except BadRequest as err:
            raise BadRequest(str(err).replace("max_tokens", field), field) from None

    def submit(self, prompts, params, field: str, listener):
        check_queue(self.engine.scheduler.counts()["waiting"], len(prompts) * params.n, params.n, self.limits)
        live = self.drain.requests

        def listen(request, finished):
            if finished:
                live.discard(request)
            listener(request, finished)

        try:
            request = self.engine.submit(prompts, params, listener=listen)
        except ValueError as err:
            raise BadRequest(str(err), field) from None
        live.add(request)
        if request.done():
            live.discard(request)
        self.counts["prompt_tokens"] += sum(len(s.prompt_token_ids) for s in request.seqs[::params.n])
        return request

    def finished(self, request) -> None:
        # cancelled: a stream cancelled by its client's disconnect is counted before the scheduler has
        # ended its sequences (the handler cannot wait for that while being cancelled itself)
        aborted = request.cancelled or any(s.finish_reason == "abort" for s in request.seqs)
        self.counts["aborted" if aborted else "finished"] += 1
        self.counts["generation_tokens"] += request.num_tokens

    def chat_prompt(self, req: ChatRequest) -> list[int]:
        if self.tokenizer is None or getattr(self.tokenizer, "chat_template", None) is None:
            raise BadRequest("this model has no chat template; use /v1/completions", "messages")
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        try:
            ids = self.tokenizer.apply_chat_template(
                messages, tools=req.tools, add_generation_prompt=req.add_generation_prompt and not req.continue_final_message,
                continue_final_message=req.continue_final_message, tokenize=True, **(req.chat_template_kwargs or {}))
        except Exception as err:  # a template that cannot render these messages is the request's fault
            raise BadRequest(f"the chat template could not render these messages: {err}", "messages") from None
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        return [int(t) for t in ids]


class _Events:
    """The listener's events of one request on the event loop, and whether its client is still there
    (checked at least every DISCONNECT_POLL_S, whether or not events arrive)."""

    def __init__(self, raw: Request):
        self.raw, self.queue = raw, asyncio.Queue()
        self.checked = time.monotonic()

    def listener(self, loop: asyncio.AbstractEventLoop):
        return lambda request, finished: loop.call_soon_threadsafe(self.queue.put_nowait, finished)

    async def next(self, request) -> Optional[bool]:
        """The next event (finished or not), or None once the client has gone away."""
        while True:
            try:
                event = await asyncio.wait_for(self.queue.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                event = None
            if time.monotonic() - self.checked >= DISCONNECT_POLL_S:
                self.checked = time.monotonic()
                if not request.done() and await self.raw.is_disconnected():
                    return None
            if event is not None:
                return event


async def _wait(server: Server, request, events: _Events) -> bool:
    """Wait for an engine request; False (and cancelled) if the client went away first."""
    while not request.done():
        if await events.next(request) is None:
            request.cancel()
            await asyncio.to_thread(request.wait)
            server.finished(request)
            return False
    server.finished(request)
    return True


async def _generate(server: Server, raw: Request, prompts, params, field: str, render, stream_chunk=None,
                    cid: str = "", include_usage: bool = False):
    """Submit, then answer with one JSON body, or (stream_chunk given) an SSE stream of chunks:
    stream_chunk(index, token_ids, logprobs, text_delta, rollout or None) -> one chunk's body."""
    events = _Events(raw)
    request = server.submit(prompts, params, field, events.listener(asyncio.get_running_loop()))
    if stream_chunk is None:
        if not await _wait(server, request, events):
            return Response(status_code=499)
        try:
            return JSONResponse(render(request.result()))
        except Exception as err:  # the round failed; the engine released its slots
            log.exception("request failed")
            return _error(500, f"generation failed: {err}", kind="internal_error")

    async def events_stream():
        texts = [TextStream(server.tokenizer, params.stop) for _ in request.seqs]
        try:
            while True:
                finished = await events.next(request)
                if finished is None:
                    return  # the client went away: `finally` cancels the request
                rollouts = request.result() if finished else None
                for index, seq in enumerate(request.seqs):
                    rollout = rollouts[index] if rollouts else None
                    piece = _stream_piece(seq, texts[index], rollout)
                    if piece is not None:
                        yield f"data: {json.dumps(stream_chunk(index, *piece, rollout))}\n\n"
                if finished:
                    if include_usage:
                        usage = server.renderer.usage(rollouts, params.n)
                        yield f"data: {json.dumps({'id': cid, 'choices': [], 'usage': usage})}\n\n"
                    yield "data: [DONE]\n\n"
                    return
        except Exception as err:
            yield f"data: {json.dumps({'error': {'message': str(err), 'type': 'internal_error', 'code': 500}})}\n\n"
        finally:
            if not request.done():
                request.cancel()
            server.finished(request)

    return StreamingResponse(events_stream(), media_type="text/event-stream")


def _stream_piece(seq, text: TextStream, rollout):
    """(token ids, logprobs, text delta) of one sequence new since the last chunk (the rest once it is
    done), or None when nothing is new."""
    if rollout is not None:
        ids, lps = rollout.token_ids, rollout.logprobs
    else:  # the scheduler thread appends a token before its logprob: take the pairs complete now
        lps = list(seq.logprobs)
        ids = list(seq.token_ids[:len(lps)])
    new_ids, new_lps = ids[text.tokens_sent:], list(lps[text.tokens_sent:])
    text.tokens_sent = len(ids)
    delta = text.delta(ids, rollout.text if rollout is not None else None)
    if not new_ids and not delta and rollout is None:
        return None
    return new_ids, new_lps, delta


def _document_bodies(app: FastAPI, bodies: dict) -> None:
    """Put each endpoint's request body model (path -> pydantic model) into the app's OpenAPI schema."""

    def openapi():
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for path, model in bodies.items():
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
                ref = {"$ref": f"#/components/schemas/{model.__name__}"}
                schema["paths"][path]["post"]["requestBody"] = {"required": True,
                                                                "content": {"application/json": {"schema": ref}}}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


def build_app(engine, model_name: str, api_key: Optional[str] = None, default_max_tokens: int = 16,
              limits: Limits = Limits(), drain: Optional[Drain] = None) -> FastAPI:
    server = Server(engine, model_name, default_max_tokens, limits, drain)
    app = FastAPI(title="rollout-ssd", docs_url=None, redoc_url=None)
    app.state.server, app.state.limits = server, limits

    @app.exception_handler(BadRequest)
    async def bad_request(_, err: BadRequest):
        server.counts["rejected"] += 1
        param = err.param or ("body" if err.status == 400 else None)  # a 400 always names a field
        response = _error(err.status, str(err), param, "rate_limit_error" if err.status == 429 else
                          "invalid_request_error")
        response.headers.update(err.headers or {})
        return response

    if api_key is not None:
        app.add_middleware(_ApiKey, key=api_key)
    app.add_middleware(DrainMiddleware, drain=server.drain)  # outermost: 503 while draining

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "rollout-ssd",
                                            "max_model_len": engine.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(raw: Request):
        req = await server.body(raw, CompletionRequest)
        server.check_model(req.model)
        check_completion(req)
        check_ranges(req, server.limits)
        prompts = server.prompt_ids(completion_prompts(req.prompt))
        max_tokens = server.max_tokens(prompts, req.max_tokens, server.default_max_tokens)
        params = sampling_params(req, max_tokens, server.default_max_tokens, server.seed(req.seed))
        as_ids = req.return_tokens_as_token_ids
        render = lambda rollouts: server.renderer.completion(rollouts, params.n, req.logprobs, req.return_token_ids, as_ids)
        cid = new_id("cmpl")
        chunk = partial(server.renderer.completion_chunk, cid, with_logprobs=req.logprobs is not None,
                        return_ids=req.return_token_ids, as_ids=as_ids) if req.stream else None
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return await _generate(server, raw, prompts, params, "prompt", render, chunk, cid, include_usage)

    @app.post("/v1/chat/completions")
    async def chat(raw: Request):
        req = await server.body(raw, ChatRequest)
        server.check_model(req.model)
        check_chat(req)
        check_ranges(req, server.limits)
        prompt = server.chat_prompt(req)
        field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = server.max_tokens(server.prompt_ids([prompt], "messages"), getattr(req, field), engine.max_model_len,
                                       field)
        params = sampling_params(req, max_tokens, engine.max_model_len, server.seed(req.seed))
        as_ids = req.return_tokens_as_token_ids
        render = lambda rollouts: server.renderer.chat(rollouts, req.logprobs, req.return_token_ids, as_ids)
        cid = new_id("chatcmpl")
        chunk = partial(server.renderer.chat_chunk, cid, with_logprobs=req.logprobs, return_ids=req.return_token_ids,
                        as_ids=as_ids) if req.stream else None
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return await _generate(server, raw, [prompt], params, "messages", render, chunk, cid, include_usage)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(prometheus_text(engine, server), media_type="text/plain; version=0.0.4")

    control_routes(app, server)
    _document_bodies(app, {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatRequest, **BODIES})
    return app
