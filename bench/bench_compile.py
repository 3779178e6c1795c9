"""Compiled target steps (`EngineConfig.compile`) against the eager engine, per method, batch 1 (issue 15,
part 2). One target and draft are loaded (dtype auto, the default pair) and shared by an eager and a
compiled engine per method; each engine first runs one warm-up call on prompts the timed calls do not
use (a compiled engine compiles its decode and verify shapes there: those seconds are reported apart),
then the two take turns prompt by prompt on the held-out-template chat prompts, one `sample` call each,
greedy, fixed length (ignore_eos). Reported: tok/s per engine, compiled / eager, the warm-up call's
seconds, and how many of the compiled engine's outputs equal the eager one's token for token, with the
first position where each differs (the compiled graph rounds bf16 differently, so a greedy near-tie may
fall the other way: counted, not assumed; the eager SD engine against the eager AR one is printed too,
the same question between two eager paths). With AR, a last row: transformers' `generate` in the same
dtype and the batch-1 memory roofline. Table, then one JSON line.

    .venv/bin/python bench/bench_compile.py --methods ar,sd
"""

from __future__ import annotations

import argparse
import time

from common import add_repo_to_path, bench_prompts, machine_note, print_json_line, print_table

add_repo_to_path()

from rollout_ssd import EngineConfig, RolloutEngine, SamplingParams, SpecConfig  # noqa: E402
from rollout_ssd import metric_names as names  # noqa: E402
from rollout_ssd.models.cpu_backend import describe_auto_dtype  # noqa: E402
from rollout_ssd.models.loader import load_pretrained  # noqa: E402
from rollout_ssd.models.registry import resolve_draft  # noqa: E402


def first_difference(a: list[int], b: list[int]):
    """The first position where two token lists differ, None where they are equal."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def against_generate(target, prompts, new_tokens: int, ar_row: dict) -> dict:
    """transformers' `generate` on the same weights in the target's dtype (greedy, fixed length, one
    prompt per call as above), and the batch-1 memory roofline: the copy bandwidth over the bytes a
    decode step must stream (bench_ar.py's `bytes_per_step`). The AR rates above include each call's
    prefill, so their share of the roofline is a lower bound."""
    from bench_ar import bytes_per_step, hf_model_from, hf_run
    from common import memory_bandwidth

    hf = hf_model_from(target).to(target.model.dtype)
    hf_run(hf, prompts[:1], 4)  # warm-up
    t0 = time.perf_counter()
    tokens = sum(len(hf_run(hf, [p], new_tokens)[0]) for p in prompts)
    hf_rate = tokens / (time.perf_counter() - t0)
    roofline = memory_bandwidth()["copy_gbps"] * 1e9 / bytes_per_step(target.model, 1)
    return {"method": "transformers generate (ar)", "eager tok/s": hf_rate,
            "ours compiled / generate": ar_row["compiled tok/s"] / hf_rate, "roofline tok/s": roofline,
            "compiled % of roofline": 100 * ar_row["compiled tok/s"] / roofline,
            "eager % of roofline": 100 * ar_row["eager tok/s"] / roofline}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", default="ar,sd")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--no-hf", action="store_true", help="skip transformers' generate and the roofline row")
    args = p.parse_args(argv)
    target = load_pretrained("smollm2-135m-instruct", dtype="auto")
    draft = load_pretrained(resolve_draft("default", "smollm2-135m-instruct"), dtype="auto", with_tokenizer=False,
                            share_embedding_from=target.model)
    prompts = bench_prompts(target.tokenizer, "templates", args.prompts + 1)
    warm, timed = prompts[0], prompts[1:]
    params = SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens, ignore_eos=True, seed=0)
    rows, by_method = [], {}
    for method in args.methods.split(","):
        spec = SpecConfig(method=method, k=args.k)
        engines = {mode: RolloutEngine(target, spec, EngineConfig(max_batch_size=1, compile=mode == "compiled"),
                                       None if method == "ar" else draft) for mode in ("eager", "compiled")}
        try:
            warm_s = {}
            for mode, engine in engines.items():
                t0 = time.perf_counter()
                engine.sample([warm], params)
                warm_s[mode] = time.perf_counter() - t0
            seconds, tokens, outputs = {m: 0.0 for m in engines}, {m: 0 for m in engines}, {m: [] for m in engines}
            for prompt in timed:
                for mode, engine in engines.items():
                    t0 = time.perf_counter()
                    out = engine.sample([prompt], params)[0]
                    seconds[mode] += time.perf_counter() - t0
                    tokens[mode] += len(out.token_ids)
                    outputs[mode].append(list(out.token_ids))
            rate = {m: tokens[m] / seconds[m] for m in engines}
            metrics = {mode: engine.metrics() for mode, engine in engines.items()}
            accept = metrics["compiled"].get(names.SPEC_ACCEPT_RATE)
        finally:
            for engine in engines.values():
                engine.close()
        rows.append({"method": method, "eager tok/s": rate["eager"], "compiled tok/s": rate["compiled"],
                     "compiled/eager": rate["compiled"] / rate["eager"], "warm-up s eager": warm_s["eager"],
                     "warm-up s compiled": warm_s["compiled"], "accept (compiled)": accept,
                     "SSD rounds eager / compiled": [metrics[m].get(names.SSD_STRATEGY_ROUNDS) for m in engines]
                     if method == "ssd" else None,
                     "same tokens": f"{sum(a == b for a, b in zip(outputs['eager'], outputs['compiled']))}/{len(timed)}",
                     "first difference at": [first_difference(a, b) for a, b in zip(outputs["eager"],
                                                                                      outputs["compiled"])]})
        by_method[method] = outputs["eager"]
        print(rows[-1], flush=True)
    if "ar" in by_method:  # the same rounding question between two eager engines: AR's decode, SD's verify
        for method, outs in by_method.items():
            if method != "ar":
                print(f"eager {method} against eager ar, first difference at:",
                      [first_difference(a, b) for a, b in zip(by_method["ar"], outs)])
    if "ar" in by_method and not args.no_hf:
        rows.append(against_generate(target, timed, args.new_tokens, next(r for r in rows if r["method"] == "ar")))
        print(rows[-1], flush=True)
    print(f"dtype auto: {describe_auto_dtype()}")
    print_table(rows)
    print_json_line({"bench": "bench_compile", "machine": machine_note(), "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
