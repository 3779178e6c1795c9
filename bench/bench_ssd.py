"""AR vs SD vs SSD on the default pair (issue 4), one run, side by side.

For each batch size and temperature: tokens/s of AR, SD (neural draft) and SSD (draft worker on its
own core, Theorem 12 fan-out, neural backup, strategy rule on), SSD's hit rate, acceptance, T_p, the
strategy the rule chose, and Theorem 7's predicted speedup (from the engine's live estimates) next
to the measured SSD/AR ratio. Greedy runs also check that SD and SSD tokens equal AR's. Run:

    .venv/bin/python bench/bench_ssd.py            # batches 1,4,16; greedy and T=1
    .venv/bin/python bench/bench_ssd.py --quick    # batch 1, greedy, short
"""

from __future__ import annotations

import argparse
import time

import torch
from common import add_repo_to_path, machine_note, print_json_line, print_table

add_repo_to_path()

from rollout_ssd import EngineConfig, RolloutEngine, SamplingParams, SpecConfig  # noqa: E402
from rollout_ssd.distill import build_prompts, chat_prompt_ids  # noqa: E402
from rollout_ssd.models.loader import load_pretrained  # noqa: E402
from rollout_ssd.models.registry import resolve_draft  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--batches", default="1,4,16")
    p.add_argument("--temperatures", default="0,1")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=48)
    args = p.parse_args(argv)
    if args.quick:
        args.batches, args.temperatures, args.new_tokens = "1", "0", 32
    return args


def run(engine, prompts, temperature, new_tokens):
    params = SamplingParams(temperature=temperature, max_new_tokens=new_tokens, ignore_eos=True, seed=0)
    engine.metrics(reset=True)
    t0 = time.perf_counter()
    out = engine.sample(prompts, params)
    seconds = time.perf_counter() - t0
    return [r.token_ids for r in out], sum(len(r.token_ids) for r in out) / seconds, engine.metrics()


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(1)  # SSD pins target and draft to one core each: compare like with like
    target = load_pretrained("smollm2-135m-instruct", dtype="float32")
    draft = load_pretrained(resolve_draft("default", "smollm2-135m-instruct"), dtype="float32",
                            with_tokenizer=False, share_embedding_from=target.model)
    batches = [int(b) for b in args.batches.split(",")]
    temps = [float(t) for t in args.temperatures.split(",")]
    all_prompts = chat_prompt_ids(target.tokenizer, build_prompts(0, max(batches), seed=0).heldout)
    rows = []
    for temp in temps:
        for batch in batches:
            prompts = all_prompts[:batch]
            cfg = EngineConfig(max_batch_size=batch, max_model_len=max(map(len, prompts)) + args.new_tokens + 8)
            ar_tokens, ar_rate, _ = run(RolloutEngine(target, SpecConfig(method="ar"), cfg), prompts, temp,
                                        args.new_tokens)
            sd_tokens, sd_rate, sd_m = run(RolloutEngine(target, SpecConfig(method="sd", k=args.k), cfg, draft=draft),
                                           prompts, temp, args.new_tokens)
            with RolloutEngine(target, SpecConfig(method="ssd", k=args.k), cfg, draft=draft) as ssd_engine:
                ssd_tokens, ssd_rate, m = run(ssd_engine, prompts, temp, args.new_tokens)
            rows.append({
                "batch": batch, "T": temp, "AR tok/s": ar_rate, "SD tok/s": sd_rate, "SSD tok/s": ssd_rate,
                "SD/AR": sd_rate / ar_rate, "SSD/AR": ssd_rate / ar_rate, "SSD/SD": ssd_rate / sd_rate,
                "predicted": m.get("ssd/predicted_speedup"), "hit": m.get("ssd/hit_rate"),
                "accept": m.get("spec/accept_rate"), "T_p": m.get("ssd/T_p"), "strategy": m.get("ssd/strategy"),
                "greedy==AR": (sd_tokens == ar_tokens and ssd_tokens == ar_tokens) if temp == 0 else None,
                "SD accept": sd_m.get("spec/accept_rate"),
            })
    print_table(rows)
    print_json_line({"bench": "ssd", "machine": machine_note(), "k": args.k, "new_tokens": args.new_tokens,
                     "rows": rows})


if __name__ == "__main__":
    main()
