"""AR decode through the engine at larger batches, dtype auto: decode tok/s (`rollout/decode_tokens_per_s`)
and the call's tok/s (prefill included) of one greedy call per batch size over ragged held-out-template
prompts (so rows have different lengths and attention reads a mask), after a short warm-up call at each
size, per engine `max_batch_size` asked ("default": EngineConfig's, 128 on a CPU as memory allows; a
batch past it runs in turns as sequences finish). Table, JSON last line.

    .venv/bin/python bench/ar_engine_batches.py                 # batches 4 and 16, 48 tokens
    .venv/bin/python bench/ar_engine_batches.py --batches 128 --max-batch-sizes 32,64,default --new-tokens 96
"""

from __future__ import annotations

import argparse
import time

from common import add_repo_to_path, bench_prompts, machine_note, print_json_line, print_table

add_repo_to_path()

from rollout_ssd import RolloutEngine, SamplingParams, SpecConfig  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="4,16")
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--max-batch-sizes", default="default", help="engine max_batch_size values (or 'default')")
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    rows = []
    for mbs in args.max_batch_sizes.split(","):
        size = None if mbs == "default" else int(mbs)
        with RolloutEngine.from_pretrained(spec=SpecConfig(method="ar"), max_batch_size=size) as engine:
            prompts = bench_prompts(engine.target.tokenizer, "templates", max(batches))
            for b in batches:
                engine.sample(prompts[:b], SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True))
                engine.metrics(reset=True)
                t0 = time.perf_counter()
                out = engine.sample(prompts[:b], SamplingParams(temperature=0, max_new_tokens=args.new_tokens,
                                                                ignore_eos=True))
                seconds = time.perf_counter() - t0
                rows.append({"max_batch_size": f"{mbs} ({engine.runner.cache.num_slots})", "batch": b,
                             "dtype": str(engine.target.model.dtype).replace("torch.", ""),
                             "decode tok/s": engine.metrics()["rollout/decode_tokens_per_s"],
                             "call tok/s": sum(len(r.token_ids) for r in out) / seconds})
    print_table(rows)
    print_json_line({"bench": "ar_engine_batches", "machine": machine_note(), "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
