"""GEMM forms for the decoder's layer matrices on this CPU (why `decoder.linear` keeps row-major copies).

Thirty layers of SmolLM2-135M's matrix shapes (random float32 weights, so the 412 MB stream from
memory as in a real forward), for each row count M: the time for all 120 GEMMs in three forms,
  colmajor x@W.T   F.linear over a column-major W (the layers' storage; what one-row decode uses)
  rowmajor W@x.T   torch.mm(W, x.T) over a row-major copy (what `decoder.linear` uses for M >= 2)
  rowmajor x@W.T   F.linear over a row-major W (the usual nn.Linear layout, for reference)
Run:

    .venv/bin/python bench/bench_gemm.py --threads 2
    .venv/bin/python bench/bench_gemm.py --threads 1
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from common import machine_note, median, print_json_line, print_table, time_call

SHAPES = [(768, 576), (576, 576), (3072, 576), (576, 1536)]  # fused qkv, o, fused gate|up, down
LAYERS = 30


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", default="1,2,4,5,6,8,9,16,32,64,128")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--quick", action="store_true", help="rows 1 and 5, 2 repeats")
    args = p.parse_args(argv)
    if args.quick:
        args.rows, args.repeats = "1,5", 2
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    row_major = [[torch.randn(n, k, generator=gen) for n, k in SHAPES] for _ in range(LAYERS)]
    col_major = [[w.t().contiguous().t() for w in ws] for ws in row_major]
    rows = []
    forms = {"colmajor x@W.T": (col_major, F.linear),
             "rowmajor W@x.T": (row_major, lambda x, w: torch.mm(w, x.t())),
             "rowmajor x@W.T": (row_major, F.linear)}
    for m in (int(x) for x in args.rows.split(",")):
        xs = {k: torch.randn(m, k, generator=gen) for k in (576, 1536)}
        ms = {}
        for name, (weights, op) in forms.items():
            def forward(weights=weights, op=op, xs=xs):
                return [op(xs[w.shape[1]], w) for ws in weights for w in ws]
            forward()  # warm-up
            ms[name] = 1e3 * median(time_call(forward, args.repeats))
        rows.append({"rows": m, **{f"{k} ms": v for k, v in ms.items()}, "best": min(ms, key=ms.get)})
    print_table(rows, floatfmt=".1f")
    print_json_line({"bench": "gemm", "machine": machine_note(), "layers": LAYERS, "shapes": SHAPES, "rows": rows})


if __name__ == "__main__":
    main()
