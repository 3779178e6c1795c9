"""Probe (issue 15): which form of a few-row bf16 linear streams the weights fastest *inside one compiled
graph*, with the weights as graph inputs (what a live compiled step needs: rollout_ssd/gpu/graphs.py),
against inductor's frozen GEMMs (weights folded in; decode autotuned onto its C++ templates). One graph
runs the 121 linears of SmolLM2-135M's shapes (30 layers x qkv, o, gate_up, down, and the 49k-row head:
269 MB of random bf16 weights, more than the caches hold) on `--rows` rows; called from Python one
linear at a time, each call's own overhead would hide the kernels. Forms:
- "onednn packed": `rollout_ssd::packed_linear` (cpu_backend: oneDNN's packed linear as an opaque op);
- "bf16 rows": `rollout_ssd::bf16_rows` (models/bf16_rows.py: the bf16 rows kernel, this CPU's build) over
  its packed copy, an opaque op too;
- "reduction": (W.float() * x.float()).sum(-1), a loop inductor generates and fuses, the weight as is;
- "blocked 16": the same over a copy of W blocked [N/16, K, 16] (16 outputs a vector);
- "frozen": F.linear on frozen weights (inductor packs them; autotuned between oneDNN and its C++
  templates at one row, oneDNN alone at more, as gpu/inductor.py's compile_options does).
Median ms per graph call, GB/s over the weight bytes, compile seconds; table, then one JSON line.

    .venv/bin/python bench/probe_gemv_in_graph.py --rows 1
    .venv/bin/python bench/probe_gemv_in_graph.py --rows 5 --forms "onednn packed,reduction,blocked 16,frozen"
"""

from __future__ import annotations

import argparse
import time

import torch
from common import add_repo_to_path, machine_note, median, print_json_line, print_table

add_repo_to_path()

import rollout_ssd.models.cpu_backend  # noqa: E402,F401  (registers rollout_ssd::packed_linear)
from rollout_ssd.models import bf16_rows  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # SmolLM2-135M's layer linears, [out, in]
FORMS = ("onednn packed", "bf16 rows", "reduction", "blocked 16", "frozen")


def weights(layers: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = [torch.randn(n, k, generator=gen).to(torch.bfloat16) * 0.05 for _ in range(layers) for n, k in SHAPES]
    return out + [torch.randn(49152, 576, generator=gen).to(torch.bfloat16) * 0.05]


def onednn(x, p):
    return torch.ops.rollout_ssd.packed_linear(x, p, None, p.shape[0])


def rows_kernel(x, p):  # p: bf16_rows.pack(w), [N / 64, K / 2, 64, 2] (every N here is a multiple of 64)
    return torch.ops.rollout_ssd.bf16_rows(x, p, None, p.shape[0] * 64)


def reduction(x, w):  # [M, N]: the weight row stays in cache across the M rows
    return (w.float()[:, None, :] * x.float()[None]).sum(-1).t()


def blocked(x, b):  # b [N/16, K, 16]
    return (b.float()[:, None] * x.float()[None, :, :, None]).sum(2).permute(1, 0, 2).reshape(x.shape[0], -1)


class Frozen(torch.nn.Module):
    def __init__(self, ws):
        super().__init__()
        self.ws = torch.nn.ParameterList([torch.nn.Parameter(w, requires_grad=False) for w in ws])

    def forward(self, xs):
        return chain(torch.nn.functional.linear, list(self.ws), xs)


def chain(linear, ws, xs) -> torch.Tensor:
    """Every linear on its input width's rows; a scalar from a few outputs of each keeps all of them live."""
    acc = torch.zeros((), dtype=torch.float32)
    for w in ws:  # the input width is dim 1 of a weight [N, K], its packed copy, and its blocked one
        acc = acc + linear(xs[w.shape[1]], w)[:, :8].float().sum()
    return acc


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--forms", default=",".join(FORMS))
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args(argv)
    ws = weights(args.layers)
    mb = sum(w.numel() for w in ws) * 2 / 1e6
    gen = torch.Generator().manual_seed(1)
    xs = {k: torch.randn(args.rows, k, generator=gen).to(torch.bfloat16) for k in (576, 1536)}
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in ws]
    blocks = [w.view(w.shape[0] // 16, 16, w.shape[1]).permute(0, 2, 1).contiguous() for w in ws]
    rows_packed = [bf16_rows.pack(w) for w in ws] if bf16_rows.available() else None
    xs.update({k // 2: xs[k] for k in (576, 1536)})  # the rows kernel's copies have K / 2 pairs as dim 1
    rows = []
    with torch.inference_mode():
        want = chain(torch.nn.functional.linear, ws, xs).item()
        for form in args.forms.split(","):
            if form == "frozen":
                options = {"freezing": True, "max_autotune": args.rows == 1, "max_autotune_gemm_backends": "CPP,ATEN"}
                with torch._inductor.config.patch(options):
                    fn = torch.compile(Frozen(ws).eval(), fullgraph=True)
                    call = lambda fn=fn: fn(xs)  # noqa: E731
                    t0 = time.perf_counter()
                    got = call().item()
                    compile_s = time.perf_counter() - t0
                    times = [time_once(call) for _ in range(args.repeats)]
            else:
                if form == "bf16 rows" and rows_packed is None:
                    print("bf16 rows: the kernel does not run here, skipped")
                    continue
                linear, inputs = {"onednn packed": (onednn, packed), "bf16 rows": (rows_kernel, rows_packed),
                                  "reduction": (reduction, ws),
                                  "blocked 16": (blocked, blocks)}[form]
                fn = torch.compile(lambda inputs, xs, linear=linear: chain(linear, inputs, xs), fullgraph=True)
                call = lambda fn=fn, inputs=inputs: fn(inputs, xs)  # noqa: E731
                t0 = time.perf_counter()
                got = call().item()
                compile_s = time.perf_counter() - t0
                times = [time_once(call) for _ in range(args.repeats)]
            ms = 1e3 * median(times)
            rows.append({"form": form, "rows": args.rows, "ms per graph": ms, "GB/s": mb / ms,
                         "compile s": compile_s, "result": got, "F.linear result": want})
            print(rows[-1], flush=True)
    print_table(rows)
    print_json_line({"bench": "probe_gemv_in_graph", "machine": machine_note(), "args": vars(args),
                     "weight_mb": mb, "rows": rows})


def time_once(call) -> float:
    t0 = time.perf_counter()
    call()
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
