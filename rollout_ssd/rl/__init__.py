"""RL in practice (layer 6, above the engine): tasks and rewards, GRPO/PPO losses, the learner, Ray
rollout and learner actors, the training loop the recipes wire up, and run tracking (wandb + JSONL).

    tasks.py      verifiable arithmetic word problems (and a trivial sanity task) with their rewards
    losses.py     pure GRPO / PPO loss functions (group advantages, clipped surrogate, GAE, value loss)
    optim.py      the learner's optimizer: torch AdamW or DeepSpeed ZeRO 0-2 (CPU included)
    tiny.py       the `--tiny` preset: a seeded random target/draft pair with a character tokenizer
    learner.py    the policy learner: per-token logprobs, GRPO / PPO updates, weights for sync
    actors.py     Ray rollout actors (each wraps a RolloutEngine) and the learner actor
    trainer.py    one training step: rollouts -> rewards -> update -> weight sync (+ draft follow) -> metrics
    tracking.py   RunLogger (wandb offline by default + metrics.jsonl) and the drift plots
"""
