"""The decoder layer kernel (kernels/layer_kernel.py) against the module layers, step by step
(issue 15, part 2: a batch-1 step at the speed its weights are read; a verify of K + 1 tokens close to one
decode step). One eager step of the default target (`runner.extend` after a prompt, then a rollback) of T
tokens in one row, and of R rows of one token, with the kernel on and off in turns; medians in ms, the
kernel's speedup, and its step in one-token kernel steps. The rows past `cpu_backend.layer_kernel_rows()` show
where the module layers (oneDNN's linears on AMX) catch up, which is how `MAX_ROWS` is set per CPU kind.
Table, then one JSON line.

    .venv/bin/python bench/layer_kernel.py
    .venv/bin/python bench/layer_kernel.py --tokens 1,4,8,12 --rows 2,8 --threads 1,2
"""

from __future__ import annotations

import argparse

import torch
from common import load_default_pair, machine_note, median_seconds, print_json_line, print_table

from rollout_ssd.kernels import layer_kernel  # noqa: E402  (common put the repo on the path)
from rollout_ssd.models import cpu_backend  # noqa: E402  (common put the repo on the path)
from rollout_ssd.runner import ModelRunner  # noqa: E402


def step_ms(model, rows: int, tokens: int, prompt_len: int, repeats: int) -> float:
    """Median ms of one step of `tokens` tokens in each of `rows` rows after a prompt of `prompt_len`."""
    runner = ModelRunner(model, num_slots=rows, max_len=prompt_len + tokens + 8)
    slots = [runner.allocate() for _ in range(rows)]
    prompt = [100 + i % 5000 for i in range(prompt_len)]
    for slot in slots:
        runner.prefill([slot], [prompt])

    def step():
        runner.extend(slots, [[5] * tokens] * rows, last_only=True)
        for slot in slots:
            runner.rollback(slot, prompt_len)
    return median_seconds(step, repeats) * 1e3


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="1,2,3,4,5,6,8,10,12", help="tokens per step in one row")
    p.add_argument("--rows", default="2,4,8,12", help="rows of one token per step")
    p.add_argument("--threads", default="2")
    p.add_argument("--prompt-len", type=int, default=150)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--quick", action="store_true", help="a seconds-long smoke run: 1 and 4 tokens, 2 rows, 3 repeats")
    args = p.parse_args(argv)
    if args.quick:
        args.tokens, args.rows, args.repeats = "1,4", "2", 3
    if not layer_kernel.available():
        if args.quick:  # a smoke run on a CPU without the kernel: nothing to time, not a failure
            return print("the layer kernel does not run here (no AVX-512, or no C compiler)")
        raise SystemExit("the layer kernel does not run here (no AVX-512, or no C compiler)")
    target, _ = load_default_pair(dtype="auto")
    model = target.model
    if model.dtype != torch.bfloat16:
        raise SystemExit(f"dtype auto is {model.dtype} on this CPU: the layer kernel serves bf16 models")
    limit = cpu_backend.layer_kernel_rows()
    shapes = [(1, int(t)) for t in args.tokens.split(",")] + [(int(r), 1) for r in args.rows.split(",")]
    out = []
    with torch.inference_mode():
        for threads in map(int, args.threads.split(",")):
            torch.set_num_threads(threads)
            one = None
            for rows, tokens in shapes:
                times = {True: [], False: []}
                for _ in range(2):  # in turns, twice: the machine's drift falls on both
                    for on in (True, False):
                        layer_kernel.set_enabled(on)
                        if rows * tokens > limit:  # past the limit too, to show where the module layers catch up
                            cpu_backend._LAYER_ROWS = rows * tokens
                        times[on].append(step_ms(model, rows, tokens, args.prompt_len, args.repeats))
                        cpu_backend._LAYER_ROWS = None
                kernel_ms, modules_ms = min(times[True]), min(times[False])
                one = kernel_ms if (rows, tokens) == (1, 1) else one
                out.append({"threads": threads, "rows": rows, "tokens": tokens, "kernel ms": kernel_ms,
                            "modules ms": modules_ms, "speedup": modules_ms / kernel_ms,
                            "in 1-token kernel steps": kernel_ms / one if one else None,
                            "kernel taken": rows * tokens <= limit})
    layer_kernel.set_enabled(True)
    print_table(out)
    print(f"cpu kind: {cpu_backend.cpu_kind()}; max_rows: {limit}; prompt: {args.prompt_len} tokens; "
          f"machine: {machine_note()}")
    print_json_line({"bench": "layer_kernel", "cpu_kind": cpu_backend.cpu_kind(), "max_rows": limit,
                     "machine": machine_note(), "args": vars(args), "rows": out})


if __name__ == "__main__":
    main()
