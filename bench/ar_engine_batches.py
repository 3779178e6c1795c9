"""AR decode through the engine at larger batches, dtype auto: decode tok/s (`rollout/decode_tokens_per_s`)
of one greedy call per batch size over ragged held-out-template prompts (so rows have different lengths
and attention reads a mask), after a short warm-up call at each size. Table, JSON last line.

    .venv/bin/python bench/ar_engine_batches.py                 # batches 4 and 16, 48 tokens
"""

from __future__ import annotations

import argparse

from common import add_repo_to_path, bench_prompts, machine_note, print_json_line, print_table

add_repo_to_path()

from rollout_ssd import RolloutEngine, SamplingParams, SpecConfig  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="4,16")
    p.add_argument("--new-tokens", type=int, default=48)
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    engine = RolloutEngine.from_pretrained(spec=SpecConfig(method="ar"))
    prompts = bench_prompts(engine.target.tokenizer, "templates", max(batches))
    rows = []
    with engine:
        for b in batches:
            engine.sample(prompts[:b], SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True))
            engine.metrics(reset=True)
            engine.sample(prompts[:b], SamplingParams(temperature=0, max_new_tokens=args.new_tokens, ignore_eos=True))
            rows.append({"batch": b, "dtype": str(engine.target.model.dtype).replace("torch.", ""),
                         "decode tok/s": engine.metrics()["rollout/decode_tokens_per_s"]})
    print_table(rows)
    print_json_line({"bench": "ar_engine_batches", "machine": machine_note(), "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
