"""Folded GQA: SDPA over each kv head's query heads folded into one block, against SDPA with `enable_gqa`.

Two parts, one process, the two forms taking turns so that machine noise hits them alike:
  - attention: one layer's attention call (SmolLM2-135M's 9 query heads over 3 kv heads, head dim 64,
    float32, a visibility mask of ragged lengths) at batch, key length and queries per row, microseconds;
  - grpo: a GRPO step's rollouts (6 prompts x n=4, T=1, EOS on, up to 160 new tokens, `fresh_engines.py`'s
    workload) on one AR engine with `attention.FOLDED_GQA_MIN_BATCH` set out of reach ("enable_gqa") and as
    shipped ("folded"), tok/s. The sampled rollouts differ between the forms only where float32 rounding
    moves a draw (the sums are the same, blocked otherwise), so token counts stay close.
Table and a JSON last line.

    .venv/bin/python bench/folded_gqa.py
    .venv/bin/python bench/folded_gqa.py --parts attention
"""

from __future__ import annotations

import argparse
import time

from common import add_repo_to_path, bench_prompts, machine_note, print_json_line, print_table

add_repo_to_path()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from rollout_ssd import RolloutEngine, SamplingParams, SpecConfig  # noqa: E402
from rollout_ssd.models import attention  # noqa: E402
from rollout_ssd.models.cpu_backend import cpu_kind  # noqa: E402

SHAPES = ((1, 150, 1), (2, 150, 1), (4, 150, 1), (8, 150, 1), (16, 200, 1), (24, 100, 1), (24, 200, 1),
          (24, 300, 1), (4, 150, 5), (24, 200, 5))  # (batch, keys, queries per row)


def _us(fn, args: tuple, n: int) -> float:
    for _ in range(10):
        fn(*args)
    t0 = time.perf_counter()
    for _ in range(n):
        fn(*args)
    return (time.perf_counter() - t0) / n * 1e6


def _gqa(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.125, enable_gqa=True)


def _folded(q, k, v, mask):
    return attention.folded_gqa_attention(q, k, v, mask, 0.125)


def attention_rows(calls: int) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    rows = []
    for b, length, t in SHAPES:
        q = torch.randn(b, 9, t, 64, generator=gen)
        k, v = torch.randn(2, b, 3, length, 64, generator=gen)
        lens = torch.randint(length // 2, length, (b,), generator=gen)
        lens[0] = length
        mask = (torch.arange(length)[None, None, :] <= (lens[:, None] - t + torch.arange(t))[:, :, None])[:, None]
        gqa, folded = _us(_gqa, (q, k, v, mask), calls), _us(_folded, (q, k, v, mask), calls)
        rows.append({"batch": b, "keys": length, "queries": t, "enable_gqa us": gqa, "folded us": folded,
                     "folded / enable_gqa": folded / gqa,
                     "max |diff|": float((_folded(q, k, v, mask) - _gqa(q, k, v, mask)).abs().max())})
    return rows


def grpo_rows(repeats: int) -> list[dict]:
    engine = RolloutEngine.from_pretrained(spec=SpecConfig(method="ar"))
    shipped = attention.FOLDED_GQA_MIN_BATCH
    totals = {form: [0, 0.0] for form in ("enable_gqa", "folded")}
    with engine:
        prompts = bench_prompts(engine.target.tokenizer, "templates", 6)
        params = SamplingParams(n=4, temperature=1.0, max_new_tokens=160, seed=0)
        engine.sample(prompts[:1], SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=1))  # warm-up
        for _ in range(repeats):
            for form in totals:
                attention.FOLDED_GQA_MIN_BATCH = shipped if form == "folded" else 1 << 30
                try:
                    t0 = time.perf_counter()
                    tokens = sum(len(r.token_ids) for r in engine.sample(prompts, params))
                    totals[form][1] += time.perf_counter() - t0
                    totals[form][0] += tokens
                finally:
                    attention.FOLDED_GQA_MIN_BATCH = shipped
    base = totals["enable_gqa"][0] / totals["enable_gqa"][1]
    return [{"form": form, "tokens": n, "seconds": s, "tok/s": n / s, "x enable_gqa": n / s / base}
            for form, (n, s) in totals.items()]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default="attention,grpo")
    p.add_argument("--calls", type=int, default=300, help="attention calls timed per shape and form")
    p.add_argument("--repeats", type=int, default=2, help="GRPO calls per form")
    args = p.parse_args(argv)
    parts = args.parts.split(",")
    print(f"CPU {cpu_kind()}, {torch.get_num_threads()} threads, float32")
    out = {}
    if "attention" in parts:
        out["attention"] = attention_rows(args.calls)
        print_table(out["attention"], floatfmt=".3g")
    if "grpo" in parts:
        out["grpo"] = grpo_rows(args.repeats)
        print_table(out["grpo"])
    print_json_line({"bench": "folded_gqa", "machine": machine_note(), "args": vars(args), **out})


if __name__ == "__main__":
    main()
