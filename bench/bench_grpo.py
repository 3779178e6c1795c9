"""GRPO on the default model (issue 6 benchmark; its drift part is issue 5's 30-update drift run).

    .venv/bin/python bench/bench_grpo.py                      # full: 3-step AR/SD/SSD runs + 2 x 30-step drift runs
    .venv/bin/python bench/bench_grpo.py --quick              # minutes: 2 + 2 x 3 steps
    .venv/bin/python bench/bench_grpo.py --ray                # the same through Ray actors
    .venv/bin/python bench/bench_grpo.py --skip drift,rule --compile off,live   # eager and live-compiled rollouts

Part 1 (throughput): the same GRPO run (same prompts, seeds, learner) with rollouts by AR, SD and SSD
(strategy rule on), `--compare-steps` steps each, once per `--compile` kind (EngineConfig.compile: off,
live, frozen; a compiled engine compiles each batch bucket's steps on first use, so in step 1 mostly):
rollout tokens/s per step, acceptance, hit rate, what
the rule chose, and the share of step time in rollout / learning / sync.
Part 2 (drift): SSD with the rule OFF (every round is an SSD round, so hit rate and acceptance are
measured every step) over `--steps` policy updates, once with a frozen draft and once with a following
draft: per-version hit rate, acceptance, drift/kl_target_draft; the drift plots (PNG) are drawn from
the runs' versions.jsonl by `rollout_ssd.rl.tracking.plot_drift`.
Part 3 (the b* rule vs batch size): one SSD engine (rule on) sampling batches of 1, 4 and 16: the
strategy it settled on and its round counts per strategy.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from common import add_repo_to_path, machine_note, print_json_line, print_table

add_repo_to_path()

import torch  # noqa: E402

from rollout_ssd.rl.config import load_config  # noqa: E402
from rollout_ssd.rl.tracking import RunLogger, plot_drift  # noqa: E402
from rollout_ssd.rl.trainer import RLTrainer  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--steps", type=int, default=30, help="policy updates in each drift run")
    p.add_argument("--compare-steps", type=int, default=3, help="steps of each AR / SD / SSD throughput run")
    p.add_argument("--prompts-per-step", type=int, default=2)
    p.add_argument("--n", type=int, default=4, help="samples per prompt (the GRPO group)")
    p.add_argument("--max-new-tokens", type=int, default=40)
    p.add_argument("--lr", type=float, default=1e-5, help="policy AdamW learning rate")
    p.add_argument("--task-options", default="{max_operand: 5, ops: ['+', '-']}",
                   help="arithmetic task difficulty (YAML); the default model solves ~20%% of these, so GRPO "
                        "groups have mixed rewards and the policy moves (harder problems: all-zero rewards)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--ray", action="store_true", help="Ray rollout + learner actors (default: in process)")
    p.add_argument("--out", default=None,
                   help="run directories and the PNG (default: bench/results/grpo; with --quick a temporary folder, "
                        "so a smoke run never overwrites the committed results)")
    p.add_argument("--skip", default="", help="comma list of parts to skip: throughput,drift,rule")
    p.add_argument("--methods", default="ar,sd,ssd", help="the throughput part's methods")
    p.add_argument("--compile", default="off",
                   help="the throughput part's EngineConfig.compile kinds, comma-separated: off, live, frozen")
    args = p.parse_args(argv)
    if any(kind not in ("off", "live", "frozen") for kind in args.compile.split(",")):
        p.error(f"--compile takes off, live and / or frozen, got {args.compile!r}")
    if args.quick:
        args.steps, args.compare_steps = min(args.steps, 3), min(args.compare_steps, 2)
    if args.out is None:
        args.out = tempfile.mkdtemp(prefix="bench_grpo_quick_") if args.quick else "bench/results/grpo"
    return args


def run_config(args, name: str, *overrides: str):
    out = Path(args.out) / name
    return load_config("recipes/configs/grpo.yaml", [
        f"tracking.out_dir={out}", "tracking.wandb_mode=offline", f"tracking.run_name={name}",
        f"prompts_per_step={args.prompts_per_step}", f"sampling.n={args.n}",
        f"sampling.max_new_tokens={args.max_new_tokens}", f"learner.optim.lr={args.lr}",
        f"ray.enabled={str(args.ray).lower()}", "ray.rollout_cpus=0", "ray.learner_cpus=0",
        "engine.max_batch_size=16", f"task_options={args.task_options}", *overrides])


def run(cfg) -> list[dict]:
    """The recipe's own loop (RLTrainer.run logs metrics and version rows), printing a line per step."""
    def show(m: dict) -> None:
        print(f"  [{cfg.tracking.run_name}] step {m['step']}/{cfg.steps}: {m['rollout/tokens_per_s']:.1f} tok/s, "
              f"hit {m.get('ssd/hit_rate', float('nan')):.3f}, accept {m.get('spec/accept_rate', float('nan')):.3f}, "
              f"kl {m.get('drift/kl_target_draft', float('nan')):.3f}, reward {m['reward/mean']:.3f}, "
              f"step {m['time/step_s']:.1f}s", flush=True)

    with RunLogger(cfg.tracking.out_dir, cfg.to_dict(), wandb_mode=cfg.tracking.wandb_mode,
                   project=cfg.tracking.project, run_name=cfg.tracking.run_name,
                   group=cfg.tracking.group) as logger, RLTrainer(cfg, logger) as trainer:
        return trainer.run(on_step=show)


def mean(rows, key, start=0):
    vals = [r[key] for r in rows[start:] if isinstance(r.get(key), (int, float))]
    return sum(vals) / len(vals) if vals else None


def throughput(args) -> tuple[list[dict], dict]:
    rows, out = [], {}
    runs = [(method, kind) for method in args.methods.split(",") for kind in args.compile.split(",")]
    for method, kind in runs:
        name = method if kind == "off" else f"{method}-{kind}"
        compiled = [] if kind == "off" else [f"engine.compile={kind}"]
        hist = run(run_config(args, f"throughput-{name}", f"steps={args.compare_steps}", "drift_every=0",
                              f"spec.method={method}", *compiled))
        out[name] = [{k: m.get(k) for k in ("rollout/tokens_per_s", "spec/accept_rate", "ssd/hit_rate",
                                           "ssd/strategy", "ssd/strategy_rounds", "time/rollout_share",
                                           "time/learn_share", "time/sync_share", "time/step_s", "reward/mean")}
                     for m in hist]
        rows.append({"method": method, "compile": kind, "tok/s (mean)": mean(hist, "rollout/tokens_per_s"),
                     "tok/s (after step 1)": mean(hist, "rollout/tokens_per_s", 1),
                     "accept": mean(hist, "spec/accept_rate"), "hit": mean(hist, "ssd/hit_rate"),
                     "rule chose": hist[-1].get("ssd/strategy", "-"),
                     "rollout share": mean(hist, "time/rollout_share"), "learn share": mean(hist, "time/learn_share"),
                     "sync share": mean(hist, "time/sync_share"), "step s": mean(hist, "time/step_s")})
    ar = rows[0]["tok/s (after step 1)"]  # the first run: AR, the first --compile kind
    for r in rows:
        r["vs first run"] = r["tok/s (after step 1)"] / ar if ar else None
    return rows, out


def drift(args) -> tuple[list[dict], dict]:
    runs, out = {}, {}
    for mode in ("frozen", "follow"):
        runs[mode] = run(run_config(args, f"drift-{mode}", f"steps={args.steps}", "spec.strategy_rule=false",
                                    f"follow.mode={mode}", "tracking.group=drift"))
    rows = []
    for s in range(args.steps):
        row = {"step": s + 1}
        for mode, hist in runs.items():
            m = hist[s]
            row.update({f"{mode} hit": m.get("ssd/hit_rate"), f"{mode} accept": m.get("spec/accept_rate"),
                        f"{mode} kl": m.get("drift/kl_target_draft")})
        rows.append(row)
    late = max(0, args.steps // 2)
    for mode, hist in runs.items():
        out[mode] = {"hit_rate": mean(hist, "ssd/hit_rate"), "accept_rate": mean(hist, "spec/accept_rate"),
                     "kl": mean(hist, "drift/kl_target_draft"), f"hit_rate_from_step{late + 1}": mean(hist, "ssd/hit_rate", late),
                     f"accept_rate_from_step{late + 1}": mean(hist, "spec/accept_rate", late),
                     f"kl_from_step{late + 1}": mean(hist, "drift/kl_target_draft", late),
                     "tokens_per_s": mean(hist, "rollout/tokens_per_s"),
                     "share": {k: mean(hist, f"time/{k}_share") for k in ("rollout", "learn", "sync")},
                     "per_step": [{k: m.get(k) for k in ("ssd/hit_rate", "spec/accept_rate", "drift/kl_target_draft",
                                                         "rollout/tokens_per_s", "reward/mean", "sync/bytes",
                                                         "sync/draft_bytes", "follow/last_kl")} for m in hist]}
    png = plot_drift([Path(args.out) / "drift-frozen", Path(args.out) / "drift-follow"],
                     Path(args.out) / "drift.png", labels=["frozen draft", "following draft"])
    out["plot"] = str(png)
    return rows, out


def rule_vs_batch(args) -> tuple[list[dict], dict]:
    from rollout_ssd import RolloutEngine, SamplingParams, SpecConfig
    from rollout_ssd.rl.tasks import arithmetic_dataset

    prompts = arithmetic_dataset(16, seed=1)["prompt"]
    rows, out = [], {}
    with RolloutEngine.from_pretrained("smollm2-135m-instruct", draft="default", spec=SpecConfig(method="ssd"),
                                       max_batch_size=16, max_model_len=512) as engine:
        for batch in (1, 4, 16):
            engine.metrics(reset=True)
            t0 = time.perf_counter()
            rollouts = engine.sample(prompts[:batch], SamplingParams(n=1, temperature=1.0, chat=True,
                                                                     max_new_tokens=args.max_new_tokens, seed=batch))
            seconds = time.perf_counter() - t0
            m = engine.metrics()
            tokens = sum(len(r.token_ids) for r in rollouts)
            rows.append({"batch": batch, "rule chose": m.get("ssd/strategy"), "rounds": str(m.get("ssd/strategy_rounds")),
                         "b*": m.get("ssd/b_star"), "predicted speedup": m.get("ssd/predicted_speedup"),
                         "tok/s": tokens / seconds})
            out[batch] = {k: m.get(k) for k in ("ssd/strategy", "ssd/strategy_rounds", "ssd/b_star", "ssd/scores",
                                                "ssd/predicted_speedup", "ssd/T_p", "ssd/T_b", "ssd/p_hit_estimate")}
    return rows, out


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    skip = set(filter(None, args.skip.split(",")))
    result = {"bench": "grpo", "machine": machine_note(), "args": vars(args)}
    if "throughput" not in skip:
        rows, result["throughput"] = throughput(args)
        print("Part 1: GRPO rollouts by AR / SD / SSD (same prompts, seeds and learner)")
        print_table(rows, floatfmt=".3f")
        print()
    if "drift" not in skip:
        rows, result["drift"] = drift(args)
        print(f"Part 2: SSD (rule off) over {args.steps} policy updates, frozen vs following draft")
        print_table(rows, floatfmt=".3f")
        print()
    if "rule" not in skip:
        rows, result["rule"] = rule_vs_batch(args)
        print("Part 3: the strategy rule (Theorem 17) vs batch size")
        print_table(rows, floatfmt=".3f")
        print()
    print_json_line(result)


if __name__ == "__main__":
    main()
