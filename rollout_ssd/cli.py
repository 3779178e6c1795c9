"""Command line: `rollout-ssd demo` (the README's main job: rollout_ssd/demo.py), `generate` (an offline
dataset of rollouts), `plot-drift` and `serve`."""

from __future__ import annotations

import argparse
import logging
import sys


def _methods(requested: str) -> list[str]:
    methods = [m.strip() for m in requested.split(",") if m.strip()]
    for m in methods:
        if m not in ("ar", "sd", "ssd"):
            raise SystemExit(f"--methods: unknown method {m!r} (choose from ar, sd, ssd)")
    return methods


def demo(args) -> int:
    """`rollout-ssd demo` (rollout_ssd/demo.py)."""
    from rollout_ssd import demo as demo_run

    args.methods = _methods(args.methods)
    return demo_run.run(args)


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


def _plotted(command: str, draw) -> int:
    """Run a plot command's `draw()` (which returns the PNG's path); a bad run or file is an error, exit 2."""
    try:
        output = draw()
    except ValueError as err:
        print(f"rollout-ssd {command}: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {output}")
    return 0


def plot_drift(args) -> int:
    """`rollout-ssd plot-drift`: hit rate / acceptance / KL vs weight version for runs (rl/tracking.py)."""
    from rollout_ssd.rl.tracking import plot_drift as plot

    return _plotted("plot-drift", lambda: plot(args.runs, args.output, labels=args.labels))


def _add_plot_drift_parser(sub) -> None:
    p = sub.add_parser("plot-drift", help="plot draft drift (hit rate, acceptance, KL vs weight version) of runs",
                       description="Each RUN is a run directory (its versions.jsonl, else metrics.jsonl) or a .jsonl "
                                   "file written by rollout_ssd.rl.tracking.RunLogger.")
    p.add_argument("runs", nargs="+", metavar="RUN")
    p.add_argument("--output", required=True, help="PNG to write, e.g. drift.png")
    p.add_argument("--labels", nargs="+", default=None, help="one legend label per RUN")
    p.set_defaults(func=plot_drift)


def plot_run(args) -> int:
    """`rollout-ssd plot-run`: one run's reward, KL, step time and acceptance as a PNG (rl/plots.py)."""
    from rollout_ssd.rl.plots import plot_run as plot

    return _plotted("plot-run", lambda: plot(args.run, args.output))


def _add_plot_run_parser(sub) -> None:
    p = sub.add_parser("plot-run", help="plot one RL run: reward, KL to the initial policy, step time by phase "
                                        "and by live batch, acceptance and hit rate by policy version",
                       description="OUT is a run's tracking.out_dir (its metrics.jsonl and versions.jsonl) or a "
                                   "metrics.jsonl file; no wandb needed.")
    p.add_argument("run", metavar="OUT")
    p.add_argument("--output", default=None, help="PNG to write (default: OUT/run.png)")
    p.set_defaults(func=plot_run)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="rollout-ssd")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="generate rollouts for a few built-in prompts on the embedded default")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--draft", default="default", help="SD's and SSD's draft: 'default' (the built-in one) or a "
                                                       "checkpoint directory")
    p.add_argument("--methods", default="ar,sd,ssd", help="comma-separated: ar, sd, ssd")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--n", type=int, default=1)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=demo)
    _add_generate_parser(sub)
    _add_plot_drift_parser(sub)
    _add_plot_run_parser(sub)
    from rollout_ssd.serve.main import add_parser as add_serve_parser

    add_serve_parser(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
