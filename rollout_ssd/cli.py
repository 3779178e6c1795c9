"""Command line: `rollout-ssd demo` (the README's main job)."""

from __future__ import annotations

import argparse
import logging
import sys

DEMO_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences what a neural network is.",
    "Tom has 3 apples and buys 5 more. How many apples does he have?",
]


def demo(args) -> int:
    from rollout_ssd import RolloutEngine, SamplingParams, SpecConfig

    engine = RolloutEngine.from_pretrained(args.model, dtype=args.dtype, spec=SpecConfig(method="ar"))
    params = SamplingParams(n=args.n, temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                            seed=args.seed, chat=True)
    with engine:
        rollouts = engine.sample(DEMO_PROMPTS, params, progress=True)
        m = engine.metrics()
    for r in rollouts:
        print(f"--- prompt {r.prompt_index} sample {r.sample_index} ({len(r.token_ids)} tokens, {r.finish_reason})")
        print(f"Q: {DEMO_PROMPTS[r.prompt_index]}")
        print(f"A: {r.text.strip()}")
    print(f"\nAR ({engine.target.model.dtype}): {m['rollout/tokens']} tokens in {m['rollout/seconds']:.1f} s "
          f"= {m['rollout/tokens_per_s']:.1f} tokens/s")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="rollout-ssd")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="generate rollouts for a few built-in prompts on the embedded default")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--n", type=int, default=2)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=demo)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
