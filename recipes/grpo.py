"""GRPO on verifiable arithmetic word problems, with SSD rollouts in Ray rollout actors.

    python -m recipes.grpo --config recipes/configs/grpo.yaml        # SmolLM2-135M-Instruct on this CPU
    python -m recipes.grpo --tiny                                    # seconds: a tiny random pair

Each step: rollouts (n per prompt) -> exact-match rewards -> group-normalised advantages and the clipped
surrogate with the rollout logprobs as pi_old -> weight sync to the engines (and draft follow) -> metrics
to wandb (offline unless configured) and metrics.jsonl. `rollout-ssd plot-drift RUN_DIR` draws the drift plots.
"""

from rollout_ssd.rl.recipe import main

if __name__ == "__main__":
    main("grpo", description=__doc__)
