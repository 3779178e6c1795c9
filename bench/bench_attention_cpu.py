"""Attention of a few queries per row on a CPU cache: PyTorch SDPA (its CPU flash kernel, with a
visibility mask) against the decoder's explicit form (`attention.explicit_attention`), at SmolLM2's
attention shape (9 query / 3 KV heads, head dim 64), bf16 and float32; time per call (median of
`--calls` after a warm-up) and max error against float64 SDPA on the same inputs. Table, JSON last line.

    .venv/bin/python bench/bench_attention_cpu.py
"""

from __future__ import annotations

import argparse
from functools import partial

import torch
import torch.nn.functional as F
from common import add_repo_to_path, machine_note, print_json_line, print_table, time_call

add_repo_to_path()

from rollout_ssd.models.attention import explicit_attention  # noqa: E402

SHAPES = ((1, 1, 200), (4, 1, 200), (4, 5, 200), (24, 1, 300), (8, 5, 300))  # batch, queries, keys


def per_call(fn, calls: int) -> float:
    """Seconds per call: the middle of `calls` timed calls after 10 untimed ones."""
    for _ in range(10):
        fn()
    return sorted(time_call(fn, calls))[calls // 2]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=100)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for b, t, length in SHAPES:
            g = torch.Generator().manual_seed(b * 100 + t)
            q = torch.randn(b, 9, t, 64, generator=g).to(dtype)
            k, v = (torch.randn(b, 3, length, 64, generator=g).to(dtype) for _ in range(2))
            mask = torch.rand(b, 1, t, length, generator=g) > 0.1
            mask[..., 0] = True
            ref = F.scaled_dot_product_attention(q.double(), k.double().repeat_interleave(3, 1),
                                                 v.double().repeat_interleave(3, 1), attn_mask=mask, scale=0.125)
            sdpa = partial(F.scaled_dot_product_attention, q, k, v, attn_mask=mask, scale=0.125, enable_gqa=True)
            explicit = partial(explicit_attention, q, k, v, mask, 0.125)
            rows.append({"dtype": str(dtype).replace("torch.", ""), "batch x queries x keys": f"{b} x {t} x {length}",
                         "SDPA us": 1e6 * per_call(sdpa, args.calls), "explicit us": 1e6 * per_call(explicit, args.calls),
                         "SDPA error": (sdpa().double() - ref).abs().max().item(),
                         "explicit error": (explicit().double() - ref).abs().max().item()})
    print_table(rows, floatfmt=".3g")
    print_json_line({"bench": "attention_cpu", "machine": machine_note(), "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
