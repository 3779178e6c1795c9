"""`rollout-ssd serve`: load the engine, bind the socket, run uvicorn until SIGINT / SIGTERM.

The socket is bound before uvicorn starts so that `--port 0` works: the line
`rollout-ssd serve: listening on http://HOST:PORT` names the port actually bound (tests and scripts
read it). Loopback by default; binding elsewhere without --api-key logs a warning.
"""

from __future__ import annotations

import logging
import os
import socket
import sys

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
    p.set_defaults(func=serve)


def serve(args) -> int:
    import torch
    import uvicorn

    from rollout_ssd import RolloutEngine, SpecConfig
    from rollout_ssd.serve.app import build_app

    if args.threads:
        torch.set_num_threads(args.threads)
    spec = {"method": args.method}
    if args.k is not None:
        spec["k"] = args.k
    if args.speculator is not None:
        spec["speculator"] = args.speculator
    cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    try:
        engine = RolloutEngine.from_pretrained(args.target, draft=args.draft, spec=SpecConfig(**spec), dtype=args.dtype,
                                               max_batch_size=args.max_batch_size, max_model_len=args.max_model_len)
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
    app = build_app(engine, args.served_model_name or args.target, api_key=args.api_key,
                    default_max_tokens=args.default_max_tokens)
    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=5)
    print(f"rollout-ssd serve: listening on http://{host}:{port}", flush=True)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        engine.close()
        sock.close()
    return 0
