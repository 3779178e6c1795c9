"""Compiled target steps (`EngineConfig.compile`) against the eager engine, per method, batch 1 (issue 15,
part 2). One target and draft are loaded (dtype auto, the default pair) and shared by an eager and a
compiled engine per method; each engine first runs a warm-up: `--warm-prompts` prompts the timed calls
do not use, then the timed prompts themselves, one call each, the pass repeated until it compiles no new
graph (at most three passes). A compiled engine compiles its shapes there (a graph per batch bucket and
step length; the cache length is dynamic, but a prompt longer than those seen so far can fail a guard
dynamo put on it and compile one more), so the timed calls measure the steady state an RL job reaches
after its first steps; the warm-up's seconds are reported apart. Then,
the engines take turns prompt by prompt on the held-out-template chat prompts, one `sample` call each,
greedy, fixed length (ignore_eos). Reported: tok/s per engine, compiled / eager, the warm-up's seconds,
and how many of the compiled engine's outputs equal the eager one's token for token, with the first
position where each differs (the compiled graph rounds bf16 differently, so a greedy near-tie may
fall the other way: counted, not assumed; the eager SD engine against the eager AR one is printed too,
the same question between two eager paths). With AR, a last row: transformers' `generate` in the same
dtype and the batch-1 memory roofline (the better of a bandwidth probe before the engines and one after, by
the copy and by a pure read). --compile picks the compiled engines' kind ("frozen": weights folded
in; "live": the weights stay graph inputs). --update-every-call writes new target weights before every
timed prompt (through the compiled engine's `update_weights`; the engines share the target, so both run
on them), alternating between the loaded weights and a perturbed copy, as an RL job's updates would: the
cost of following an update is then in the rates, and the graphs compiled during the timed calls are
counted (a live engine should compile none). --compile may also name "onednn": an eager engine with the
bf16 rows kernel off (kernels/bf16_rows.py), the eager bf16 linears of before that kernel, side by side.
Table, then one JSON line.

    .venv/bin/python bench/bench_compile.py --methods ar,sd
    .venv/bin/python bench/bench_compile.py --methods ar,sd --compile live --update-every-call
    .venv/bin/python bench/bench_compile.py --methods ar,sd --compile onednn,frozen,live
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch
from common import (
    add_repo_to_path,
    bench_prompts,
    load_default_pair,
    machine_note,
    memory_bandwidth,
    print_json_line,
    print_table,
)

add_repo_to_path()

from rollout_ssd import EngineConfig, RolloutEngine, SamplingParams, SpecConfig  # noqa: E402
from rollout_ssd import metric_names as names  # noqa: E402
from rollout_ssd.kernels import bf16_rows  # noqa: E402
from rollout_ssd.models.cpu_dtype import describe_auto_dtype  # noqa: E402


def first_difference(a: list[int], b: list[int]):
    """The first position where two token lists differ, None where they are equal."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def against_generate(target, prompts, new_tokens: int, ar_row: dict, modes: list[str], bw_before: dict) -> dict:
    """transformers' `generate` on the same weights in the target's dtype (greedy, fixed length, one
    prompt per call as above), and the batch-1 memory roofline: the copy bandwidth over the bytes a
    decode step must stream (bench_ar.py's `bytes_per_step`), with the better of `bw_before` (taken before
    the engines ran) and a probe taken now, as bench_ar.py does (a single probe moved between runs by far
    more than the engines did); the roofline of a pure read (`sum()`) is given too. The AR rates above
    include each call's prefill, so their share of the roofline is a lower bound."""
    from bench_ar import bytes_per_step, hf_model_from, hf_run

    hf = hf_model_from(target).to(target.model.dtype)
    hf_run(hf, prompts[:1], 4)  # warm-up
    t0 = time.perf_counter()
    tokens = sum(len(hf_run(hf, [p], new_tokens)[0]) for p in prompts)
    hf_rate = tokens / (time.perf_counter() - t0)
    bw_after = memory_bandwidth()
    bw = {k: max(bw_before[k], bw_after[k]) for k in bw_after}
    step_bytes = bytes_per_step(target.model, 1)
    roofline, read_roofline = bw["copy_gbps"] * 1e9 / step_bytes, bw["read_gbps"] * 1e9 / step_bytes
    row = {"method": "transformers generate (ar)", "eager tok/s": hf_rate, "roofline tok/s": roofline,
           "read roofline tok/s": read_roofline, "copy GB/s before, after": [bw_before["copy_gbps"], bw_after["copy_gbps"]],
           "eager % of roofline": 100 * ar_row["eager tok/s"] / roofline}
    for mode in modes:
        row[f"ours {mode} / generate"] = ar_row[f"{mode} tok/s"] / hf_rate
        row[f"{mode} % of roofline"] = 100 * ar_row[f"{mode} tok/s"] / roofline
        row[f"{mode} % of read roofline"] = 100 * ar_row[f"{mode} tok/s"] / read_roofline
    return row


def weight_sets(target, seed: int = 0) -> list[list[tuple[str, torch.Tensor]]]:
    """Two full sets of the target's weights for `update_weights`: the loaded ones, and each matrix plus
    noise of 2% of its own spread (a policy that drifted)."""
    gen = torch.Generator().manual_seed(seed)
    loaded = [(name, t.detach().clone()) for name, t in target.model.hf_parameters().items()
              if t.is_floating_point()]
    drifted = [(name, t + 0.02 * t.float().std() * torch.randn(t.shape, generator=gen).to(t.dtype)
                if t.dim() == 2 else t.clone()) for name, t in loaded]
    return [loaded, drifted]


def graphs_compiled() -> int:
    """Graphs dynamo has compiled in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def warm_up(engine, prompts, params, context) -> float:
    """One call per prompt, the pass repeated until it compiles no new graph (at most three passes), each
    call inside `context()`; returns the seconds it took."""
    t0 = time.perf_counter()
    for _ in range(3):
        before = graphs_compiled()
        with context():
            for prompt in prompts:
                engine.sample([prompt], params)
        if graphs_compiled() == before:
            break
    return time.perf_counter() - t0


COMPILED = {"frozen": "frozen", "live": "live", "onednn": False}  # --compile's engines: EngineConfig.compile


@contextlib.contextmanager
def kernels_of(mode: str):
    """Around an engine's calls: the "onednn" engine runs with the bf16 rows kernel off."""
    if mode != "onednn":
        yield
        return
    bf16_rows.set_enabled(False)
    try:
        yield
    finally:
        bf16_rows.set_enabled(True)


def run_method(method: str, modes: list[str], target, draft, warm: list, timed: list, params, args) -> tuple[dict, dict]:
    """One method: an eager engine and one compiled engine per mode, sharing the target and draft, a
    warm-up call each, then turns prompt by prompt (with --update-every-call, new target weights before
    each prompt). Returns the table row and each engine's outputs."""
    spec = SpecConfig(method=method, k=args.k)
    engines = {mode: RolloutEngine(target, spec, EngineConfig(max_batch_size=1, compile=COMPILED.get(mode, False)),
                                   None if method == "ar" else draft) for mode in ["eager"] + modes}
    sets = weight_sets(target) if args.update_every_call else None
    try:
        warm_s = {mode: warm_up(engine, warm + timed, params, lambda mode=mode: kernels_of(mode))
                  for mode, engine in engines.items()}
        seconds, tokens, outputs = {m: 0.0 for m in engines}, {m: 0 for m in engines}, {m: [] for m in engines}
        graphs_before, updates = graphs_compiled(), 0
        for i, prompt in enumerate(timed):
            if sets is not None:  # the engines share the target: one update reaches all of them
                updates += 1
                engines[modes[0]].update_weights(sets[(i + 1) % 2], version=updates)
            for mode, engine in engines.items():
                t0 = time.perf_counter()
                with kernels_of(mode):
                    out = engine.sample([prompt], params)[0]
                seconds[mode] += time.perf_counter() - t0
                tokens[mode] += len(out.token_ids)
                outputs[mode].append(list(out.token_ids))
        timed_graphs = graphs_compiled() - graphs_before
        if sets is not None:  # leave the target as loaded for the next method
            engines[modes[0]].update_weights(sets[0], version=updates + 1)
        metrics = {mode: engine.metrics() for mode, engine in engines.items()}
    finally:
        for engine in engines.values():
            engine.close()
    rate = {m: tokens[m] / seconds[m] for m in engines}
    row = {"method": method, "eager tok/s": rate["eager"]}
    for mode in modes:
        same = sum(a == b for a, b in zip(outputs["eager"], outputs[mode]))
        row.update({f"{mode} tok/s": rate[mode], f"{mode}/eager": rate[mode] / rate["eager"],
                    f"warm-up s {mode}": warm_s[mode], f"accept ({mode})": metrics[mode].get(names.SPEC_ACCEPT_RATE),
                    f"same tokens ({mode})": f"{same}/{len(timed)}",
                    f"first difference at ({mode})": [first_difference(a, b) for a, b in
                                                      zip(outputs["eager"], outputs[mode])]})
        if method == "ssd":
            row[f"SSD rounds ({mode})"] = metrics[mode].get(names.SSD_STRATEGY_ROUNDS)
    row.update({"warm-up s eager": warm_s["eager"], "updates": updates,
                "graphs compiled in timed calls": timed_graphs})
    return row, outputs


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", default="ar,sd")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--draft", default="default", help="SD's draft: default (the built-in), target-int4, or a checkpoint")
    p.add_argument("--warm-prompts", type=int, default=1, help="untimed prompts the warm-up pass starts with")
    p.add_argument("--no-hf", action="store_true", help="skip transformers' generate and the roofline row")
    p.add_argument("--compile", default="frozen",
                   help="the other engines, comma-separated: frozen, live (compiled), onednn (eager, bf16 rows kernel off)")
    p.add_argument("--update-every-call", action="store_true",
                   help="new target weights before every timed prompt (alternating loaded / drifted)")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run with no compile: AR, one prompt, 8 tokens, eager against the rows kernel off")
    args = p.parse_args(argv)
    if args.quick:
        args.methods, args.prompts, args.new_tokens, args.compile, args.no_hf = "ar", 1, 8, "onednn", True
    modes = args.compile.split(",")
    if not modes or any(m not in COMPILED for m in modes):
        p.error(f"--compile takes frozen, live and/or onednn, got {args.compile!r}")
    target, draft = load_default_pair(args.draft, dtype="auto")
    prompts = bench_prompts(target.tokenizer, "templates", args.prompts + args.warm_prompts)
    warm, timed = prompts[:args.warm_prompts], prompts[args.warm_prompts:]
    params = SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens, ignore_eos=True, seed=0)
    rows, by_method = [], {}
    bw_before = None if args.no_hf or "ar" not in args.methods.split(",") else memory_bandwidth()
    for method in args.methods.split(","):
        row, outputs = run_method(method, modes, target, draft, warm, timed, params, args)
        rows.append(row)
        by_method[method] = outputs["eager"]
        print(rows[-1], flush=True)
    if "ar" in by_method:  # the same rounding question between two eager engines: AR's decode, SD's verify
        for method, outs in by_method.items():
            if method != "ar":
                print(f"eager {method} against eager ar, first difference at:",
                      [first_difference(a, b) for a, b in zip(by_method["ar"], outs)])
    if "ar" in by_method and not args.no_hf:
        ar_row = next(r for r in rows if r["method"] == "ar")
        rows.append(against_generate(target, timed, args.new_tokens, ar_row, modes, bw_before))
        print(rows[-1], flush=True)
    op = "C++" if bf16_rows.op_in_cpp() else "Python"
    print(f"dtype auto: {describe_auto_dtype()}; bf16 rows kernel: {'on' if bf16_rows.available() else 'off'}; "
          f"its op's kernel: {op}")
    print_table(rows)
    print_json_line({"bench": "bench_compile", "machine": machine_note(), "args": vars(args), "bf16_rows_op": op,
                     "rows": rows})


if __name__ == "__main__":
    main()
