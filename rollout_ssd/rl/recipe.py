"""The command line both recipes share: parse, validate the whole config before any work, log it,
run the trainer with a progress bar, and close every actor and process on the way out.

    python -m recipes.grpo [--config recipes/configs/grpo.yaml] [--tiny] [--set learner.optim.lr=1e-5 ...]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Optional

log = logging.getLogger("rollout_ssd.recipe")


def parse_args(algorithm: str, argv: Optional[list[str]] = None, description: str = "") -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"recipes.{algorithm}", description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML or JSON config file (see recipes/configs/)")
    p.add_argument("--tiny", action="store_true", help="the seconds-long preset: a tiny random model pair")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one config key, e.g. --set steps=10 --set follow.mode=follow")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def main(algorithm: str, argv: Optional[list[str]] = None, description: str = "") -> list[dict]:
    """Run the recipe; returns the per-step metrics. Bad configs exit with status 2 and one line."""
    from rollout_ssd.rl.config import load_config

    args = parse_args(algorithm, argv, description)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        cfg = load_config(args.config, args.overrides, tiny=args.tiny, algorithm=algorithm)
        if cfg.algorithm != algorithm:
            raise ValueError(f"this is the {algorithm} recipe, but the config says algorithm={cfg.algorithm!r}")
    except ValueError as err:
        print(f"recipes.{algorithm}: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    return run(cfg, progress=not args.no_progress)


def run(cfg, progress: bool = True) -> list[dict]:
    from tqdm import tqdm

    from rollout_ssd.rl.tracking import RunLogger
    from rollout_ssd.rl.trainer import RLTrainer

    config = cfg.to_dict()
    log.info("config: %s", json.dumps(config, sort_keys=True))
    t = cfg.tracking
    with RunLogger(t.out_dir, config, wandb_mode=t.wandb_mode, project=t.project, run_name=t.run_name,
                   group=t.group) as logger, RLTrainer(cfg, logger) as trainer:
        bar = tqdm(total=cfg.steps, desc=f"{cfg.algorithm} steps", disable=not progress)

        def show(m: dict) -> None:
            bar.update(1)
            bar.set_postfix(reward=f"{m.get('reward/mean', 0):.3f}", tok_s=f"{m['rollout/tokens_per_s']:.1f}",
                            hit=f"{m.get('ssd/hit_rate', float('nan')):.2f}",
                            acc=f"{m.get('spec/accept_rate', float('nan')):.2f}")

        try:
            return trainer.run(on_step=show)
        finally:
            bar.close()
