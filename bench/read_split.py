"""What reading the weights matrix by matrix costs against one large read (issue 15, part 2: the batch-1
memory roofline). The same bytes as SmolLM2-135M's 121 linears in bf16 (30 layers x qkv, o, gate_up,
down, and the 49k-row head: 269 MB, more than the caches hold) are summed three ways, taking turns (the order
reversed every other round): as 121 matrices one call each (the decoder's access pattern), as 121 slices of one buffer, and as
the one buffer; next to them bench/common.py's bandwidth probe (the roofline's denominator in bench_ar
and bench_compile). Reported per round: GB/s of each and the matrices' share of the one read. The
machine's bandwidth moves over minutes, so only the ratios within a round are read. Table, then one JSON
line.

    .venv/bin/python bench/read_split.py
    .venv/bin/python bench/read_split.py --quick
"""

from __future__ import annotations

import argparse

import torch
from common import add_repo_to_path, machine_note, median, memory_bandwidth, print_json_line, print_table, time_call

add_repo_to_path()

from rollout_ssd.models.cpu_backend import describe_auto_dtype  # noqa: E402

HIDDEN, INTER, KV, VOCAB, LAYERS = 576, 1536, 192, 49152, 30  # SmolLM2-135M


def shapes() -> list[tuple[int, int]]:
    per_layer = [(HIDDEN + 2 * KV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)]
    return per_layer * LAYERS + [(VOCAB, HIDDEN)]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=15, help="timed passes per form and round (median)")
    p.add_argument("--quick", action="store_true", help="one round of 3 passes")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.repeats = 1, 3
    mats = [torch.randn(s).to(torch.bfloat16) for s in shapes()]
    sizes = [m.numel() for m in mats]
    flat = torch.randn(sum(sizes)).to(torch.bfloat16)
    slices = list(torch.split(flat, sizes))
    nbytes = flat.numel() * 2
    forms = {"121 matrices": lambda: [m.sum() for m in mats], "121 slices of one buffer": lambda: [s.sum() for s in slices],
             "one buffer": lambda: flat.sum()}
    rows = []
    for r in range(args.rounds):
        row = {"round": r + 1}
        for name, fn in (list(forms.items()) if r % 2 == 0 else list(forms.items())[::-1]):
            fn()
            row[f"{name} GB/s"] = nbytes / median(time_call(fn, args.repeats)) / 1e9
        probe = memory_bandwidth()
        row.update({"probe copy GB/s": probe["copy_gbps"], "probe read GB/s": probe["read_gbps"],
                    "matrices / one buffer": row["121 matrices GB/s"] / row["one buffer GB/s"]})
        rows.append(row)
        print(row, flush=True)
    print(f"dtype auto: {describe_auto_dtype()}; {torch.get_num_threads()} thread(s); {nbytes / 1e6:.0f} MB per pass")
    print_table(rows)
    print_json_line({"bench": "read_split", "machine": machine_note(), "args": vars(args), "bytes": nbytes, "rows": rows})


if __name__ == "__main__":
    main()
