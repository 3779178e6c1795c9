"""Where one SSD round's time goes, against an SD round on the same prompts (issue 15, part 3).

SSD (rule off: every round SSD with the draft backup, the draft worker on its own core) and SD, one
thread per process, prompts one at a time (`--batch 1`) or together, greedy or T=1, dtype auto, the two
taking turns call by call. Per timed SSD round (first rounds left out) it splits the target's time into
  - wait: request to validated reply (the verdicts out, the chains and their q in), and a miss's
    drafting (by SD's speculator in the target's process, on both cores; the worker's with Saguaro on);
  - forward: the verify's target forward, while the worker builds the next cache beside it;
  - judge: the rest of the verify (sampling, the accept/reject walk);
  - tail: append, KV rollback, messages, bookkeeping;
(calibration steps left out) and, beside them, the worker's own build time (T_p once divided by the
verify), per path (hit or drafted on a miss) the target's wait and the miss's drafting time. The SD
engine's rounds give draft and verify seconds per round. Theorem 7's prediction from the measured parts
(once with the SD engine's draft time as T_b, once with the misses' measured wait) is printed next to
the measured SSD/SD.

    .venv/bin/python bench/probes/profile_ssd_round.py                      # batch 1, greedy, K=4
    .venv/bin/python bench/probes/profile_ssd_round.py --temperature 1
    .venv/bin/python bench/probes/profile_ssd_round.py --quick              # a smoke run
    .venv/bin/python bench/probes/profile_ssd_round.py --draft DIR          # another draft (part 1's sweep)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for common.py (a probe lives in bench/probes/)
from common import add_repo_to_path, bench_prompts, load_default_pair, machine_note, print_json_line, print_table  # noqa: E402

add_repo_to_path()

from rollout_ssd import EngineConfig, RolloutEngine, SamplingParams, SpecConfig  # noqa: E402
from rollout_ssd import metric_names as names  # noqa: E402
from rollout_ssd.ssd.rule import sd_speedup, ssd_speedup  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=1, help="1: prompts one at a time")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--prompt-set", default="templates", choices=("templates", "unseen"))
    p.add_argument("--draft", default="default", help="default (the built-in), target-int4, or a draft checkpoint directory")
    p.add_argument("--ssd-stop-prob", type=float, default=None,
                   help="the SSD engine's stop_prob (its misses' and SD rounds' early stop); default: SD's")
    p.add_argument("--fanout", default="", help="SSD's manual fan-out F_0..F_k, comma-separated (default: the planner)")
    p.add_argument("--budget", type=int, default=None, help="SSD's fan-out budget (default: sized from timings)")
    p.add_argument("--quick", action="store_true", help="2 prompts, 16 tokens")
    args = p.parse_args(argv)
    if args.quick:
        args.prompts, args.new_tokens = 2, 16
    return args


class RoundProbe:
    """Hooks on one SSD engine's strategy that time each part of its rounds (module docstring)."""

    def __init__(self, engine):
        self.ssd = engine.strategy
        self.runner = self.ssd.runner
        self.rounds: list[dict] = []
        self._cur: dict = {}
        self._concurrent = False
        extend, build, propose = self.runner.extend, self.ssd.draft.build, self.ssd._propose

        def timed_extend(slots, tokens, **kw):
            t0 = time.perf_counter()
            out = extend(slots, tokens, **kw)
            if self._concurrent:
                self._cur["forward"] = self._cur.get("forward", 0.0) + time.perf_counter() - t0
            return out

        def probe_propose(running, ks, plan, fanout, *rest):
            rnd = propose(running, ks, plan, fanout, *rest)
            here = rnd.drafted_here[1] if rnd.drafted_here is not None else 0.0
            self._cur = {"batch": len(running), "cold": rnd.cold, "wait": rnd.wait_seconds,
                         "build": rnd.reply.build_seconds if rnd.reply is not None else 0.0,
                         "drafting": (rnd.reply.backup_seconds if rnd.reply is not None else 0.0) + here,
                         "q_bytes": sum(q.probs.numel() * q.probs.element_size() for q in rnd.q
                                        if q is not None and hasattr(q, "probs"))}
            return rnd

        def probe_build(*a, **kw):
            told = build(*a, **kw)
            self._concurrent = True  # the verify's forward follows, beside the worker's build
            return told

        self.runner.extend, self.ssd.draft.build, self.ssd._propose = timed_extend, probe_build, probe_propose
        self.ssd.trace = self.trace = []

    def hook_round_end(self):
        step = self.ssd.step

        def stepped(running):
            out = step(running)
            self._concurrent = False
            r = self.trace[-1]
            cur = self._cur
            cur.update(seconds=r["seconds"] - r["calibration_seconds"], verify=r["verify_seconds"],
                       emitted=r["emitted"], paths=dict(r["paths"]))
            self.rounds.append(cur)
            return out

        self.ssd.step = stepped


def count_rounds(engine) -> list[int]:
    """A list that gets one entry per round the engine's strategy steps."""
    rounds, step = [], engine.strategy.step

    def stepped(running):
        rounds.append(len(running))
        return step(running)

    engine.strategy.step = stepped
    return rounds


def run(engine, prompts, params, batch):
    return run_interleaved([engine], prompts, params, batch)[0]


def run_interleaved(engines, prompts, params, batch) -> list[tuple[int, float]]:
    """(tokens, seconds) per engine, the engines taking turns call by call (the machine's drift over the
    run then reaches each alike)."""
    groups = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
    totals = [[0, 0.0] for _ in engines]
    for g in groups:
        for total, engine in zip(totals, engines):
            t0 = time.perf_counter()
            total[0] += sum(len(r.token_ids) for r in engine.sample(g, params))
            total[1] += time.perf_counter() - t0
    return [tuple(t) for t in totals]


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(1)
    target, draft = load_default_pair(args.draft, dtype=args.dtype)
    prompts = bench_prompts(target.tokenizer, args.prompt_set, args.prompts)
    cfg = EngineConfig(max_batch_size=args.batch, max_model_len=max(map(len, prompts)) + args.new_tokens + 8)
    params = SamplingParams(temperature=args.temperature, max_new_tokens=args.new_tokens, ignore_eos=True, seed=0)
    sd = RolloutEngine(target, SpecConfig(method="sd", k=args.k), cfg, draft=draft)
    stop = {} if args.ssd_stop_prob is None else {"stop_prob": args.ssd_stop_prob}
    if args.fanout:
        stop["fanout"] = tuple(int(f) for f in args.fanout.split(","))
    if args.budget:
        stop["budget"] = args.budget
    ssd = RolloutEngine(target, SpecConfig(method="ssd", k=args.k, strategy_rule=False, **stop), cfg, draft=draft)
    probe = RoundProbe(ssd)
    probe.hook_round_end()
    sd_rounds = count_rounds(sd)
    for engine in (sd, ssd):  # warm-up call each (first shapes, the worker's first builds), not counted
        run(engine, prompts[:1], SamplingParams(temperature=args.temperature, max_new_tokens=8, ignore_eos=True), 1)
        engine.metrics(reset=True)
    probe.rounds.clear()
    sd_rounds.clear()
    (sd_tokens, sd_seconds), (ssd_tokens, ssd_seconds) = run_interleaved([sd, ssd], prompts, params, args.batch)
    m_sd, m_ssd = sd.metrics(), ssd.metrics()
    sd.close()
    ssd.close()

    warm = [r for r in probe.rounds if not r["cold"] and "forward" in r]
    n = max(len(warm), 1)
    mean = {key: sum(r[key] for r in warm) / n for key in ("seconds", "wait", "verify", "forward", "build",
                                                             "emitted", "q_bytes")}
    parts = {"wait": mean["wait"], "forward (beside the build)": mean["forward"],
             "judge": mean["verify"] - mean["forward"],
             "tail": mean["seconds"] - mean["wait"] - mean["verify"]}
    rows = [{"part": k, "ms/round": 1000 * v, "share": v / mean["seconds"]} for k, v in parts.items()]
    rows += [{"part": "worker build (T_p x verify)", "ms/round": 1000 * mean["build"], "share": None}]
    print(f"SSD rounds timed: {len(warm)}, tokens per round {mean['emitted']:.2f} (batch {args.batch}), "
          f"q bytes per round {mean['q_bytes']:.0f}")
    print_table(rows, floatfmt=".3f")

    sd_draft, sd_verify = m_sd[names.SPEC_DRAFT_SECONDS], m_sd[names.SPEC_VERIFY_SECONDS]
    # Theorem 7 from the measured parts, in SD-verify units: SD's E and T_SD from its own rounds; SSD's hit
    # rate, acceptance and T_p from its rounds (T_b: the SD engine's draft time)
    a_sd, a_ssd = m_sd[names.SPEC_ACCEPT_RATE], m_ssd[names.SPEC_ACCEPT_RATE]
    e = lambda a: sum(a ** i for i in range(args.k + 1))  # noqa: E731
    verify_unit = mean["verify"]
    t_p = mean["build"] / verify_unit if verify_unit else float("nan")
    t_sd = sd_draft / sd_verify  # the SD rounds' drafting time in their verify units
    p_hit = m_ssd.get(names.SSD_HIT_RATE_WARM) or 0.0
    predicted = ssd_speedup(p_hit, e(a_ssd), e(a_ssd), t_p, t_sd) / sd_speedup(e(a_sd), t_sd)
    # Theorem 7 counts both in one verify unit; here SD verifies on every core, SSD on one beside the
    # worker: the ratio of the two verify times converts SSD's speedup into SD's unit
    sd_verify_round = sd_verify / max(len(sd_rounds), 1)
    narrow = sd_verify_round / verify_unit if verify_unit else float("nan")
    summary = {
        "SD tok/s": sd_tokens / sd_seconds, "SSD tok/s": ssd_tokens / ssd_seconds,
        "SSD/SD measured": (ssd_tokens / ssd_seconds) / (sd_tokens / sd_seconds),
        "SSD/SD predicted (Theorem 7)": predicted, "SD accept": a_sd, "SSD accept": a_ssd, "hit (warm)": p_hit,
        "T_SD": t_sd, "T_p": t_p, "SD verify ms": 1000 * sd_verify_round, "SSD verify ms": 1000 * verify_unit,
    }
    by_path = []
    for path in ("hit", "draft"):
        rs = [r for r in warm if r["paths"].get(path)]
        if rs:
            k = len(rs)
            by_path.append({"path": path, "rounds": k, "tokens/round": sum(r["emitted"] for r in rs) / k,
                            "wait ms": 1000 * sum(r["wait"] for r in rs) / k,
                            "miss drafting ms": 1000 * sum(r["drafting"] for r in rs) / k,
                            "verify ms": 1000 * sum(r["verify"] for r in rs) / k,
                            "round ms": 1000 * sum(r["seconds"] for r in rs) / k})
    print()
    print_table(by_path, floatfmt=".2f")
    paths = {r["path"]: r for r in by_path}
    if "hit" in paths and "draft" in paths:  # Theorem 7 again, with the target's measured waits per path
        t_b = paths["draft"]["wait ms"] / 1000 / verify_unit  # a miss: the build's overrun, drafting, transfer
        t_o = max(0.0, paths["hit"]["wait ms"] / 1000 / verify_unit - max(0.0, t_p - 1))
        summary["SSD/SD predicted, measured T_b, T_o"] = ssd_speedup(
            p_hit, paths["hit"]["tokens/round"], paths["draft"]["tokens/round"], t_p, t_b, t_o) / sd_speedup(e(a_sd), t_sd)
        summary["T_b (miss wait)"], summary["T_o"] = t_b, t_o
        summary["... x SD verify / SSD verify"] = summary["SSD/SD predicted, measured T_b, T_o"] * narrow
    print()
    print_table([summary], floatfmt=".3f")
    result = {"bench": "profile_ssd_round", "machine": machine_note(), "args": vars(args),
              "parts_ms": {k: 1000 * v for k, v in parts.items()}, "mean": mean, "by_path": by_path,
              "summary": summary, "rounds_timed": len(warm), "draft_layers": draft.model.cfg.num_layers}
    print_json_line(result)
    return result


if __name__ == "__main__":
    main()
