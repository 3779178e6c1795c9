"""Folded GQA: SDPA over each kv head's query heads folded into one block, against SDPA with `enable_gqa`.

A probe, not the engine's path (bench/RESULTS.md, "Folded GQA": not adopted). Two parts, one process,
the two forms taking turns so that machine noise hits them alike:
  - attention: one layer's attention call (SmolLM2-135M's 9 query heads over 3 kv heads, head dim 64,
    float32, a visibility mask of ragged lengths) at batch, key length and queries per row, microseconds;
  - grpo: a GRPO step's rollouts (6 prompts x n=4, T=1, EOS on, up to 160 new tokens, `fresh_engines.py`'s
    workload) on one AR engine as it is ("enable_gqa") and with `SDPABackend` patched to take the folded
    form for float32 calls of 2+ sequences and up to 16 queries ("folded"), tok/s. The sampled rollouts
    differ between the forms where float32 rounding moves a draw (the sums are the same, blocked
    otherwise), so token counts differ a little.
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
from rollout_ssd.models.attention import SDPABackend  # noqa: E402
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


def folded_gqa_attention(q, k, v, mask, scale):
    """SDPA with query head h on kv head h // g, as `enable_gqa` has it, over the g query heads of each kv
    head folded into one [g * T] block: q [B, Hq, T, D], k, v [B, Hkv, L, D], mask [B, 1, T, L] bool."""
    b, hq, t, d = q.shape
    hkv, length = k.shape[1], k.shape[2]
    g = hq // hkv
    if mask is not None and t > 1:  # each query position's row, once per head of its group
        mask = mask[:, :, None].expand(b, 1, g, t, length).reshape(b, 1, g * t, length)
    out = F.scaled_dot_product_attention(q.reshape(b, hkv, g * t, d), k, v, attn_mask=mask, scale=scale)
    return out.reshape(b, hq, t, d)


def _folded(q, k, v, mask):
    return folded_gqa_attention(q, k, v, mask, 0.125)


def _folded_call(self, q, k_cache, v_cache, prepared, scale):
    """`SDPABackend.__call__` taking the folded form for float32 calls of 2+ sequences, up to 16 queries."""
    k, v = prepared.read(k_cache), prepared.read(v_cache)
    if q.dtype == torch.float32 and q.shape[0] >= 2 and q.shape[1] != k.shape[1] and q.shape[2] <= 16 \
            and (prepared.mask is not None or q.shape[2] == 1):
        return folded_gqa_attention(q, k, v, prepared.mask, scale)
    return _SHIPPED_CALL(self, q, k_cache, v_cache, prepared, scale)


_SHIPPED_CALL = SDPABackend.__call__


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
    totals = {form: [0, 0.0] for form in ("enable_gqa", "folded")}
    with engine:
        prompts = bench_prompts(engine.target.tokenizer, "templates", 6)
        params = SamplingParams(n=4, temperature=1.0, max_new_tokens=160, seed=0)
        engine.sample(prompts[:1], SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=1))  # warm-up
        for _ in range(repeats):
            for form in totals:
                SDPABackend.__call__ = _folded_call if form == "folded" else _SHIPPED_CALL
                try:
                    t0 = time.perf_counter()
                    tokens = sum(len(r.token_ids) for r in engine.sample(prompts, params))
                    totals[form][1] += time.perf_counter() - t0
                    totals[form][0] += tokens
                finally:
                    SDPABackend.__call__ = _SHIPPED_CALL
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
