"""`rollout-ssd serve`: an OpenAI / vLLM-compatible HTTP server over one RolloutEngine.

    protocol.py  request schemas, their checks (HTTP 400 naming the field) and SamplingParams mapping
    render.py    response bodies (prompt-major choices, logprobs, usage) and streaming text deltas
    app.py       the FastAPI app: generation, /metrics, weight updates, pause / resume
    metrics.py   Prometheus text with vLLM's spec-decode counter names plus rollout_ssd's
    limits.py    the limits (400 naming the field, 429 for a full queue), body parsing, and the drain
                 of a graceful stop (503)
    main.py      the command line: load the engine, bind, run uvicorn

Needs the `serve` extra (fastapi, uvicorn, prometheus_client).
"""
