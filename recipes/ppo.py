"""PPO on verifiable arithmetic word problems, with SSD rollouts in Ray rollout actors.

    python -m recipes.ppo --config recipes/configs/ppo.yaml
    python -m recipes.ppo --tiny

Each step: rollouts -> exact-match rewards (terminal) -> a value head and GAE -> clipped surrogate +
clipped value loss -> weight sync to the engines (and draft follow) -> metrics (wandb + metrics.jsonl).
"""

from rollout_ssd.rl.recipe import main

if __name__ == "__main__":
    main("ppo", description=__doc__)
