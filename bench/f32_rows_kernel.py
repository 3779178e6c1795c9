"""The float32 rows kernel (kernels/f32_rows.py) against MKL's forms, and the engines with it
on and off, side by side in one process.

Part "linears": SmolLM2-135M's 30 layers of linears plus its LM head (random weights of its shapes),
one chain per call so that they stream from memory, ms per chain, by threads and rows: MKL's x @ W.T
over column-major storage (the decoder's one-row form, and its 2..8-row form on AVX-512), MKL's W @ x.T
over a row-major copy (the AVX2 form), and the kernel (this CPU's build; `--isa avx2` also times the
AVX2 build where the CPU runs both).

Part "steps": the target's eager decode step and verify steps of K+1 = 3..5 tokens at batch 1
(`ModelRunner.extend` after a 120-token prompt), kernel off and on: the verify's cost in decode steps.

Part "engines": AR, SD with the default draft (K = 3) and SD with the int4 draft (K = 2) at batch 1,
greedy, `--prompts` held-out-template chat prompts one at a time, `--new-tokens` each; every engine
runs with the kernel off, then on, `--repeats` times over (decode tok/s over all runs of each). Greedy
tokens must equal AR's with the kernel off (the forms differ in float32 rounding only: a near-tie may
flip, reported, not hidden).

    .venv/bin/python bench/f32_rows_kernel.py
    .venv/bin/python bench/f32_rows_kernel.py --parts linears --threads 1,2 --rows 1,2,4,8
    .venv/bin/python bench/f32_rows_kernel.py --quick
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from bench_ssd import run
from common import add_repo_to_path, bench_prompts, load_default_pair, machine_note, median_seconds, print_json_line, print_table

add_repo_to_path()
from rollout_ssd import RolloutEngine, SpecConfig  # noqa: E402
from rollout_ssd.kernels import f32_rows  # noqa: E402
from rollout_ssd.models.loader import load_draft  # noqa: E402
from rollout_ssd.runner import ModelRunner  # noqa: E402

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # wqkv, wo, w_gate_up, w_down
HEAD = (49152, 576)


def linears(args) -> list[dict]:
    torch.manual_seed(0)
    ws = [torch.randn(n, k) * k ** -0.5 for _ in range(args.layers) for n, k in LAYER_SHAPES]
    ws.append(torch.randn(*HEAD) * 0.05)
    column_major = [w.t().contiguous().t() for w in ws]
    kernels = {f"kernel {kind}": (f32_rows.load(kind), f32_rows.TILES[kind]) for kind in args.isa}
    packed = {name: [f32_rows.pack(w, tile) for w in ws] for name, (_, tile) in kernels.items()}
    megabytes = sum(w.numel() * 4 for w in ws) / 1e6
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for m in args.rows:
            xs = {k: torch.randn(m, k) for k in (576, 1536)}
            forms = {"MKL x @ W.T": lambda xs=xs: [F.linear(xs[w.shape[1]], w) for w in column_major],
                     "MKL W @ x.T": lambda xs=xs: [torch.mm(w, xs[w.shape[1]].t()) for w in ws]}
            for name, kernel in kernels.items():
                forms[name] = lambda kernel=kernel, name=name, xs=xs: [
                    f32_rows.linear(xs[w.shape[1]], p, w.shape[0], kernel=kernel) for w, p in zip(ws, packed[name])]
            row = {"threads": threads, "rows": m}
            row.update({f"{name} ms": median_seconds(fn, args.repeats) * 1e3 for name, fn in forms.items()})
            best_mkl = min(row["MKL x @ W.T ms"], row["MKL W @ x.T ms"])
            first = next(iter(kernels))
            row["best MKL / kernel"] = best_mkl / row[f"{first} ms"]
            row["kernel GB/s"] = megabytes / row[f"{first} ms"]
            rows.append(row)
    return rows


def steps(args, target) -> list[dict]:
    runner = ModelRunner(target.model, num_slots=1, max_len=512)
    slot = runner.allocate()
    prompt = list(range(100, 220))
    runner.prefill([slot], [prompt])
    out = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        row = {"threads": threads}
        for on in (False, True):
            f32_rows.set_enabled(on)
            tag = "on" if on else "off"
            for t in (1, 3, 4, 5):
                def step(t=t):
                    runner.extend([slot], [[5] * t])
                    runner.rollback(slot, len(prompt))
                row[f"{t} tok {tag} ms"] = median_seconds(step, args.repeats) * 1e3
            for t in (3, 4, 5):
                row[f"verify {t} / decode, {tag}"] = row[f"{t} tok {tag} ms"] / row[f"1 tok {tag} ms"]
        out.append(row)
    f32_rows.set_enabled(True)
    return out


def engines(args, target, prompts) -> list[dict]:
    pairs = {"ar": (None, SpecConfig(method="ar")),
             "sd default K=3": (load_draft("default", target, "smollm2-135m-instruct", dtype="auto"),
                                SpecConfig(method="sd", k=3)),
             "sd target-int4 K=2": (load_draft("target-int4", target, "smollm2-135m-instruct", dtype="auto"),
                                    SpecConfig(method="sd", k=2))}
    built = {name: RolloutEngine(target, spec, draft=draft) for name, (draft, spec) in pairs.items()}
    totals = {(name, on): [None, 0, 0.0, None] for name in built for on in (False, True)}
    try:
        for engine in built.values():  # warm-up: first-use copies and kernels, untimed
            for on in (False, True):
                f32_rows.set_enabled(on)
                run(engine, prompts[:1], 0.0, 8, one_at_a_time=True)
        for _ in range(args.repeats):
            for name, engine in built.items():
                for on in (False, True):
                    f32_rows.set_enabled(on)
                    engine.metrics(reset=True)
                    t0 = time.perf_counter()
                    ids, tokens, _ = run(engine, prompts, 0.0, args.new_tokens, one_at_a_time=True)
                    m = engine.metrics()
                    t = totals[(name, on)]
                    t[0] = ids if t[0] is None else t[0]
                    t[1] += tokens
                    t[2] += time.perf_counter() - t0
                    t[3] = m.get("spec/accept_rate")
    finally:
        f32_rows.set_enabled(True)
        for engine in built.values():
            engine.close()
    reference = totals[("ar", False)][0]
    rows = []
    for name in built:
        off, on = totals[(name, False)], totals[(name, True)]
        rows.append({"engine": name, "off tok/s": off[1] / off[2], "on tok/s": on[1] / on[2],
                     "on / off": (on[1] / on[2]) / (off[1] / off[2]),
                     "on / AR off": (on[1] / on[2]) / (totals[("ar", False)][1] / totals[("ar", False)][2]),
                     "accept": on[3], "greedy == AR off": [off[0] == reference, on[0] == reference]})
    ar_on = totals[("ar", True)][1] / totals[("ar", True)][2]
    for row in rows:
        row["on / AR on"] = row["on tok/s"] / ar_on
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default="linears,steps,engines")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--rows", default="1,2,3,4,5,8")
    p.add_argument("--isa", default="", help="comma list of builds to time in part linears (default: this CPU's)")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--quick", action="store_true", help="2 layers, 1 thread, rows 1 and 4, 3 repeats, short engines")
    args = p.parse_args(argv)
    if not f32_rows.available():
        raise SystemExit("the float32 rows kernel does not run here (no AVX-512F / AVX2+FMA, or no C compiler)")
    if args.quick:
        args.threads, args.rows, args.layers, args.repeats, args.prompts, args.new_tokens = "1", "1,4", 2, 3, 1, 8
    args.threads = [int(t) for t in args.threads.split(",")]
    args.rows = [int(r) for r in args.rows.split(",")]
    args.isa = [k for k in args.isa.split(",") if k] or [f32_rows.isa()]
    parts = set(args.parts.split(","))
    result = {"bench": "f32_rows_kernel", "machine": machine_note()}
    print(machine_note())
    if "linears" in parts:
        result["linears"] = linears(args)
        print_table(result["linears"])
    target = None
    if parts & {"steps", "engines"}:
        target, _ = load_default_pair("default", dtype="auto")
        if target.model.dtype != torch.float32:  # the engine loads bf16 here: its steps never reach this kernel
            print(f"dtype auto is {target.model.dtype} on this CPU: the engine's steps do not use the float32 "
                  "kernel, so the steps and engines parts are skipped")
            result["skipped"] = sorted(parts & {"steps", "engines"})
            parts -= {"steps", "engines"}
    if "steps" in parts:
        result["steps"] = steps(args, target)
        print_table(result["steps"])
    if "engines" in parts:
        torch.set_num_threads(max(args.threads))
        prompts = bench_prompts(target.tokenizer, "templates", args.prompts)
        result["engines"] = engines(args, target, prompts)
        print_table(result["engines"])
    print_json_line(result)


if __name__ == "__main__":
    main()
