"""GEMM forms for the decoder's layer matrices on this CPU (why `decoder.linear` keeps row-major copies).

Thirty layers of SmolLM2-135M's matrix shapes (random float32 weights, so the 412 MB stream from
memory as in a real forward), for each row count M: the time for all 120 GEMMs in each form (forms
interleaved; the fastest of --repeats runs, the least disturbed one on a shared machine),
  colmajor x@W.T   F.linear over a column-major W (the layers' storage; what one-row decode uses)
  rowmajor W@x.T   torch.mm(W, x.T) over a row-major copy (`decoder.linear`'s multi-row form before padding)
  rowmajor x@W.T   F.linear over a row-major W (the usual nn.Linear layout, for reference)
  padded W@x.T     rowmajor W@x.T with x padded by zero rows to `cpu_backend.gemm_rows(M)`
  decoder.linear   what the decoder runs: one of the above by M and the thread count
Run:

    .venv/bin/python bench/bench_gemm.py --threads 2
    .venv/bin/python bench/bench_gemm.py --threads 1
    .venv/bin/python bench/bench_gemm.py --threads 1 --rows 2,3,4,5,7,8,9,12,13,15,16,17,19,24,31,32,64
    .venv/bin/python bench/bench_gemm.py --threads 2 --rows 2,3,4,5,7,8,9,12,13,15,16,17,19,24,31,32,64
    .venv/bin/python bench/bench_gemm.py --head     # the LM head (49152 x 576) instead; the last form
                                                    # is then `cpu_backend.head_matmul`
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from common import add_repo_to_path, machine_note, print_json_line, print_table, time_call

add_repo_to_path()

from rollout_ssd.models.cpu_backend import gemm_rows, head_matmul, linear, padded_mm_t  # noqa: E402
from rollout_ssd.models.weight_copies import WeightCopies  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # fused qkv, o, fused gate|up, down
LAYERS = 30
HEAD = [(49152, 576)]  # SmolLM2's LM head (the tied embedding), row-major as the model holds it


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", default="1,2,4,5,6,8,9,16,32,64,128")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--quick", action="store_true", help="rows 1 and 5, 2 repeats")
    p.add_argument("--head", action="store_true", help="the LM head's shape, once, instead of 30 layers")
    args = p.parse_args(argv)
    if args.quick:
        args.rows, args.repeats = "1,5", 2
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    shapes, layers = (HEAD, 1) if args.head else (SHAPES, LAYERS)
    row_major = [[torch.randn(n, k, generator=gen) for n, k in shapes] for _ in range(layers)]
    col_major = [[w.t().contiguous().t() for w in ws] for ws in row_major]
    rows = []
    forms = {"colmajor x@W.T": (col_major, F.linear),
             "rowmajor W@x.T": (row_major, lambda x, w: torch.mm(w, x.t())),
             "rowmajor x@W.T": (row_major, F.linear),
             "padded W@x.T": (row_major, lambda x, w: padded_mm_t(w, x))}
    if args.head:  # the model's head is row-major; head_matmul keeps its other forms in `copies`
        forms["head_matmul"] = (row_major, lambda x, w: head_matmul(x, w, copies))
    else:
        forms["decoder.linear"] = (col_major, lambda x, w: linear(x, w, copies, str(id(w))))
    copies = WeightCopies()  # the copies decoder.linear / head_matmul make on first use (in the warm-up)
    for m in (int(x) for x in args.rows.split(",")):
        xs = {k: torch.randn(m, k, generator=gen) for k in (576, 1536)}
        calls = {}
        for name, (weights, op) in forms.items():
            def forward(weights=weights, op=op, xs=xs):
                return [op(xs[w.shape[1]], w) for ws in weights for w in ws]
            forward()  # warm-up
            calls[name] = forward
        times = {name: [] for name in forms}
        for _ in range(args.repeats):  # forms interleaved, so a slow spell of the machine hits all alike
            for name, forward in calls.items():
                times[name] += time_call(forward, 1)
        ms = {name: 1e3 * min(ts) for name, ts in times.items()}
        rows.append({"rows": m, "padded to": gemm_rows(m), **{f"{k} ms": v for k, v in ms.items()},
                     "best": min(ms, key=ms.get)})
    print_table(rows, floatfmt=".1f")
    print_json_line({"bench": "gemm", "machine": machine_note(), "layers": layers, "shapes": shapes, "rows": rows})


if __name__ == "__main__":
    main()
