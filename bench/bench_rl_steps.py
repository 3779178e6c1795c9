"""Replay a GRPO run's rollout phase on its own checkpoints with the AR, SD and SSD engines (issue 49).

    .venv/bin/python bench/bench_rl_steps.py runs/grpo_learns            # the learning run's checkpoints
    .venv/bin/python bench/bench_rl_steps.py --quick                     # a tiny run made on the spot

For each checkpoint step s the run saved (rl/checkpoints.py), each engine is built from that checkpoint
(the policy, and the draft the run had then), warmed on the workloads of steps s+R .. s+R+W-1 (their
seconds are reported as `warm_s`: the strategy rule's exploring cost is in them), then times the run's
own workloads of steps s .. s+R-1 (same prompts, n, sampling and seeds as the trainer's `StepWorkload`).
Reported per engine: rollout seconds and tokens/s, the tail (rounds at a live batch under a quarter of
the step's sequences, by whole buckets) against the head, what
ran in each, and the end-to-end step time with the run's own non-rollout seconds (learner, sync, follow,
drift: their mean over the run's steps near s). Then, from the run's reward curve: did it learn
(last-10 minus first-10 mean, bootstrap 95% interval) and the wall-clock to the reward threshold with AR
rollouts and with each engine, measured, and at a 70% rollout share (a projection).

Every engine runs on all of the machine's cores, one after the other, never beside each other.
Target (issue 49): SSD engine >= 1.3x AR tokens/s at every checkpoint and never > 5% below the better of AR and SD.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Optional

from common import add_repo_to_path, machine_note, print_json_line, print_table

add_repo_to_path()

import torch  # noqa: E402

from rollout_ssd import RolloutEngine, SpecConfig  # noqa: E402
from rollout_ssd import metric_names as names  # noqa: E402
from rollout_ssd.rl import analysis  # noqa: E402
from rollout_ssd.rl.actors import engine_options, resolve_models  # noqa: E402
from rollout_ssd.rl.checkpoints import DRAFT, POLICY, list_checkpoints  # noqa: E402
from rollout_ssd.rl.config import build_config, load_config  # noqa: E402
from rollout_ssd.rl.tracking import read_jsonl  # noqa: E402
from rollout_ssd.rl.trainer import StepWorkload  # noqa: E402

TARGET_VS_AR, TARGET_VS_BEST = 1.3, 0.95
REST = (names.TIME_LEARN_S, names.TIME_SYNC_S, names.TIME_FOLLOW_S, names.TIME_DRIFT_S)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", nargs="?", help="a run directory with config.json, metrics.jsonl and checkpoints/")
    p.add_argument("--quick", action="store_true", help="make a tiny 2-step run in a temporary folder and replay it")
    p.add_argument("--methods", default="ar,sd,ssd",
                   help="comma list of ar, sd, ssd (the strategy rule on), suffix (SD, suffix speculator), each "
                        "optionally :K; the summary compares ssd with ar and the best of the others")
    p.add_argument("--checkpoints", default=None, help="comma list of checkpoint steps (default: all)")
    p.add_argument("--replay-steps", type=int, default=2, help="timed steps per checkpoint and engine (R)")
    p.add_argument("--warm-steps", type=int, default=1,
                   help="untimed steps each engine runs first (W, the workloads of steps s+R .. s+R+W-1): in a run "
                        "the engine lives for every step, so its rule has long decided; W=1 leaves some exploring in")
    p.add_argument("--window", type=int, default=10, help="steps of the first/last reward windows")
    p.add_argument("--share", type=float, default=0.7, help="rollout share of the projection")
    p.add_argument("--out", default=None, help="write the JSON result here too")
    args = p.parse_args(argv)
    if not args.quick and not args.run:
        p.error("give a run directory, or --quick")
    return args


def tiny_run(folder: Path) -> Path:
    """A 2-step tiny GRPO run with checkpoints at 0 and 2 (seconds)."""
    from rollout_ssd.rl.recipe import run

    out = folder / "tiny_run"
    cfg = load_config(None, [f"tracking.out_dir={out}", "tracking.wandb_mode=disabled", "steps=2",
                             "checkpoint_steps=[0, 2]", "ray.enabled=false", "drift_every=1",
                             "engine.max_batch_size=8"], tiny=True)
    run(cfg, progress=False)
    return out


def method_spec(cfg, name: str) -> SpecConfig:
    """A method name -> the run's SpecConfig for it: "ar", "sd", "ssd" (the strategy rule on, as the run
    had it), "suffix" (SD with the suffix speculator over the prompt, the sequence and its siblings), with
    an optional ":K" for another k ("sd:2")."""
    base, _, k = name.partition(":")
    if base not in ("ar", "sd", "ssd", "suffix"):
        raise ValueError(f"unknown method {name!r}: ar, sd, ssd or suffix, optionally with :K")
    if base == "ar":
        return SpecConfig(method="ar")
    extra = {"k": int(k)} if k else {}
    if base == "suffix":
        return dataclasses.replace(cfg.spec, method="sd", speculator="suffix", **extra)
    return dataclasses.replace(cfg.spec, method=base, **extra)


def engine_for(cfg, ckpt: Path, method: str, frozen_draft: str | None = None) -> RolloutEngine:
    """The run's engine settings on checkpoint `ckpt`: the policy, and for a draft model the one the run
    had then (its following copy, or `frozen_draft`)."""
    meta = json.loads((ckpt / "meta.json").read_text())
    spec = method_spec(cfg, method)
    draft = None
    if spec.method == "ssd" or (spec.method == "sd" and spec.speculator == "draft"):
        draft = frozen_draft or (str(ckpt / DRAFT) if meta["has_draft"] else resolve_models(cfg)[1])
        if draft is None:
            raise ValueError(f"{ckpt} has no draft, nor has its run: {method} needs one")
    return RolloutEngine.from_pretrained(str(ckpt / POLICY), draft=draft, spec=spec, dtype=cfg.dtype,
                                         **engine_options(cfg))


def _part(bucket: str, cut: int) -> str:
    """"tail" for a live-batch bucket ("1", "2-3", "4-7", ...) wholly below `cut` sequences, else "head"."""
    return "tail" if int(bucket.split("-")[-1]) < cut else "head"


def tail_split(metrics: dict, sequences: int) -> dict:
    """Seconds, tokens and plans of one call's tail (rounds at a live batch under a quarter of the step's
    sequences, by whole buckets: 1, 2-3 and 4-7 for 32) and its head (the rest)."""
    cut = max(1, sequences // 4)
    out = {"head_s": 0.0, "tail_s": 0.0, "head_tokens": 0, "tail_tokens": 0, "head_plans": {}, "tail_plans": {}}
    for key, value in metrics.items():
        for prefix, field in ((names.SECONDS_BY_BATCH, "s"), (names.TOKENS_BY_BATCH, "tokens")):
            if key.startswith(prefix):
                out[f"{_part(key[len(prefix):], cut)}_{field}"] += value
        if key.startswith(names.ROUNDS_BY_BATCH):
            bucket, plan = key[len(names.ROUNDS_BY_BATCH):].split("/", 1)
            part = _part(bucket, cut)
            out[f"{part}_plans"][plan] = out[f"{part}_plans"].get(plan, 0) + int(value)
    return out


def step_rows(run_dir: Path) -> list[dict]:
    """The run's per-step metrics, one row per step (the last one logged, should a step appear twice), by
    step; exits unless they are steps 1..N."""
    rows = {r["step"]: r for r in read_jsonl(run_dir / "metrics.jsonl") if "step" in r}
    if sorted(rows) != list(range(1, len(rows) + 1)):
        raise SystemExit(f"{run_dir}/metrics.jsonl does not hold steps 1..N")
    return [rows[s] for s in sorted(rows)]


@dataclasses.dataclass
class Run:
    """A finished run as the benches read it: its folder, config, per-step metrics and checkpoints (and the
    temporary folder of a --quick tiny run, removed by `close`)."""

    dir: Path
    cfg: object
    steps: list[dict]
    checkpoints: dict[int, Path]
    tmp: Optional[tempfile.TemporaryDirectory] = None

    def close(self) -> None:
        if self.tmp is not None:
            self.tmp.cleanup()


def open_run(args, prefix: str) -> Run:
    """`args.run`, or with --quick a tiny run made in a temporary folder; every core for the engines."""
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    tmp = None
    if args.quick:
        tmp = tempfile.TemporaryDirectory(prefix=prefix)
        run_dir = tiny_run(Path(tmp.name))
    else:
        run_dir = Path(args.run)
    cfg = build_config(json.loads((run_dir / "config.json").read_text()))
    return Run(run_dir, cfg, step_rows(run_dir), list_checkpoints(run_dir), tmp)


def finish(result: dict, args, run: Run) -> dict:
    """Write the result to --out if asked, print its JSON line, remove a --quick run."""
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print_json_line(result)
    run.close()
    return result


def replay(cfg, workload: StepWorkload, ckpt: Path, step: int, method: str, replay_steps: int,
           warm_steps: int = 1) -> dict:
    params = cfg.sampling
    sequences = cfg.prompts_per_step * cfg.sampling.n
    with engine_for(cfg, ckpt, method) as engine:
        t = time.perf_counter()
        for w in range(warm_steps):
            prompts, _, indices = workload.batch(step + replay_steps + w)
            engine.sample(prompts, params, prompt_indices=indices)
        warm = time.perf_counter() - t
        engine.metrics(reset=True)
        row = {"step": step, "method": method, "warm_s": warm, "seconds": 0.0, "tokens": 0, "rewards": [],
               "head_s": 0.0, "tail_s": 0.0, "head_tokens": 0, "tail_tokens": 0, "head_plans": {}, "tail_plans": {},
               "accept": []}
        for r in range(replay_steps):
            prompts, answers, indices = workload.batch(step + r)
            t = time.perf_counter()
            rollouts = engine.sample(prompts, params, prompt_indices=indices)
            row["seconds"] += time.perf_counter() - t
            m = engine.metrics(reset=True)
            row["tokens"] += sum(len(x.token_ids) for x in rollouts)
            n = cfg.sampling.n
            row["rewards"] += [workload.reward_fn(x.text or "", answers[i // n]) for i, x in enumerate(rollouts)]
            split = tail_split(m, sequences)
            for key in ("head_s", "tail_s", "head_tokens", "tail_tokens"):
                row[key] += split[key]
            for part in ("head_plans", "tail_plans"):
                for plan, count in split[part].items():
                    row[part][plan] = row[part].get(plan, 0) + count
            if names.SPEC_ACCEPT_RATE in m:
                row["accept"].append(m[names.SPEC_ACCEPT_RATE])
    row["tokens_per_s"] = row["tokens"] / row["seconds"]
    row["seconds_per_step"] = row["seconds"] / replay_steps
    row["reward"] = sum(row.pop("rewards")) / max(1, sequences * replay_steps)
    accept = row.pop("accept")
    row["accept"] = sum(accept) / len(accept) if accept else None
    row["tail_share"] = row["tail_s"] / max(row["head_s"] + row["tail_s"], 1e-9)
    return row


def rest_near(steps_rows: list[dict], step: int, half: int = 2) -> float:
    """Mean non-rollout seconds of the run's steps step+1-half .. step+1+half (1-based step numbers)."""
    rows = [r for r in steps_rows if abs(r["step"] - (step + 1)) <= half] or steps_rows
    return sum(sum(r.get(k, 0.0) for k in REST) for r in rows) / len(rows)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.quick:
        args.replay_steps, args.window = 1, 1
    run = open_run(args, "bench_rl_steps_")
    run_dir, cfg, steps_rows, checkpoints = run.dir, run.cfg, run.steps, run.checkpoints
    if args.checkpoints:
        wanted = {int(s) for s in args.checkpoints.split(",")}
        checkpoints = {s: d for s, d in checkpoints.items() if s in wanted}
    if not checkpoints:
        raise SystemExit(f"{run_dir} has no checkpoints (set checkpoint_steps in the run's config)")
    methods = args.methods.split(",")
    workload = StepWorkload(cfg)
    rows = []
    for step, ckpt in checkpoints.items():
        for method in methods:
            row = replay(cfg, workload, ckpt, step, method, args.replay_steps, args.warm_steps)
            row["rest_s"] = rest_near(steps_rows, step)
            row["step_s"] = row["seconds_per_step"] + row["rest_s"]
            rows.append(row)
            print(f"step {step} {method}: {row['tokens_per_s']:.1f} tok/s, {row['seconds_per_step']:.2f} s/step, "
                  f"head {row['head_plans']} tail {row['tail_plans']}", flush=True)
    by = {(r["step"], r["method"]): r for r in rows}
    summary = []
    for step in checkpoints:
        line = {"step": step}
        for m in methods:
            line[f"{m}_tok_s"] = by[(step, m)]["tokens_per_s"]
        if "ar" in methods and "ssd" in methods:
            ar, ssd = by[(step, "ar")], by[(step, "ssd")]
            best = max(by[(step, m)]["tokens_per_s"] for m in ("ar", "sd") if m in methods)
            line["ssd_vs_ar"] = ssd["tokens_per_s"] / ar["tokens_per_s"]
            line["ssd_vs_best"] = ssd["tokens_per_s"] / best
            line["step_speedup"] = ar["step_s"] / ssd["step_s"]
        summary.append(line)
    print_table([{k: v for k, v in r.items() if not k.endswith("_plans")} for r in rows],
                ["step", "method", "tokens", "seconds_per_step", "tokens_per_s", "warm_s", "head_s", "tail_s",
                 "tail_share", "accept", "reward", "rest_s", "step_s"])
    print()
    print_table(summary)
    result = {"bench": "bench_rl_steps", "run": str(run_dir), "machine": machine_note(), "replay_steps": args.replay_steps,
              "warm_steps": args.warm_steps,
              "rows": rows, "summary": summary}
    if "ar" in methods and "ssd" in methods:
        result["target_met"] = all(s["ssd_vs_ar"] >= TARGET_VS_AR and s["ssd_vs_best"] >= TARGET_VS_BEST for s in summary)
    rewards = [r["reward/mean"] for r in steps_rows]
    if len(rewards) >= 2 * args.window:
        gain = analysis.reward_gain(rewards, k=args.window)
        threshold, at = analysis.threshold_step(rewards, k=args.window)
        learned = {"first": gain.first, "last": gain.last, "gain": gain.gain, "ci95": [gain.low, gain.high],
                   "threshold": threshold, "threshold_step": at}
        if at is not None:
            tokens = [r[names.ROLLOUT_TOKENS] for r in steps_rows]
            rest = [sum(r.get(k, 0.0) for k in REST) for r in steps_rows]
            measured = {"run": sum(r[names.TIME_STEP_S] for r in steps_rows[:at])}
            projected = {}

            def rate_of(method):  # step i samples with the policy after i - 1 updates
                nearest = analysis.nearest({s: by[(s, method)]["tokens_per_s"] for s in checkpoints})
                return lambda i: nearest(i - 1)

            rest_projected = analysis.projected_rest(tokens, rate_of("ar"), args.share) if "ar" in methods else None
            for m in methods:
                measured[m] = analysis.time_to_reward(at, tokens, rest, rate_of(m))
                if rest_projected is not None:
                    projected[m] = analysis.time_to_reward(at, tokens, rest_projected, rate_of(m))
            learned["time_to_threshold_s"] = measured
            learned[f"projected_at_{int(args.share * 100)}pct_rollout_s"] = projected
        result["learning"] = learned
        print(f"\nlearned: last{args.window} - first{args.window} = {gain.gain:+.3f} "
              f"(95% CI {gain.low:+.3f} .. {gain.high:+.3f}); threshold {threshold:.3f} reached at step {at}")
        if at is not None:
            measured = learned["time_to_threshold_s"]
            print("time to threshold, measured (s): " + ", ".join(f"{k} {v:.0f}" for k, v in measured.items()))
            projected = learned[f"projected_at_{int(args.share * 100)}pct_rollout_s"]
            print(f"time to threshold at a {args.share:.0%} rollout share, a projection (s): "
                  + ", ".join(f"{k} {v:.0f}" for k, v in projected.items()))
    return finish(result, args, run)


if __name__ == "__main__":
    main()
