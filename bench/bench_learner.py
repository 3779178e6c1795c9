"""The learner's step and the drift diagnostics of one GRPO step (issue 49), each against its old path.

    .venv/bin/python bench/bench_learner.py              # SmolLM2-135M + its draft, 32 rollouts x 256 tokens
    .venv/bin/python bench/bench_learner.py --quick      # the tiny random pair, 8 x 16 tokens: seconds

Part 1 (learner): one `Learner.step` on the same rollouts (the no-grad scoring pass, the KL-to-initial
pass on `kl_initial_rollouts` rows, forward and backward, AdamW) with float32 forwards and with bf16
autocast (LearnerConfig.autocast "off" and "bf16"), interleaved, median of --repeats after one warm-up
step each; the ratio, and `time/kl_initial_s` (its share of the bf16 step).
Part 2 (diagnostics): drift/kl_target_draft on the step's rollouts, the old way (its first 16) and on
RLConfig.drift_max_rollouts of them; per step, the subset's cost spread over drift_every steps, and its
share of a step of --rollout-seconds (the rollout phase, measured by the recipe) + the bf16 learner step.

The rollouts are random token ids (the costs depend on shapes alone), four samples per prompt.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time

from common import add_repo_to_path, machine_note, print_json_line, print_table

add_repo_to_path()

import torch  # noqa: E402

from rollout_ssd.draft.drift import kl_target_draft  # noqa: E402
from rollout_ssd.kernels.cpu import cpu_kind  # noqa: E402
from rollout_ssd.rl.config import RLConfig  # noqa: E402
from rollout_ssd.rl.learner import Learner, LearnerConfig, RolloutBatch  # noqa: E402
from rollout_ssd.rl.optim import OptimConfig  # noqa: E402

OLD_DRIFT_ROLLOUTS = 16  # LearnerWorker.drift's cap before issue 49


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the tiny random pair, 8 rollouts x 16 tokens")
    p.add_argument("--rollouts", type=int, default=32)
    p.add_argument("--tokens", type=int, default=256, help="completion tokens per rollout")
    p.add_argument("--prompt-tokens", type=int, default=48)
    p.add_argument("--micro-batch", type=int, default=4, help="LearnerConfig.micro_batch (recipes/configs/grpo.yaml's)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rollout-seconds", type=float, default=8.0,
                   help="the rollout phase's seconds a step is taken to have (issue 49: 7.6-8.9 s at 8 x 4 x 256)")
    args = p.parse_args(argv)
    if args.quick:
        args.rollouts, args.tokens, args.prompt_tokens, args.repeats, args.micro_batch = 8, 16, 8, 1, 4
        args.rollout_seconds = 0.5
    return args


def load_models(quick: bool):
    from rollout_ssd.models.loader import load_draft, load_pretrained

    if quick:
        from rollout_ssd.rl.tasks import ALPHABET
        from rollout_ssd.rl.tiny import TinyConfig, build_tiny_pair

        target, draft = build_tiny_pair(tempfile.mkdtemp(prefix="bench_learner_"), ALPHABET, TinyConfig(seed=0))
        policy = load_pretrained(str(target), dtype="float32", with_tokenizer=False).model
        return policy, load_pretrained(str(draft), dtype="float32", with_tokenizer=False,
                                       share_embedding_from=policy).model
    target = load_pretrained("smollm2-135m-instruct", dtype="float32", with_tokenizer=False)
    return target.model, load_draft("default", target, "smollm2-135m-instruct", dtype="float32").model


def make_batch(args, vocab: int) -> RolloutBatch:
    rng = random.Random(0)
    rows = args.rollouts
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt_tokens)] for _ in range(rows // 4) for _ in range(4)]
    completions = [[rng.randrange(vocab) for _ in range(args.tokens)] for _ in range(rows)]
    rewards = [float(rng.random() < 0.5) for _ in range(rows)]
    return RolloutBatch(prompts, completions, [[0.0] * args.tokens for _ in range(rows)], rewards, 4)


def alternate(items, repeat: int) -> list:
    """The variants in order on even repeats and reversed on odd ones (ABBA): neither always runs first."""
    items = list(items)
    return items if repeat % 2 == 0 else items[::-1]


def bench_learner(args, policy, batch) -> dict:
    config = LearnerConfig(micro_batch=args.micro_batch, old_logprobs="learner", optim=OptimConfig(lr=1e-9))
    learner = Learner(policy, config)
    modes = {"float32": None, "bf16 autocast": torch.bfloat16}
    times: dict[str, list] = {m: [] for m in modes}
    kl_initial: list = []
    for repeat in range(args.repeats + 1):  # the first round warms each mode up, untimed
        for mode, dtype in alternate(modes.items(), repeat):
            learner.autocast_dtype = dtype
            t0 = time.perf_counter()
            metrics = learner.step(batch)
            if repeat:
                times[mode].append(time.perf_counter() - t0)
                if dtype is not None:
                    kl_initial.append(metrics.get("time/kl_initial_s", 0.0))
    out = {m: statistics.median(v) for m, v in times.items()}
    out["kl_initial_s"] = statistics.median(kl_initial)
    return out


def bench_drift(args, policy, draft, batch) -> dict:
    pairs = list(zip(batch.prompts, batch.completions))
    defaults = RLConfig()
    subset = sorted(random.Random(0).sample(range(len(pairs)), min(defaults.drift_max_rollouts, len(pairs))))
    variants = {f"first {OLD_DRIFT_ROLLOUTS} (old)": pairs[:OLD_DRIFT_ROLLOUTS],
                f"{len(subset)} drawn (drift_max_rollouts)": [pairs[i] for i in subset]}
    times: dict[str, list] = {v: [] for v in variants}
    with torch.no_grad():
        for repeat in range(args.repeats + 1):
            for name, chosen in alternate(variants.items(), repeat):
                t0 = time.perf_counter()
                kl_target_draft(policy, draft, chosen)
                if repeat:
                    times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(v) for name, v in times.items()}


def main(argv=None) -> None:
    args = parse_args(argv)
    policy, draft = load_models(args.quick)
    batch = make_batch(args, policy.cfg.vocab_size)
    learner = bench_learner(args, policy, batch)
    drift = bench_drift(args, policy, draft, batch)
    every = RLConfig().drift_every
    f32, bf16 = learner["float32"], learner["bf16 autocast"]
    rows = [{"part": "learner step", "variant": "float32", "seconds": f32, "ratio": 1.0},
            {"part": "learner step", "variant": "bf16 autocast", "seconds": bf16, "ratio": f32 / bf16},
            {"part": "learner step", "variant": "  of which kl_initial", "seconds": learner["kl_initial_s"],
             "ratio": learner["kl_initial_s"] / bf16}]
    old, new = drift.values()
    step = args.rollout_seconds + bf16
    for name, seconds in drift.items():
        rows.append({"part": "drift", "variant": name, "seconds": seconds, "ratio": old / seconds})
    amortized = new / every
    rows.append({"part": "drift", "variant": f"per step (every {every})", "seconds": amortized, "ratio": old / amortized})
    shares = {"old_drift_share": old / (step + old), "drift_share": amortized / (step + amortized)}
    print(f"{args.rollouts} rollouts x {args.tokens} tokens (+{args.prompt_tokens} prompt), micro_batch "
          f"{args.micro_batch}, CPU {cpu_kind()}, {torch.get_num_threads()} threads; ratio: the old path's "
          f"time over this one's (kl_initial: share of the bf16 step)")
    print_table(rows, ["part", "variant", "seconds", "ratio"], floatfmt=".3f")
    print(f"drift's share of a step ({args.rollout_seconds:.1f} s rollout + the bf16 learner step): "
          f"old {shares['old_drift_share']:.1%}, now {shares['drift_share']:.1%}")
    print_json_line({"bench": "bench_learner", "quick": args.quick, "rollouts": args.rollouts, "tokens": args.tokens,
                     "prompt_tokens": args.prompt_tokens, "micro_batch": args.micro_batch, "cpu_kind": cpu_kind(),
                     "learner_float32_s": f32, "learner_bf16_s": bf16, "learner_speedup": f32 / bf16,
                     "kl_initial_s": learner["kl_initial_s"], "drift_s": drift, "drift_every": every,
                     "drift_per_step_s": amortized, "rollout_seconds": args.rollout_seconds, **shares,
                     "machine": machine_note()})


if __name__ == "__main__":
    main()
