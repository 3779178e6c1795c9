"""A run's checkpoints under the microscope (issue 49): held-out accuracy, and the draft under real drift.

    .venv/bin/python bench/rl_drift.py runs/grpo_learns --png bench/results/grpo_learns/drift.png
    .venv/bin/python bench/rl_drift.py --quick                 # a tiny run made on the spot

At every checkpoint step s of the run (rl/checkpoints.py):
- greedy accuracy on a held-out set of the run's task (`--heldout` problems drawn with another seed,
  none of them among the run's training prompts), with the AR engine;
- the draft under drift: a forced-SSD engine (strategy rule off, so every round is an SSD round) on the
  run's own step workloads s .. s+R-1, once with the frozen draft (the one the run started from) and
  once with the following draft the run had at s: acceptance rate, accepted tokens per round and SSD's
  cache hit rate. Measured, not timed;
- KL(policy_s || policy_0) from the run's own `learner/kl_initial` (mean of the steps around s).

Goal (issue 49): the following draft's acceptance no more than 10% below its step-0 value at every checkpoint.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from bench_rl_steps import finish, open_run
from common import add_repo_to_path, machine_note, print_table

add_repo_to_path()


from rollout_ssd import RolloutEngine, SamplingParams, SpecConfig  # noqa: E402
from rollout_ssd import metric_names as names  # noqa: E402
from rollout_ssd.rl.actors import engine_options, resolve_models  # noqa: E402
from rollout_ssd.rl.checkpoints import DRAFT, POLICY  # noqa: E402
from rollout_ssd.rl.tasks import get_task  # noqa: E402
from rollout_ssd.rl.trainer import StepWorkload, task_dataset  # noqa: E402

FOLLOW_GOAL = 0.10


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", nargs="?", help="a run directory with config.json, metrics.jsonl and checkpoints/")
    p.add_argument("--quick", action="store_true", help="make a tiny 2-step run in a temporary folder and measure it")
    p.add_argument("--heldout", type=int, default=128, help="held-out problems for greedy accuracy")
    p.add_argument("--replay-steps", type=int, default=2, help="step workloads per checkpoint for acceptance (R)")
    p.add_argument("--png", default=None, help="draw the curves to this PNG")
    p.add_argument("--out", default=None, help="write the JSON result here too")
    args = p.parse_args(argv)
    if not args.quick and not args.run:
        p.error("give a run directory, or --quick")
    return args


def heldout_set(cfg, num: int) -> tuple[list[str], list[str]]:
    """`num` problems of the run's task drawn with another seed, minus any prompt of its training set."""
    train = set(StepWorkload(cfg).prompts)
    data = task_dataset(cfg, 4 * num, cfg.seed + 10_007)
    rows = [(p, a) for p, a in zip(data["prompt"], data["answer"]) if p not in train][:num]
    return [p for p, _ in rows], [a for _, a in rows]


def greedy_accuracy(cfg, ckpt: Path, prompts: list[str], answers: list[str]) -> float:
    _, reward = get_task(cfg.task)
    params = SamplingParams(temperature=0.0, max_new_tokens=cfg.sampling.max_new_tokens, chat=cfg.sampling.chat)
    with RolloutEngine.from_pretrained(str(ckpt / POLICY), spec=SpecConfig(method="ar"), dtype=cfg.dtype,
                                       **engine_options(cfg)) as engine:
        rollouts = engine.sample(prompts, params)
    return sum(reward(r.text or "", a) for r, a in zip(rollouts, answers)) / len(answers)


def forced_ssd(cfg, ckpt: Path, draft: str, workload: StepWorkload, step: int, replay_steps: int) -> dict:
    """Acceptance and hit rate of a forced-SSD engine (every round SSD) with `draft` on steps step.. ."""
    spec = dataclasses.replace(cfg.spec, method="ssd", strategy_rule=False)
    with RolloutEngine.from_pretrained(str(ckpt / POLICY), draft=draft, spec=spec, dtype=cfg.dtype,
                                       **engine_options(cfg)) as engine:
        engine.metrics(reset=True)
        for r in range(replay_steps):
            prompts, _, indices = workload.batch(step + r)
            engine.sample(prompts, cfg.sampling, prompt_indices=indices)
        m = engine.metrics(reset=True)
    plans = {k.rsplit("/", 1)[-1]: v for k, v in m.items() if k.startswith(names.ROUNDS_BY_BATCH)}
    accept, length = m.get(names.SPEC_ACCEPT_RATE), m.get(names.SPEC_ACCEPT_LENGTH)
    return {"accept": accept, "accept_length": length, "hit_rate": m.get(names.SSD_HIT_RATE),
            "hits": m.get(names.SSD_HITS, 0), "rounds": m.get(names.SSD_ROUNDS, 0),
            "ssd_only": set(plans) <= {"ssd+neural"}}


def kl_near(rows: list[dict], step: int, half: int = 2) -> float:
    """KL(policy_step || policy_0): `learner/kl_initial` is measured before a step's update, so metrics row
    t (1-based) holds it for the policy after t - 1 updates; the mean over rows step+1-half .. step+1+half."""
    if step == 0:
        return 0.0
    near = [r[names.LEARNER_KL_INITIAL] for r in rows
            if abs(r["step"] - (step + 1)) <= half and names.LEARNER_KL_INITIAL in r]
    return sum(near) / len(near) if near else float("nan")


def draw(result: dict, path: Path) -> None:
    from matplotlib.figure import Figure

    rows = result["rows"]
    steps = [r["step"] for r in rows]
    fig = Figure(figsize=(12, 3.6))
    a, b, c = fig.subplots(1, 3)
    a.plot(steps, [r["frozen"]["accept"] for r in rows], "o-", label="frozen draft")
    a.plot(steps, [r["following"]["accept"] for r in rows], "s-", label="following draft")
    a.set_title("acceptance (forced SSD)")
    a.set_xlabel("policy step")
    a.legend(loc="lower left")
    twin = a.twinx()
    twin.plot(steps, [r["kl_initial"] for r in rows], "k:", label="KL(policy_t || policy_0)")
    twin.set_ylabel("KL to the initial policy")
    b.plot(steps, [r["frozen"]["hit_rate"] for r in rows], "o-", label="frozen draft")
    b.plot(steps, [r["following"]["hit_rate"] for r in rows], "s-", label="following draft")
    b.set_title("SSD cache hit rate")
    b.set_xlabel("policy step")
    b.legend(loc="lower left")
    c.plot(steps, [r["heldout_greedy"] for r in rows], "o-")
    c.set_title("held-out greedy accuracy")
    c.set_xlabel("policy step")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(str(path), dpi=80)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.quick:
        args.heldout, args.replay_steps = min(args.heldout, 8), 1
    run = open_run(args, "rl_drift_")
    run_dir, cfg, rows_run, checkpoints = run.dir, run.cfg, run.steps, run.checkpoints
    if 0 not in checkpoints:
        raise SystemExit(f"{run_dir} has no checkpoint of step 0 (checkpoint_steps must include 0: the reference)")
    _, frozen = resolve_models(cfg)
    if frozen is None:
        raise SystemExit("the run has no draft")
    workload = StepWorkload(cfg)
    prompts, answers = heldout_set(cfg, args.heldout)
    rows = []
    for step, ckpt in checkpoints.items():
        row = {"step": step, "kl_initial": kl_near(rows_run, step),
               "heldout_greedy": greedy_accuracy(cfg, ckpt, prompts, answers),
               "frozen": forced_ssd(cfg, ckpt, frozen, workload, step, args.replay_steps),
               "following": forced_ssd(cfg, ckpt, str(ckpt / DRAFT), workload, step, args.replay_steps)}
        rows.append(row)
        print(f"step {step}: held-out {row['heldout_greedy']:.3f}, accept frozen {row['frozen']['accept']} "
              f"following {row['following']['accept']}, KL {row['kl_initial']:.4f}", flush=True)
    base = rows[0]["following"]["accept"]
    for row in rows:
        for kind in ("frozen", "following"):
            row[kind]["accept_vs_step0"] = row[kind]["accept"] / rows[0][kind]["accept"]
    print_table([{"step": r["step"], "kl_initial": r["kl_initial"], "heldout_greedy": r["heldout_greedy"],
                  "frozen_accept": r["frozen"]["accept"], "following_accept": r["following"]["accept"],
                  "frozen_hit": r["frozen"]["hit_rate"], "following_hit": r["following"]["hit_rate"],
                  "frozen_rel": r["frozen"]["accept_vs_step0"], "following_rel": r["following"]["accept_vs_step0"]}
                 for r in rows], floatfmt=".3f")
    result = {"bench": "rl_drift", "run": str(run_dir), "machine": machine_note(), "heldout": len(prompts),
              "replay_steps": args.replay_steps, "rows": rows,
              "following_within_10pct": all(r["following"]["accept"] >= (1 - FOLLOW_GOAL) * base for r in rows),
              "heldout_rises": rows[-1]["heldout_greedy"] > rows[0]["heldout_greedy"]}
    if args.png:
        draw(result, Path(args.png))
    return finish(result, args, run)


if __name__ == "__main__":
    main()
