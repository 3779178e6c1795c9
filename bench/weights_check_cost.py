"""What a compiled engine's weight check costs per forward (rollout_ssd/gpu/graphs.py, `weights_key`, run
before every compiled step: a frozen step drops itself on a change, a live one remakes its packed copies):
over the model's modules listed once, against walking `model.parameters()` per call, on SmolLM2-135M
(dtype auto). Then what an update costs a live step once: `cpu_backend.pack_live` after an in-place write to
every weight (every packed copy remade; mean of --repacks). Microseconds per call (mean of --calls),
table, then a JSON line.

    .venv/bin/python bench/weights_check_cost.py
"""

from __future__ import annotations

import argparse
import time

from common import add_repo_to_path, machine_note, print_json_line, print_table

add_repo_to_path()

import torch  # noqa: E402

from rollout_ssd.gpu.graphs import weights_key  # noqa: E402
from rollout_ssd.models.cpu_backend import pack_live, packed_bf16  # noqa: E402
from rollout_ssd.models.loader import load_pretrained  # noqa: E402


def per_call_us(fn, calls: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--repacks", type=int, default=5)
    args = p.parse_args(argv)
    model = load_pretrained("smollm2-135m-instruct", dtype="auto", with_tokenizer=False).model
    modules = list(model.modules())
    rows = [{"check": "walk model.parameters() per call",
             "us per call": per_call_us(lambda: tuple((q.data_ptr(), q._version) for q in model.parameters()),
                                        args.calls)},
            {"check": "weights_key over the listed modules", "us per call": per_call_us(lambda: weights_key(modules),
                                                                                        args.calls)}]
    if packed_bf16() and model.dtype == torch.bfloat16:

        def write_all_then_repack():
            with torch.no_grad():
                for q in model.parameters():
                    q.mul_(1.0)  # an in-place write (what an update does), the values unchanged
            t0 = time.perf_counter()
            pack_live(model)
            return time.perf_counter() - t0

        write_all_then_repack()
        repack = sum(write_all_then_repack() for _ in range(args.repacks)) / args.repacks
        rows.append({"check": "pack_live after a write to every weight", "us per call": repack * 1e6})
    print_table(rows, floatfmt=".0f")
    print_json_line({"bench": "weights_check_cost", "machine": machine_note(), "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
