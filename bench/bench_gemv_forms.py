"""One row through a bf16 linear on the CPU, in the forms PyTorch offers (issue 15, part 2's question:
does a second thread help a decode step's GEMVs?).

Per SmolLM2-135M weight shape (fused qkv, o, fused gate_up, down, the 49k-row head): oneDNN's linear over
the packed weight (the engine's form, models/cpu_backend.py), F.linear, torch.mv, W @ x.T, each at one
and two intra-op threads, and the packed form split in two halves run at once on two Python threads of
one intra-op thread each. Median of repeated calls on one weight: the layer shapes (0.7-3.5 MB) then
sit in the CPU's caches, so only the head (57 MB) reads memory as a decode step does. Table, JSON last line.

    .venv/bin/python bench/bench_gemv_forms.py
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from common import add_repo_to_path, machine_note, median, print_json_line, print_table, time_call

add_repo_to_path()

from rollout_ssd.models import cpu_backend  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]


def median_us(fn, repeats: int = 200) -> float:
    for _ in range(10):
        fn()
    return median(time_call(fn, repeats)) * 1e6


class SecondThread:
    """A Python thread with one intra-op thread that runs one call while the caller runs another."""

    def __init__(self):
        self.go, self.done, self.fn, self.out = threading.Event(), threading.Event(), None, None
        threading.Thread(target=self._loop, daemon=True).start()

    def _loop(self):
        torch.set_num_threads(1)
        while True:
            self.go.wait()
            self.go.clear()
            self.out = self.fn()
            self.done.set()

    def both(self, mine, theirs):
        self.fn = theirs
        self.go.set()
        out = mine()
        self.done.wait()
        self.done.clear()
        return out, self.out


def measure(n: int, k: int, second: SecondThread) -> dict:
    """GB/s of each form for one [n, k] weight and one row (module docstring)."""
    lp = torch.ops.mkldnn._linear_pointwise
    w = torch.randn(n, k, dtype=torch.bfloat16) * 0.02
    x = torch.randn(1, k, dtype=torch.bfloat16)
    packed = cpu_backend._pack(w)
    halves = [cpu_backend._pack(w[: n // 2].contiguous()), cpu_backend._pack(w[n // 2:].contiguous())]
    mb = n * k * 2 / 1e6
    row = {"shape": f"{n}x{k}", "MB": mb}
    forms = {"packed": lambda: lp(x, packed, None, "none", [], ""), "F.linear": lambda: F.linear(x, w),
             "mv": lambda: torch.mv(w, x[0]), "W@x.T": lambda: torch.mm(w, x.T)}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for name, fn in forms.items():
            row[f"{name} t{threads} GB/s"] = mb / median_us(fn) * 1e3
    torch.set_num_threads(1)
    row["packed halves, 2 threads GB/s"] = mb / median_us(lambda: second.both(
        lambda: lp(x, halves[0], None, "none", [], ""), lambda: lp(x, halves[1], None, "none", [], ""))) * 1e3
    return row


def main():
    if not cpu_backend.packed_bf16():
        raise SystemExit(f"no packed bf16 linear on this CPU ({cpu_backend.cpu_kind()})")
    second = SecondThread()
    with torch.inference_mode():
        rows = [measure(n, k, second) for n, k in SHAPES]
    print_table(rows, floatfmt=".1f")
    print_json_line({"bench": "gemv_forms", "machine": machine_note(), "rows": rows})


if __name__ == "__main__":
    main()
