"""The bf16 rows kernel (kernels/bf16_rows.py) against oneDNN's packed linear and against the
float32 linears a float32 model runs, per row count (issue 15, part 2: a verify of K + 1 tokens should
cost about one decode step; dtype "auto" should pick the faster dtype). One pass runs the 121 linears of
SmolLM2-135M's shapes (30 layers x qkv, o, gate_up, down, and the 49k-row head: 269 MB of random bf16
weights, more than the caches hold) on M rows, each linear called from Python as the eager decoder calls
it; the kernels take turns pass by pass. Reported per thread count and M: median ms per pass, GB/s over
the bf16 weight bytes, kernel / oneDNN speed, the pass's cost in one-row passes of the same kernel, the
same weights in float32 through `cpu_backend.linear` (the decoder's float32 form for M rows: column-major
MKL, or the float32 rows kernel where the CPU kind runs it) and float32 / kernel time; and the read
bandwidth of a plain sum over the same bytes (torch's reduction: what a kernel that only reads the weight
could reach). Table, then one JSON line. The kernel is this CPU's build (`bf16_rows.variant()`: "dot" with
avx512_bf16, "widened" on AVX-512 without bf16 units, where oneDNN's bf16 is emulated).

    .venv/bin/python bench/bf16_rows_kernel.py
    .venv/bin/python bench/bf16_rows_kernel.py --rows 1,2,4,8,16,24,32,64,128,256 --no-onednn
"""

from __future__ import annotations

import argparse

import torch
from common import add_repo_to_path, machine_note, median, print_json_line, print_table

add_repo_to_path()


from rollout_ssd.kernels import bf16_rows  # noqa: E402
from rollout_ssd.models import cpu_backend  # noqa: E402
from rollout_ssd.models.weight_copies import WeightCopies  # noqa: E402


def timed(fn, clock) -> float:
    t0 = clock()
    fn()
    return clock() - t0


SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # SmolLM2-135M's layer linears, [out, in]


def weights(layers: int, seed: int = 0) -> list[torch.Tensor]:
    """SmolLM2-135M's linears, random bf16: `layers` layers' four, then the LM head."""
    gen = torch.Generator().manual_seed(seed)
    out = [torch.randn(n, k, generator=gen).to(torch.bfloat16) * 0.05 for _ in range(layers) for n, k in SHAPES]
    return out + [torch.randn(49152, 576, generator=gen).to(torch.bfloat16) * 0.05]


def main(argv=None):
    import time

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,2,3,4,5,6,7,8,10,12,16,24,32")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--no-onednn", action="store_true", help="leave oneDNN's packed bf16 linear out")
    p.add_argument("--quick", action="store_true", help="a seconds-long smoke run: 1 and 4 rows, one thread, 2 layers")
    args = p.parse_args(argv)
    if args.quick:
        args.rows, args.threads, args.layers, args.repeats = "1,4", "1", 2, 3
    if not bf16_rows.available():
        if args.quick:  # a smoke run on a CPU without the kernel: nothing to time, not a failure
            return print("the bf16 rows kernel does not run here (no AVX-512, or no C compiler)")
        raise SystemExit("the bf16 rows kernel does not run here (no AVX-512, or no C compiler)")
    ws = weights(args.layers)
    nbytes = sum(w.numel() for w in ws) * 2
    kernel_w = [bf16_rows.pack(w) for w in ws]
    onednn_w = [] if args.no_onednn else [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in ws]
    f32_w = [w.float().t().contiguous().t() for w in ws]  # a float32 model's layout (cpu_backend.layer_weight)
    f32_copies = [WeightCopies() for _ in ws]
    flat = torch.cat([w.flatten() for w in kernel_w])
    gen = torch.Generator().manual_seed(1)
    rows_out = []
    for threads in map(int, args.threads.split(",")):
        torch.set_num_threads(threads)
        flat.sum()
        sum_gbps = nbytes / median([timed(flat.sum, time.perf_counter) for _ in range(args.repeats)]) / 1e9
        one_row = None
        for m in map(int, args.rows.split(",")):
            xs = {k: torch.randn(m, k, generator=gen).to(torch.bfloat16) for k in (576, 1536)}

            def kernel(xs=xs):
                for w, packed in zip(ws, kernel_w):
                    bf16_rows.linear(xs[w.shape[1]], packed, w.shape[0])

            def onednn(xs=xs):
                for w, packed in zip(ws, onednn_w):
                    torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], packed, None, "none", [], "")

            xf = {k: v.float() for k, v in xs.items()}

            def float32(xf=xf):
                with torch.inference_mode():
                    for w, copies in zip(f32_w, f32_copies):
                        cpu_backend.linear(xf[w.shape[1]], w, copies, "w")

            forms = {"kernel": kernel, "float32": float32, **({} if args.no_onednn else {"onednn": onednn})}
            for fn in forms.values():
                fn()
            times = {name: [] for name in forms}
            for _ in range(args.repeats):
                for name, fn in forms.items():
                    times[name].append(timed(fn, time.perf_counter))
            k_s, f_s = median(times["kernel"]), median(times["float32"])
            o_s = median(times["onednn"]) if "onednn" in times else None
            one_row = k_s if m == 1 else one_row
            rows_out.append({"threads": threads, "rows": m, "kernel ms": 1e3 * k_s, "kernel GB/s": nbytes / k_s / 1e9,
                             "onednn ms": o_s and 1e3 * o_s, "kernel / onednn speed": o_s and o_s / k_s,
                             "kernel pass in 1-row passes": k_s / one_row if one_row else None,
                             "float32 ms": 1e3 * f_s, "float32 / kernel time": f_s / k_s, "sum() GB/s": sum_gbps})
            print(rows_out[-1], flush=True)
    print(f"weights: {nbytes / 1e6:.0f} MB bf16; kernel build: {bf16_rows.variant()}; machine: {machine_note()}")
    print_table(rows_out)
    print_json_line({"bench": "bf16_rows_kernel", "build": bf16_rows.variant(), "machine": machine_note(), "args": vars(args),
                     "rows": rows_out})


if __name__ == "__main__":
    main()
