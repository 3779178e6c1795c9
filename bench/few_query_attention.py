"""The forms of few-query attention over a 16-bit CPU cache, side by side: which should this CPU kind take?

A decode, verify or tree step attends a few queries per row over the rows' KV caches. On a CPU with a bf16
cache the SDPA backend (rollout_ssd/models/attention.py) takes this package's kernel (few_attention.py) where
it builds, else PyTorch's SDPA (its CPU flash kernel) where `attention.SDPA_FEW_QUERIES` holds (by CPU kind:
`cpu_backend.SDPA_FEW_QUERIES_KINDS`), else the explicit softmax(q k^T) v on float32 copies. This bench
times the three in one process, taking turns repeat by repeat, on SmolLM2-135M-Instruct in bf16:
runner-level steps of t new tokens per row after prompts of about --prompt-len tokens (lengths differ by
row, so a step reads its keys through a mask, as a batch of rollouts does), at each batch and thread
count asked (medians after a warm-up repeat), and the attention call alone at SmolLM2's head shapes.
Table, then one JSON line; the form this CPU kind takes is printed.

    .venv/bin/python bench/few_query_attention.py                     # batches 1,4,8,24; t 1,4; threads 2,1
"""

from __future__ import annotations

import argparse
import functools
import time

import common  # bench/common.py (the script's folder is on sys.path)
import torch
import torch.nn.functional as F

common.add_repo_to_path()

from rollout_ssd.models import attention, cpu_backend, few_attention  # noqa: E402
from rollout_ssd.models.loader import load_pretrained  # noqa: E402
from rollout_ssd.runner import ModelRunner  # noqa: E402

FORMS = {"explicit": (False, False), "kernel": (False, True), "sdpa": (True, False)}  # (SDPA_FEW_QUERIES, kernel on)


def use(form: str) -> None:
    attention.SDPA_FEW_QUERIES, on = FORMS[form]
    few_attention.set_enabled(on)


def step_rows(runner: ModelRunner, batches: list[int], ts: list[int], prompt_len: int, repeats: int) -> list[dict]:
    rows = []
    for b in batches:
        slots = list(range(b))
        lengths = [prompt_len - (5 * i) % 40 for i in range(b)]
        runner.prefill(slots, [[(7 * i + 13 * j) % 4000 + 10 for j in range(n)] for i, n in enumerate(lengths)])
        times = {(form, t): [] for form in FORMS for t in ts}
        for rep in range(repeats + 1):  # the first repeat warms up
            for form in FORMS:
                use(form)
                for t in ts:
                    _, s = common.timed(runner.extend, slots, [[5] * t] * b, last_only=False)
                    if rep:
                        times[(form, t)].append(s)
                    for slot, n in zip(slots, lengths):
                        runner.rollback(slot, n)
        for slot in slots:
            runner.rollback(slot, 0)
        for t in ts:
            rows.append(row("step", b, t, prompt_len, {form: common.median(times[(form, t)]) for form in FORMS}))
    return rows


def row(what: str, b: int, t: int, keys: int, seconds: dict) -> dict:
    e = seconds["explicit"]
    return {"what": what, "batch": b, "t": t, "keys": keys, **{f"{f}_ms": 1e3 * s for f, s in seconds.items()},
            "kernel_over_explicit": seconds["kernel"] / e, "sdpa_over_explicit": seconds["sdpa"] / e}


def call_rows(shapes: list[tuple[int, int, int]], calls: int) -> list[dict]:
    """The attention call alone: q [B, 9, T, 64], k, v [B, 3, L, 64] bf16, a visibility mask."""
    rows = []
    for b, t, length in shapes:
        g = torch.Generator().manual_seed(b * 1000 + t * 10 + length)
        q = torch.randn(b, 9, t, 64, generator=g).bfloat16()
        k, v = (torch.randn(b, 3, length, 64, generator=g).bfloat16() for _ in range(2))
        mask = torch.ones(b, 1, t, length, dtype=torch.bool)
        fns = {"explicit": functools.partial(attention.explicit_attention, q, k, v, mask, 0.125),
               "kernel": functools.partial(few_attention.attend, q, k, v, mask, 0.125),
               "sdpa": functools.partial(F.scaled_dot_product_attention, q, k, v, attn_mask=mask, scale=0.125,
                                         enable_gqa=True)}
        seconds = {}
        for name, fn in fns.items():
            for _ in range(10):
                fn()
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            seconds[name] = (time.perf_counter() - start) / calls
        rows.append(row("call", b, t, length, seconds))
    return rows


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,4,8,24")
    p.add_argument("--ts", default="1,4", help="new tokens per row of the timed steps (decode 1, a verify K+1)")
    p.add_argument("--threads", default="2,1")
    p.add_argument("--prompt-len", type=int, default=250)
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--calls", type=int, default=200, help="calls per form of the attention alone")
    args = p.parse_args(argv)
    batches, ts = [int(b) for b in args.batches.split(",")], [int(t) for t in args.ts.split(",")]
    model = load_pretrained("smollm2-135m-instruct", dtype="bfloat16").model
    cpu_backend.warm_packed(model)
    runner = ModelRunner(model, num_slots=max(batches), max_len=args.prompt_len + max(ts) + 2)
    here, kernel_on, threads_before = attention.SDPA_FEW_QUERIES, few_attention.available(), torch.get_num_threads()
    if not few_attention.available():
        raise SystemExit("the few_attention kernel does not run here: nothing to compare it with")
    rows = []
    try:
        with torch.inference_mode():
            for threads in [int(n) for n in args.threads.split(",")]:
                torch.set_num_threads(threads)
                rows += [{"threads": threads, **r} for r in step_rows(runner, batches, ts, args.prompt_len, args.repeats)]
                rows += [{"threads": threads, **r} for r in call_rows([(1, 1, 300), (24, 1, 300), (8, 5, 300)], args.calls)]
    finally:
        attention.SDPA_FEW_QUERIES = here
        few_attention.set_enabled(kernel_on)
        torch.set_num_threads(threads_before)
    common.print_table(rows)
    taken = "the few_attention kernel" if kernel_on else "SDPA" if here else "the explicit form"
    print(f"CPU kind {cpu_backend.cpu_kind()}: few queries over a 16-bit cache take {taken} here")
    result = {"bench": "few_query_attention", "cpu_kind": cpu_backend.cpu_kind(), "sdpa_here": here, "taken": taken,
              "prompt_len": args.prompt_len, "repeats": args.repeats, "rows": rows, "machine": common.machine_note()}
    common.print_json_line(result)
    return result


if __name__ == "__main__":
    main()
