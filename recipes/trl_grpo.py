"""GRPO with TRL's own `GRPOTrainer`, rollouts from a rollout_ssd engine (AR, SD or SSD) through
`rollout_ssd.integrations.trl.make_rollout_func` (needs `pip install --no-deps 'trl>=1.16'`).

    python -m recipes.trl_grpo --tiny --method ssd --max-steps 3        # seconds on CPU: a tiny random pair
    python -m recipes.trl_grpo --model HF_DIR --draft HF_DRAFT_DIR --method sd --chat --max-steps 100

The trainer and the engine load the same HF directory; before each new optimizer step's rollouts the
adapter copies the trainer's weights into the engine, so every rollout is sampled from the current
policy. Task "digits" (reward: share of digits; the tiny default) or "arithmetic" (exact match on
generated word problems, rollout_ssd.rl.tasks). Per-step reward and loss are printed, then the
engine's metrics.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="recipes.trl_grpo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="a tiny random target/draft pair (built under --output-dir)")
    p.add_argument("--model", help="HF model directory (trainer and engine); required without --tiny")
    p.add_argument("--draft", help="HF draft directory for --method sd/ssd (default with --tiny: the tiny draft)")
    p.add_argument("--method", choices=("ar", "sd", "ssd"), default="ssd")
    p.add_argument("--max-steps", type=int, default=3)
    p.add_argument("--task", choices=("digits", "arithmetic"), help="default: digits with --tiny, else arithmetic")
    p.add_argument("--chat", action="store_true", help="conversational prompts (the tokenizer's chat template)")
    p.add_argument("--max-completion-length", type=int, help="default: 8 with --tiny, else 64")
    p.add_argument("--learning-rate", type=float, help="default: 3e-3 with --tiny, else 1e-6")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:i], for the trainer and the engine")
    p.add_argument("--output-dir", default="runs/trl_grpo")
    args = p.parse_args(argv)
    if not args.tiny and not args.model:
        p.error("pass --model HF_DIR, or --tiny")
    if args.max_steps < 1:
        p.error("--max-steps must be >= 1")
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental in TRL

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from rollout_ssd import RolloutEngine, SpecConfig
    from rollout_ssd.integrations.trl import make_rollout_func
    from rollout_ssd.rl.tasks import ALPHABET, get_task

    out = Path(args.output_dir)
    model_dir, draft_dir = args.model, args.draft
    if args.tiny:
        from rollout_ssd.rl.tiny import build_tiny_pair

        target, draft = build_tiny_pair(out / "tiny_models", ALPHABET)
        model_dir, draft_dir = model_dir or str(target), draft_dir or str(draft)
    task = args.task or ("digits" if args.tiny else "arithmetic")
    build_dataset, score = get_task(task)
    dataset = build_dataset(256, seed=0)
    if args.chat:
        dataset = dataset.map(lambda row: {"prompt": [{"role": "user", "content": row["prompt"]}]})

    def reward(completions, answer, **kwargs):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [score(text, ans) for text, ans in zip(texts, answer)]

    spec = SpecConfig(method=args.method) if args.method == "ar" or draft_dir else None
    if spec is None:
        raise SystemExit(f"recipes.trl_grpo: --method {args.method} needs --draft")
    engine = RolloutEngine.from_pretrained(model_dir, draft=draft_dir if args.method != "ar" else None, spec=spec,
                                           dtype="float32", device=args.device)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(args.device)
    config = GRPOConfig(
        output_dir=str(out), use_cpu=args.device == "cpu", bf16=False, use_vllm=False, report_to="none",
        save_strategy="no", logging_steps=1, max_steps=args.max_steps, per_device_train_batch_size=8,
        num_generations=4, max_completion_length=args.max_completion_length or (8 if args.tiny else 64),
        learning_rate=args.learning_rate or (3e-3 if args.tiny else 1e-6), seed=0)
    try:
        trainer = GRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=reward, args=config,
                              train_dataset=dataset, rollout_func=make_rollout_func(engine))
        trainer.train()
        metrics = engine.metrics()
    finally:
        engine.close()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    for h in logs:
        print(f"step {h['step']}: reward {h['reward']:.3f}  loss {h['loss']:.4g}")
    shown = ("sync/version", "rollout/tokens", "rollout/tokens_per_s", "spec/accept_rate", "ssd/hit_rate")
    print("engine:", {k: round(v, 3) if isinstance(v, float) else v for k, v in metrics.items() if k in shown})
    return logs


if __name__ == "__main__":
    main()
