"""One call of the op `rollout_ssd::bf16_rows` (what a compiled step calls per linear) on a small weight,
so the call's own cost shows: its C++ kernel, or with $ROLLOUT_SSD_BF16_ROWS_OP=0 the Python fallback
(the dispatcher calling back into the interpreter, then the kernel through ctypes). Run it once each way,
one after the other; next to it the ctypes call `bf16_rows.linear` from Python, the same sum without the
dispatcher. Median microseconds per call over `--calls`, `--threads` threads. Table, then one JSON line.

    .venv/bin/python bench/op_call.py && ROLLOUT_SSD_BF16_ROWS_OP=0 .venv/bin/python bench/op_call.py
    .venv/bin/python bench/op_call.py --quick
"""

from __future__ import annotations

import argparse
import sys

import torch
from common import add_repo_to_path, machine_note, median, print_json_line, print_table, time_call

add_repo_to_path()

from rollout_ssd.models import bf16_rows  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=int, default=64, help="the weight is size x size")
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="200 calls")
    args = p.parse_args(argv)
    if args.quick:
        args.calls = 200
    if not bf16_rows.available():
        sys.exit("the bf16 rows kernel does not run here (it needs AVX-512 and a C compiler)")
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(args.size, args.size, generator=gen).to(torch.bfloat16)
    x = torch.randn(1, args.size, generator=gen).to(torch.bfloat16)
    packed = bf16_rows.pack(w)
    op = torch.ops.rollout_ssd.bf16_rows.default
    forms = {"op": lambda: op(x, packed, None, args.size), "ctypes linear": lambda: bf16_rows.linear(x, packed, args.size)}
    rows = []
    for name, fn in forms.items():
        for _ in range(50):
            fn()
        rows.append({"call": name, "us per call": 1e6 * median(time_call(fn, args.calls))})
    kernel = "C++" if bf16_rows.op_in_cpp() else "Python"
    print(f"op's kernel: {kernel}; weight {args.size} x {args.size}, one row, {args.threads} thread(s)")
    print_table(rows)
    print_json_line({"bench": "op_call", "machine": machine_note(), "args": vars(args), "op_kernel": kernel, "rows": rows})


if __name__ == "__main__":
    main()
