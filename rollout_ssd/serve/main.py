"""`rollout-ssd serve`: load the engine, bind the socket, run uvicorn until SIGINT / SIGTERM.

The socket is bound before uvicorn starts so that `--port 0` works: the line
`rollout-ssd serve: listening on http://HOST:PORT` names the port actually bound (tests and scripts
read it). Loopback by default; binding elsewhere without --api-key logs a warning.

Limits (limits.py) and admission (EngineConfig.admission, reserved_slots, max_round_rows) are options with safe
defaults, listed by --help and GET /server_info. SIGTERM (or Ctrl-C) stops gracefully: new requests get
503 at once, running ones finish (cancelled after --drain-timeout seconds), then the engine closes and
the process exits 0; a second signal exits without waiting.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading

log = logging.getLogger(__name__)


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve an OpenAI / vLLM-compatible HTTP API over a RolloutEngine")
    p.add_argument("--target", "--model", dest="target", default="smollm2-135m-instruct",
                   help="built-in name, HF checkpoint dir or .gguf")
    p.add_argument("--draft", default=None, help="'default', 'target-int4', a checkpoint dir or a .gguf (needed for sd / ssd)")
    p.add_argument("--method", default="ar", choices=["ar", "sd", "ssd"])
    p.add_argument("--k", type=int, default=None, help="draft tokens per round (SpecConfig.k)")
    p.add_argument("--speculator", default=None, help="SD's speculator: draft, suffix or random")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-batch-size", type=int, default=None,
                   help="sequences decoded together (default: EngineConfig's: 128 on a CPU as memory allows, 32 on a GPU)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: --target)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (all but /health, /metrics)")
    p.add_argument("--default-max-tokens", type=int, default=16, help="/v1/completions' max_tokens when omitted")
    p.add_argument("--threads", type=int, default=None, help="torch threads of the engine")
    _add_limit_args(p)
    p.set_defaults(func=serve)


def _add_limit_args(p) -> None:
    from rollout_ssd.serve.limits import Limits

    d = Limits()
    g = p.add_argument_group("limits and admission (also in GET /server_info)")
    g.add_argument("--max-n", type=int, default=d.max_n, help="the largest n of a request (400 above; default %(default)s)")
    g.add_argument("--max-queued-seqs", type=int, default=d.max_queued_seqs,
                   help="sequences that may wait for a KV slot, all requests together: a request that would go "
                        "over gets 429 with Retry-After, one larger than this on its own 400 (default %(default)s)")
    g.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes,
                   help="the largest request body in bytes (400 above; default %(default)s)")
    g.add_argument("--clamp-max-tokens", action="store_true",
                   help="cut max_tokens to what the context holds; default: 400 when prompt + max_tokens > max_model_len")
    g.add_argument("--drain-timeout", type=float, default=d.drain_timeout,
                   help="on SIGTERM: seconds running requests may take to finish before they are cancelled "
                        "(default %(default)s)")
    g.add_argument("--admission", default="fair", choices=["fair", "fifo"],
                   help="which waiting sequences get free KV slots: round-robin over requests (fair) or arrival "
                        "order (default %(default)s)")
    g.add_argument("--reserved-slots", default="auto",
                   help="fair admission: free KV slots kept for requests that hold none yet (an integer, or 'auto': "
                        "1 in 16, at least 1; default %(default)s)")
    g.add_argument("--max-round-rows", type=int, default=0,
                   help="the most running sequences one round steps (those that waited longest) and the most waiting "
                        "ones it admits (a new request alone in its round), which bounds a new request's wait for "
                        "the round in flight and its own prefill at some cost in a large batch's throughput; 0: "
                        "every running sequence, every round (default %(default)s)")


class _Graceful:
    """uvicorn.Server's signal handling, replaced: the first SIGTERM / SIGINT drains (new requests 503,
    running ones finish or are cancelled after the timeout), then uvicorn stops; a second one stops now."""

    def __init__(self, server, drain, timeout: float):
        self.server, self.drain, self.timeout = server, drain, timeout

    def handle_exit(self, sig, frame) -> None:
        if self.drain.draining:
            self.server.should_exit = True
            self.server.force_exit = True
            return
        log.warning("rollout-ssd serve: stopping: new requests get 503; waiting up to %g s for running ones", self.timeout)
        self.drain.begin()
        threading.Thread(target=self._finish, name="rollout-ssd-drain", daemon=True).start()

    def _finish(self) -> None:
        if not self.drain.wait(self.timeout):
            log.warning("rollout-ssd serve: requests still running after %g s; cancelling them", self.timeout)
            self.drain.cancel_all()
            self.drain.wait(5.0)
        self.server.should_exit = True


def serve(args) -> int:
    import torch
    import uvicorn

    from rollout_ssd import RolloutEngine, SpecConfig
    from rollout_ssd.serve.app import build_app
    from rollout_ssd.serve.limits import Drain, Limits

    if args.threads:
        torch.set_num_threads(args.threads)
    spec = {"method": args.method}
    if args.k is not None:
        spec["k"] = args.k
    if args.speculator is not None:
        spec["speculator"] = args.speculator
    cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    reserved = args.reserved_slots if args.reserved_slots == "auto" else _int_or(args.reserved_slots)
    try:
        limits = Limits(args.max_n, args.max_queued_seqs, args.max_body_bytes, args.clamp_max_tokens, args.drain_timeout)
        engine = RolloutEngine.from_pretrained(args.target, draft=args.draft, spec=SpecConfig(**spec), dtype=args.dtype,
                                               max_batch_size=args.max_batch_size, max_model_len=args.max_model_len,
                                               admission=args.admission, reserved_slots=reserved,
                                               max_round_rows=args.max_round_rows or None)
    except ValueError as err:
        print(f"rollout-ssd serve: error: {err}", file=sys.stderr)
        return 2
    # An SSD engine pins its creating thread to the target's core (its draft worker takes another).
    # Start the scheduler's thread now, so the rounds inherit that pin, then give this thread (the HTTP
    # event loop) back the cores it started with, so parsing and streaming do not queue behind rounds.
    engine.scheduler.start()
    if cores is not None and os.sched_getaffinity(0) != cores:
        os.sched_setaffinity(0, cores)
    if args.host not in ("127.0.0.1", "localhost", "::1") and args.api_key is None:
        log.warning("serving on %s without --api-key: anyone who reaches it can generate and replace weights", args.host)
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    host, port = sock.getsockname()[:2]
    drain = Drain()
    app = build_app(engine, args.served_model_name or args.target, api_key=args.api_key,
                    default_max_tokens=args.default_max_tokens, limits=limits, drain=drain)
    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    server.handle_exit = _Graceful(server, drain, limits.drain_timeout).handle_exit
    print(f"rollout-ssd serve: listening on http://{host}:{port}", flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        engine.close()
        sock.close()
    return 0


def _int_or(text: str):
    """An integer option's value, or the text itself (the config that reads it names the option in its error)."""
    try:
        return int(text)
    except ValueError:
        return text
