"""The ops a step runs over its logits (float copy, softmax, log-softmax, argmax) at a verify's row counts,
with and without the allocator setting the engine makes on a CPU (models/cpu_memory.py: freed blocks kept
for reuse), each side in its own fresh process, taking turns. Over SmolLM2's 49,152-token vocabulary;
rows 5 / 24 / 120 are a K = 4 verify at batch 1, an AR step at the GRPO batch and its verify. Table of
ms per call (each process's median, and the median over the processes of a side), then one JSON line.

    .venv/bin/python bench/logits_ops.py
    .venv/bin/python bench/logits_ops.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

VOCAB = 49152


def _ops(xb, xf, tokens) -> dict:
    import torch

    return {"float copy": lambda: xb.float(), "softmax": lambda: torch.softmax(xb.float(), -1),
            "log_softmax + gather": lambda: torch.log_softmax(xb.float(), -1).gather(1, tokens),
            "argmax bf16": lambda: xb.argmax(-1), "argmax float32": lambda: xf.argmax(-1)}


def child(rows: list[int], repeats: int) -> dict:
    """In this process: the setting as the environment says, then median ms per op and row count."""
    import torch
    from common import median_seconds

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from rollout_ssd.models.cpu_memory import keep_freed_memory

    applied = keep_freed_memory()
    gen = torch.Generator().manual_seed(0)
    out = {}
    for n in rows:
        xb = (torch.randn(n, VOCAB, generator=gen) * 3).to(torch.bfloat16)
        xf = xb.float()
        tokens = torch.randint(0, VOCAB, (n, 1), generator=gen)
        for name, fn in _ops(xb, xf, tokens).items():
            out[f"{n}|{name}"] = median_seconds(fn, repeats) * 1e3
    return {"applied": applied, "ms": out}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="5,24,120")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--rounds", type=int, default=2, help="processes per side, taking turns")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="24 rows, 5 repeats, one round")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.rows, args.repeats, args.rounds = "24", 5, 1
    rows = [int(r) for r in args.rows.split(",")]
    if args.child:
        import torch

        torch.set_num_threads(args.threads)
        print(json.dumps(child(rows, args.repeats)))
        return
    from common import machine_note, median, print_json_line, print_table

    runs = {"off": [], "on": []}
    for _ in range(args.rounds):
        for side, value in (("off", "0"), ("on", "1")):
            env = {k: v for k, v in os.environ.items() if k not in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")}
            env["ROLLOUT_SSD_KEEP_FREED_MEMORY"] = value
            cmd = [sys.executable, __file__, "--child", "--rows", args.rows, "--repeats", str(args.repeats),
                   "--threads", str(args.threads)]
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, timeout=600)
            result = json.loads(done.stdout.strip().splitlines()[-1])
            assert result["applied"] == (side == "on"), result  # the setting took effect only where asked
            runs[side].append(result["ms"])
    table = []
    for key in runs["off"][0]:
        n, op = key.split("|")
        off, on = (median([r[key] for r in runs[side]]) for side in ("off", "on"))
        table.append({"rows": int(n), "op": op, "ms, kept off": off, "ms, kept on": on, "off / on": off / on,
                      "off, each process": " ".join(f"{r[key]:.2f}" for r in runs["off"]),
                      "on, each process": " ".join(f"{r[key]:.2f}" for r in runs["on"])})
    print_table(table)
    print_json_line({"bench": "logits_ops", "machine": machine_note(), "args": vars(args), "rows": table,
                     "runs": runs})


if __name__ == "__main__":
    main()
