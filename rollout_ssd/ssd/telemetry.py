"""Round telemetry for SSD: what one round measured, fed to the estimates, the fan-out planner, the
engine's stats (`ssd/*` metrics) and, when asked for, a per-round trace (bench/probes/trace_rule.py).

What is left out, and why:
  - a round of first rounds only (a generation's cold start) times nothing: it carries one-off costs
    (weight copies remade after a policy update, first touches of the KV cache) that later rounds do
    not, and one such time would hold a plan's estimate down until that plan runs again; nor does an
    SSD round with no cache built for any sequence (the first after AR or SD rounds: the draft side
    catches up on every sequence's tokens while the target waits);
  - acceptance and tokens per round leave out each sequence's first round: the first tokens after a
    prompt are the easiest (bench/RESULTS.md), every rollout has one, and the rule decides about the
    rounds after it.
Draft-side times are the target's waits (ssd/rule.py): on-demand drafting, or the cache's transfer.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Optional

from rollout_ssd.decode import RoundOutcome
from rollout_ssd.metrics import EngineMetrics
from rollout_ssd.ssd.draft_side import Chains
from rollout_ssd.ssd.estimates import LiveEstimates
from rollout_ssd.ssd.fanout import FanoutPlan, FanoutPlanner
from rollout_ssd.ssd.plans import Plan


@dataclass(frozen=True)
class RoundTimes:
    """Seconds of one round: all of it, the verify (or AR step), and the AR calibration inside it."""

    total: float
    verify: float
    calibration: float


class RoundTelemetry:
    def __init__(self, estimates: LiveEstimates, planner: FanoutPlanner, stats: EngineMetrics,
                 backup_name: Optional[str]):
        self.estimates = estimates
        self.planner = planner
        self.stats = stats
        self.backup_name = backup_name  # the fast backup speculator's name ("suffix" | "random"), if any
        self.trace: Optional[list[dict]] = None  # set to a list to get a record of each round
        self._prev_verify: Optional[float] = None
        self._prev_batch = 1
        self._prev_budget = 0

    def observe(self, plan: Plan, fanout: FanoutPlan, rnd: Chains, ks: list[int], outcome: RoundOutcome,
                verify_seconds: float, narrow: bool = False) -> None:
        est, b = self.estimates, len(ks)
        # an SSD round for which no cache was built (after AR or SD rounds: the draft side catches up on
        # every sequence) times nothing either: its wait is that one-off catch-up, not a cache's
        unwarm = plan.is_ssd and not any(rnd.warm)
        timed = (lambda name, seconds, batch: None) if rnd.cold or unwarm else est.observe_time
        if narrow:  # an SD round verified on the target's own core (Chooser.narrow_verify): that time only,
            timed("verify_narrow", verify_seconds, b)  # its whole chains are not SD's lengths, nor its core
        else:  # an AR round is a one-token step: AR's time, not a K+1-token verify's; a plain speculation
            # round's verify has no cache build beside it (and on a CPU may have the worker's core too)
            timed("decode" if plan is Plan.AR else "verify" if plan.is_ssd else "plain_verify", verify_seconds, b)
            self._observe_acceptance(rnd, outcome)
        asked = [i for i in range(b) if ks[i] > 0]
        warm = [i for i in asked if rnd.warm[i]]
        hits = [i for i in asked if rnd.paths[i] == "hit"]
        if plan.is_ssd:
            self.stats.add_ssd_round(plan.label, len(asked), len(hits), len(warm))
        else:
            self.stats.add_ssd_round(plan.label, 0, 0, 0)
        if warm:
            est.observe_cache(len([i for i in warm if rnd.paths[i] == "hit"]),
                              len([i for i in warm if rnd.paths[i] != "hit"]))
            self.planner.observe_cache([rnd.cached[i] for i in warm], [rnd.paths[i] == "hit" for i in warm])
        state = {"fanout": list(fanout.fanout), "a_estimate": fanout.a, "r_estimate": fanout.r,
                 "predicted_miss_rate": fanout.predicted_miss_rate}
        if not narrow:
            state.update(self._observe_draft_times(plan, rnd, asked, verify_seconds, timed))
        self._prev_verify, self._prev_batch = verify_seconds, b
        self._prev_budget = fanout.budget if plan.is_ssd else 0
        state["strategy"] = plan.label
        self.stats.set_ssd_state(**state)

    def _observe_acceptance(self, rnd: Chains, outcome: RoundOutcome) -> None:
        groups: dict[str, list[int]] = {}
        for i, path in enumerate(rnd.paths):
            if not rnd.first[i]:
                groups.setdefault(path, []).append(i)
        for path, idx in groups.items():
            if path == "none":
                continue
            acc = sum(outcome.accepted[i] for i in idx)
            judged = acc + sum(int(outcome.rejected[i]) for i in idx)
            self.estimates.observe_round(path, len(idx), acc, judged, acc + len(idx))
            if path in ("hit", "draft"):
                self.planner.observe_acceptance(acc, judged)

    def _observe_draft_times(self, plan: Plan, rnd: Chains, asked: list[int], verify_seconds: float,
                             timed) -> dict:
        """T_p (the cache build), T_b (the draft on demand, or the fast backup) and T_o (the cache's
        transfer), as the `ssd/*` state they set. SD's drafting is timed apart ("plain_draft"): on a CPU
        it runs in the target's process on every core, not in the worker as an SSD round's misses do."""
        state, b, reply = {}, len(rnd.paths), rnd.reply
        # the draft caught up on rounds it sat out (AR's; `Chains.lagged`): a one-off, not a drafting time
        drafting = (lambda name, seconds, batch: None) if rnd.lagged else timed
        if reply is None and plan is Plan.SD and any(p == "draft" for p in rnd.paths):  # drafted in process
            drafting("plain_draft", rnd.wait_seconds, b)
            state["T_b"] = rnd.wait_seconds / verify_seconds
        if reply is not None:
            if reply.build_seconds > 0 and self._prev_verify:
                timed("primary", reply.build_seconds, self._prev_batch)
                self.planner.observe_timing(reply.build_seconds, max(self._prev_budget, 1), self._prev_verify,
                                            min(reply.glue_seconds, reply.build_seconds))
                state["T_p"] = reply.build_seconds / self._prev_verify
            if any(p == "draft" for p in rnd.paths):
                drafting("draft" if plan.is_ssd else "plain_draft", rnd.wait_seconds, b)
                if plan.is_ssd and reply.backup_seconds > 0:  # the worker's own drafting: SD's prior
                    drafting("drafting", reply.backup_seconds, b)
                if rnd.drafted_here is not None and not rnd.drafted_here[2]:  # the SD speculator on every core: SD's
                    drafting("plain_draft", rnd.drafted_here[1], rnd.drafted_here[0])  # drafting, unless it caught up
                    # on rows that were hits (an SSD cost, in "draft" above, not SD's)
                state["T_b"] = rnd.wait_seconds / verify_seconds
            elif asked and all(rnd.paths[i] == "hit" for i in asked):
                excess = max(0.0, reply.build_seconds - (self._prev_verify or 0.0))  # counted in T_p
                overhead = max(0.0, rnd.wait_seconds - excess)
                timed("overhead", overhead, b)
                state["T_o"] = overhead / verify_seconds
        if rnd.backup_seconds and self.backup_name in ("suffix", "random"):
            timed(self.backup_name, rnd.backup_seconds, b)
            state["T_b"] = rnd.backup_seconds / verify_seconds
        return state

    def record(self, plan: Plan, fanout: FanoutPlan, rnd: Chains, emitted: int, times: RoundTimes) -> None:
        """Append the round to `trace`, when one is kept (its keys: bench/probes/trace_rule.py)."""
        if self.trace is None:
            return
        state = self.stats.ssd_state
        self.trace.append({
            "batch": len(rnd.paths), "strategy": plan.label, "cold": rnd.cold, "emitted": emitted,
            "seconds": times.total, "verify_seconds": times.verify, "wait_seconds": rnd.wait_seconds,
            "calibration_seconds": times.calibration, "paths": dict(Counter(rnd.paths)),
            "fanout": list(fanout.fanout), "scores": dict(state.get("scores", {})),
            "predicted_speedup": state.get("predicted_speedup"), "p_hit_estimate": state.get("p_hit_estimate")})
