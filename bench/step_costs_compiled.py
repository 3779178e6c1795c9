"""What SSD's round costs on each side of a 2-core CPU, compiled: frozen compiled steps of the target and
of its int4 draft, by thread count and tokens per step.

SSD beats SD only where the draft side's tree (a glue forward of K+1 tokens and K tree steps over the
branches) fits inside the target's verify, and where the target's verify on its own core (the worker holds
the other) costs little more than SD's verify on every core. This times the pieces with the fastest
steps this package has on a CPU (`ModelRunner.use_static_steps(compiled="frozen")`, one row after a
120-token prompt, medians after each step's compile): the int4 draft's steps of 1, 4 and 8 tokens on one
thread (a chain step, a glue of K = 3, a tree step of 8 branches: one causal row stands in for the
branches, the same linears' rows) and its SD steps on two threads (1 token, and 2: a catch-up), and
the target's decode and 4-token verify on one and two threads.
Each step compiles for a minute or more.

    .venv/bin/python bench/step_costs_compiled.py
"""

from __future__ import annotations

import argparse

import torch
from common import add_repo_to_path, frozen_step_timing, machine_note, print_json_line, print_table

add_repo_to_path()
from rollout_ssd.models.loader import load_pretrained  # noqa: E402
from rollout_ssd.models.quant import int4_draft  # noqa: E402

PLAN = (("int4 draft", 1, 1), ("int4 draft", 1, 4), ("int4 draft", 1, 8), ("int4 draft", 2, 1), ("int4 draft", 2, 2),
        ("target", 1, 1), ("target", 1, 4), ("target", 2, 1), ("target", 2, 4))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args(argv)
    target = load_pretrained("smollm2-135m-instruct", dtype="auto")
    draft = int4_draft(target)
    prompt = list(range(100, 220))
    rows = []
    for name, threads, t in PLAN:
        torch.set_num_threads(threads)
        compile_s, ms = frozen_step_timing((draft if name == "int4 draft" else target).model, t, prompt, args.repeats)
        rows.append({"model": name, "threads": threads, "tokens": t, "compile s": compile_s, "step ms": ms})
        print(rows[-1], flush=True)
    print(machine_note())
    print_table(rows)
    print_json_line({"bench": "step_costs_compiled", "machine": machine_note(), "dtype": str(target.model.dtype),
                     "steps": rows})


if __name__ == "__main__":
    main()
