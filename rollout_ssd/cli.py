"""Command line: `rollout-ssd demo` (the README's main job).

The demo generates rollouts for a few built-in prompts on the embedded default with each decoding
method available (AR; SD and SSD with the built-in draft when it is installed), prints the rollouts
once and the methods' tokens/s, acceptance and hit rate side by side.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from typing import Optional

from rollout_ssd import metric_names as names

DEMO_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences what a neural network is.",
    "Tom has 3 apples and buys 5 more. How many apples does he have?",
]


def _methods(requested: str) -> list[str]:
    methods = [m.strip() for m in requested.split(",") if m.strip()]
    for m in methods:
        if m not in ("ar", "sd", "ssd"):
            raise SystemExit(f"--methods: unknown method {m!r} (choose from ar, sd, ssd)")
    return methods


def demo(args) -> int:
    from rollout_ssd import RolloutEngine, SamplingParams, SpecConfig
    from rollout_ssd.models.registry import resolve_draft

    params = SamplingParams(n=args.n, temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                            seed=args.seed, chat=True)
    rows, shown, model, notes = [], False, None, []
    for method in _methods(args.methods):
        draft = None
        if method != "ar":
            try:
                resolve_draft("default", args.model)
                draft = "default"
            except ValueError as err:
                print(f"[{method}] skipped: {err}")
                continue
        try:
            spec = SpecConfig(method=method, k=args.k)
            engine = RolloutEngine.from_pretrained(args.model, draft=draft, dtype=args.dtype, spec=spec)
        except ValueError as err:
            print(f"[{method}] skipped: {err}")
            continue
        with engine:
            rollouts = engine.sample(DEMO_PROMPTS, params, progress=True)
            m = engine.metrics()
            notes += [n for n in (_cap_note(method, m), _rule_cache_note(method, engine.strategy)) if n is not None]
        if not shown:
            for r in rollouts:
                print(f"--- prompt {r.prompt_index} sample {r.sample_index} ({len(r.token_ids)} tokens, {r.finish_reason})")
                print(f"Q: {DEMO_PROMPTS[r.prompt_index]}")
                print(f"A: {r.text.strip()}")
            shown = True
        rows.append((method, m))
        model = engine.target.model
    if model is not None:
        _table(rows, model.dtype, model.embed.device)
    for note in notes:
        print(note)
    return 0


def _cap_note(method: str, m: dict) -> Optional[str]:
    """What bounds an SSD engine's SSD plans here (`ssd/cap`, `ssd/v`, `ssd/cap_batch`: ssd/ssd_cap.py), or
    None (AR, SD, no batch size decided at, or no cap there)."""
    cap, v, batch = (m.get(names.ssd_state(k)) for k in ("cap", "v", "cap_batch"))
    if cap is None or math.isnan(cap):
        return None
    where = "" if v is None or math.isnan(v) else f", v = {v:.2f}" + (
        "" if v >= 1 else ": SSD verifies on the target's own core, beside the draft worker")
    verdict = "SSD may beat it there" if cap > 1 else "SSD cannot beat it there"
    return (f"{method}: Corollary 9's cap on SSD over the best plan measured at {batch} sequence{'s' * (batch != 1)} "
            f"(the last batch size decided at): {cap:.2f}{where} ({verdict})")


def _rule_cache_note(method: str, strategy) -> Optional[str]:
    """What an SSD engine's strategy rule started from (ssd/rule_cache.py), or None (no cache: AR, SD,
    or the cache off)."""
    cache = getattr(strategy, "rule_cache", None)
    if cache is None:
        return None
    if strategy.restored_times:
        return (f"{method}: the strategy rule started from {strategy.restored_times} times measured on this "
                f"machine by earlier runs ({cache.path})")
    return f"{method}: the strategy rule measured each plan anew (kept for the next run: {cache.path})"


def _table(rows: list[tuple[str, dict]], dtype, device) -> None:
    """The methods side by side, under a line saying what they ran on (the target's device: its GPU, or
    the CPU's kind; dtype; threads)."""
    import torch

    from rollout_ssd.models.cpu_backend import cpu_kind

    device = torch.device(device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU {cpu_kind()}"
    print(f"\n{where}, {str(dtype).replace('torch.', '')}, {torch.get_num_threads()} threads")
    print(f"{'method':<6} {'tokens':>7} {'seconds':>8} {'tokens/s':>9} {'accept':>7} {'len/round':>9} {'hit rate':>8}"
          "  rounds by strategy")
    for method, m in rows:
        accept = m.get(names.SPEC_ACCEPT_RATE)
        hit = m.get(names.SSD_HIT_RATE)
        tokens, seconds = m[names.ROLLOUT_TOKENS], m[names.ROLLOUT_SECONDS]
        rounds = m.get(names.SSD_STRATEGY_ROUNDS)  # SSD's engine picks per round; AR and SD run themselves
        chosen = ", ".join(f"{k} {v}" for k, v in rounds.items()) if rounds else f"{method} (every round)"
        print(f"{method:<6} {tokens:>7} {seconds:>8.1f} {m[names.ROLLOUT_TOKENS_PER_S]:>9.1f} "
              f"{'-' if accept is None else f'{accept:.2f}':>7} {m[names.ROLLOUT_TOKENS_PER_ROUND]:>9.2f} "
              f"{'-' if hit is None else f'{hit:.2f}':>8}  {chosen}")


def generate(args) -> int:
    """`rollout-ssd generate`: an offline dataset of rollouts (rollout_ssd/datagen.py), resumable."""
    from rollout_ssd.datagen import config_from_args, generate_dataset

    try:
        result = generate_dataset(config_from_args(args))
    except ValueError as err:
        print(f"rollout-ssd generate: error: {err}", file=sys.stderr)
        return 2
    print(f"{result.num_rows} rows in {result.output} ({result.shards_written} shards written, "
          f"{result.shards_skipped} already done)")
    return 0


def _add_generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate a resumable HF dataset of rollouts from a prompt file",
                       description="Writes DIR/data/train-*-of-*.parquet shards and DIR/manifest.json; rerun the "
                                   "same command to resume. Load with datasets.load_dataset(DIR, split='train').")
    p.add_argument("--input", required=True, help=".jsonl, .json, .parquet or a save_to_disk dataset directory")
    p.add_argument("--prompt-column", default="prompt", help="text or token-id column")
    p.add_argument("--split", default=None, help="split of an input DatasetDict")
    p.add_argument("--output", required=True)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--method", default="ar", choices=["ar", "sd", "ssd"])
    p.add_argument("--draft", default="default", help="'default', a checkpoint dir, a .gguf or 'none'")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="cpu")
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shard-size", type=int, default=64, help="prompts per shard")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template to text prompts")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.add_argument("--compile", action="store_true",
                   help="compile the decode and verify steps of the target and SD's draft (EngineConfig.compile: "
                        "minutes per shape at the start, then faster steps; for long fixed-weight jobs on a CPU)")
    p.set_defaults(func=generate)


def plot_drift(args) -> int:
    """`rollout-ssd plot-drift`: hit rate / acceptance / KL vs weight version for runs (rl/tracking.py)."""
    from rollout_ssd.rl.tracking import plot_drift as plot

    try:
        output = plot(args.runs, args.output, labels=args.labels)
    except ValueError as err:
        print(f"rollout-ssd plot-drift: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {output}")
    return 0


def _add_plot_drift_parser(sub) -> None:
    p = sub.add_parser("plot-drift", help="plot draft drift (hit rate, acceptance, KL vs weight version) of runs",
                       description="Each RUN is a run directory (its versions.jsonl, else metrics.jsonl) or a .jsonl "
                                   "file written by rollout_ssd.rl.tracking.RunLogger.")
    p.add_argument("runs", nargs="+", metavar="RUN")
    p.add_argument("--output", required=True, help="PNG to write, e.g. drift.png")
    p.add_argument("--labels", nargs="+", default=None, help="one legend label per RUN")
    p.set_defaults(func=plot_drift)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="rollout-ssd")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="generate rollouts for a few built-in prompts on the embedded default")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--methods", default="ar,sd,ssd", help="comma-separated: ar, sd, ssd")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--n", type=int, default=1)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=demo)
    _add_generate_parser(sub)
    _add_plot_drift_parser(sub)
    from rollout_ssd.serve.main import add_parser as add_serve_parser

    add_serve_parser(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
