"""The target's linears in int8 and int4 against the bf16 rows kernel, and a whole step of the int4 draft
(draft="target-int4", rollout_ssd/models/quant.py) against the target's, by threads and rows.

Part 1 runs SmolLM2-135M's 30 layers of linears (random weights of its shapes) plus its LM head, one
chain per call so that the weights stream from memory, through: the bf16 rows kernel (bf16_rows.py, where
the CPU has AVX-512: what a bf16 decode step runs at 1..2 rows on AMX, up to 32 with avx512_bf16, every
row count without bf16 units), torch's int8 weight-only
kernel (`aten._weight_int8pack_mm`) and torch's int4 kernel (`aten._weight_int4pack_mm_for_cpu`,
groups of 32). Part 2 times one eager decode step (`ModelRunner.decode` after a 120-token prompt)
of the target and of its int4 draft, and the seconds its int4 copies take to be made again after an
update of the target (every weight written). `--compiled` adds the int4 draft's frozen compiled steps of
1, 2 and 3 tokens at one row. Medians; one table per part; JSON last line.

    .venv/bin/python bench/int4_linears.py           # threads 1, 2; rows 1, 2, 4, 8
    .venv/bin/python bench/int4_linears.py --compiled --threads 2 --rows 1 --step-rows 1
    .venv/bin/python bench/int4_linears.py --quick
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import add_repo_to_path, frozen_step_timing, load_default_pair, machine_note, print_json_line, print_table

add_repo_to_path()
from rollout_ssd.models import bf16_rows, quant  # noqa: E402
from rollout_ssd.models.cpu_backend import linear_weights  # noqa: E402
from rollout_ssd.models.quant import Int4Weight  # noqa: E402
from rollout_ssd.runner import ModelRunner  # noqa: E402

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # wqkv, wo, w_gate_up, w_down
HEAD = (49152, 576)


def _weights(layers: int):
    out = []
    for _ in range(layers):
        for n, k in LAYER_SHAPES:
            out.append(torch.randn(n, k) * k ** -0.5)
    return out + [torch.randn(*HEAD) * 0.05]


def _median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _chain(kind: str, ws, packed, xs) -> None:
    for w, q in zip(ws, packed):
        x = xs[w.shape[1]]
        if kind == "bf16":
            bf16_rows.linear(x, q, w.shape[0])
        elif kind == "int8":
            torch.ops.aten._weight_int8pack_mm(x, *q)
        else:
            torch.ops.aten._weight_int4pack_mm_for_cpu(x, q.packed, 32, q.scales_zeros)


def linears(args) -> list[dict]:
    ws = _weights(args.layers)
    packed = {"int4": [Int4Weight(w.bfloat16(), 32) for w in ws], "int8": []}
    for w in ws:
        scale = w.abs().amax(1) / 127
        packed["int8"].append(((w / scale[:, None]).round().clamp(-127, 127).to(torch.int8), scale.bfloat16()))
    if bf16_rows.available():
        packed["bf16"] = [bf16_rows.pack(w.bfloat16()) for w in ws]
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for m in args.rows:
            xs = {k: torch.randn(m, k).bfloat16() for k in (576, 1536)}
            row = {"threads": threads, "rows": m}
            for kind in ("bf16", "int8", "int4"):
                if kind in packed:
                    row[f"{kind} ms"] = _median_ms(lambda kind=kind, xs=xs: _chain(kind, ws, packed[kind], xs), args.repeats)
            if "bf16 ms" in row:  # bf16: the rows kernel (needs AVX-512)
                row["int8 speed-up"], row["int4 speed-up"] = row["bf16 ms"] / row["int8 ms"], row["bf16 ms"] / row["int4 ms"]
            rows.append(row)
    return rows


def _step_ms(model, m: int, prompt: list[int], repeats: int) -> float:
    runner = ModelRunner(model, num_slots=m, max_len=512)
    slots = [runner.allocate() for _ in range(m)]
    runner.prefill(slots, [prompt] * m)

    def step():
        runner.decode(slots, [5] * m)
        for s in slots:
            runner.rollback(s, len(prompt))
    return _median_ms(step, repeats)


def steps(args) -> list[dict]:
    target, draft = load_default_pair("target-int4", dtype="auto")
    prompt = list(range(100, 220))
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for m in args.step_rows:
            row = {"threads": threads, "rows": m, "target ms": _step_ms(target.model, m, prompt, args.repeats),
                   "int4 draft ms": _step_ms(draft.model, m, prompt, args.repeats)}
            row["draft / target"] = row["int4 draft ms"] / row["target ms"]
            row["int4 copies remade s"] = _requantize_s(target.model, draft.model)
            rows.append(row)
    return rows


def _requantize_s(target, draft) -> float:
    """Seconds to make the draft's int4 copies again after a target update (every weight written)."""
    with torch.no_grad():
        for w, _, _, _ in linear_weights(target):
            w.add_(0)  # a write: bumps each weight's version, as update_weights' copy_ does
    t0 = time.perf_counter()
    quant.pack_live(draft)
    return time.perf_counter() - t0


def compiled_steps(args) -> list[dict]:
    """The int4 draft's frozen compiled steps of 1 token and of 2 and 3 tokens (SD's draft catch-up,
    padded), one row, after their compiles: what a compiled SD round's draft forwards cost."""
    from rollout_ssd.models.loader import load_pretrained
    from rollout_ssd.models.quant import int4_draft

    torch.set_num_threads(max(args.threads))
    draft = int4_draft(load_pretrained("smollm2-135m-instruct", dtype="auto"))
    prompt = list(range(100, 220))
    rows = []
    for t in (1, 2, 3):
        compile_s, ms = frozen_step_timing(draft.model, t, prompt, args.repeats)
        rows.append({"threads": max(args.threads), "tokens": t, "compile s": compile_s, "frozen step ms": ms})
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", default="1,2")
    p.add_argument("--rows", default="1,2,4,8")
    p.add_argument("--step-rows", default="1,3")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--compiled", action="store_true", help="also the int4 draft's frozen compiled steps (minutes)")
    p.add_argument("--quick", action="store_true", help="2 layers, 1 thread, 1 row, 3 repeats")
    args = p.parse_args(argv)
    if args.quick:
        args.threads, args.rows, args.step_rows, args.layers, args.repeats = "1", "1", "1", 2, 3
    args.threads = [int(t) for t in args.threads.split(",")]
    args.rows = [int(r) for r in args.rows.split(",")]
    args.step_rows = [int(r) for r in args.step_rows.split(",")]
    part1 = linears(args)
    print_table(part1)
    part2 = steps(args)
    print_table(part2)
    part3 = compiled_steps(args) if args.compiled else []
    if part3:
        print_table(part3)
    print_json_line({"bench": "int4_linears", "machine": machine_note(), "layers": args.layers,
                     "linears": part1, "steps": part2, "compiled": part3})


if __name__ == "__main__":
    main()
