"""bf16 linear on the CPU: F.linear vs oneDNN's linear over a packed weight (models/cpu_backend.py), over
SmolLM2-135M's layer shapes (30 layers x qkv / o / gate_up / down, and the 49k-row head: 269 MB of bf16
weights per pass, so a pass streams from memory), per row count, and whether the two are bitwise equal.
Only meaningful where the CPU has bf16 units (`cpu_kind()` avx512_bf16 or amx). Table, then one JSON line.

    .venv/bin/python bench/bench_packed_bf16.py --threads 1
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import machine_note, median_seconds, print_json_line, print_table  # noqa: E402

HIDDEN, INTER, LAYERS, VOCAB = 576, 1536, 30, 49152


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", default="1,2,4,8,16,64,256")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--hint", default="none", help="the row count oneDNN packs for, or 'none' (no hint: the engine's)")
    parser.add_argument("--quick", action="store_true", help="rows 1 and 4, 3 repeats")
    args = parser.parse_args()
    if args.quick:
        args.rows, args.repeats = "1,4", 3
    torch.set_num_threads(args.threads)
    from rollout_ssd.models.cpu_backend import cpu_kind, packed_bf16

    h, inter = HIDDEN, INTER
    shapes = [(h + 2 * 192, h), (h, h), (2 * inter, h), (h, inter)] * LAYERS + [(VOCAB, h)]
    gen = torch.Generator().manual_seed(0)
    weights = [(torch.randn(o, i, generator=gen) * 0.05).to(torch.bfloat16) for o, i in shapes]
    gb = sum(w.numel() for w in weights) * 2 / 1e9
    hint = None if args.hint == "none" else int(args.hint)
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, hint) for w in weights]
    rows = []
    for m in (int(x) for x in args.rows.split(",")):
        xs = {k: torch.randn(m, k, generator=gen).to(torch.bfloat16) for k in (h, inter)}
        plain = median_seconds(lambda xs=xs: [F.linear(xs[w.shape[1]], w) for w in weights], args.repeats)
        fast = median_seconds(lambda xs=xs: [torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")
                                             for w, p in zip(weights, packed)], args.repeats)
        equal = all(torch.equal(F.linear(xs[w.shape[1]], w),
                                torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], ""))
                    for w, p in zip(weights, packed))
        rows.append({"rows": m, "F.linear ms": plain * 1e3, "F.linear GB/s": gb / plain, "packed ms": fast * 1e3,
                     "packed GB/s": gb / fast, "speedup": plain / fast, "bitwise equal": equal})
    print_table(rows)
    print_json_line({"bench": "packed_bf16", "machine": machine_note(), "cpu_kind": cpu_kind(),
                     "packed_path_on": packed_bf16(), "weights_gb": gb, "threads": args.threads, "hint": hint,
                     "rows": rows})


if __name__ == "__main__":
    main()
