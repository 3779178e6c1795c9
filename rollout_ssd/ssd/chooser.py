"""The chooser: which plan each SSD round runs, from the strategy rule (ssd/rule.py) and live estimates.

Per round it returns a `Plan`: SSD with a backup (the draft model, suffix or random), plain SD with the
draft model, suffix speculation, or AR. Around the rule's scores it keeps
  - at a batch bucket not yet decided at, rounds that measure each plan, cheapest first (`_explore`):
    AR, plain speculation, then SSD for decide_after timed rounds, skipped where Corollary 9's cap says
    SSD cannot beat what was measured (`_excluded`, ssd/ssd_cap.py), dropped early when its first timed rounds score
    decide_margin below the best other; each round emits tokens. With the rule off, the default SSD plan;
  - the hysteresis per batch bucket: what was chosen at a batch size stands there (a call's tail at a
    few sequences says nothing about the next call's full batch);
  - AR's decode time, calibrated by an occasional timed AR step of the batch (`calibrate`);
  - rounds of plans the rule scores without having timed them at a batch size, tried once when close
    (`_unmeasured`), and of a close runner-up now and then (`_probe`): a plan never run is never measured;
    a close one whose times there were all kept from an earlier engine (the rule's cache) runs for
    decide_after rounds, then the batch size is decided again from this engine's own times (`_recheck`).
After a draft worker failure the draft side's fallback decides instead (SD in process, or AR).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Optional

from rollout_ssd.metrics import EngineMetrics
from rollout_ssd.runner import ModelRunner
from rollout_ssd.sequence import Sequence
from rollout_ssd.ssd import rule as rules
from rollout_ssd.ssd.config import SSDConfig
from rollout_ssd.ssd.cores import TargetCores
from rollout_ssd.ssd.estimates import LiveEstimates
from rollout_ssd.ssd.plans import Plan, batch_bucket, candidate_plans
from rollout_ssd.ssd.rule import StrategyConfig, StrategyInputs, StrategyRule
from rollout_ssd.ssd.ssd_cap import SSDCap

log = logging.getLogger(__name__)

CALIBRATE_EVERY = 128  # speculating rounds between AR decode-time calibrations, after the warm-up ones
EXPLORE_TREE_ROWS = 32  # tree rows (branches over the batch) of a cache built before the rule has chosen
PROBE_EVERY = 32  # decided rounds at a batch size between probes of the runner-up plan
PROBE_WITHIN = 0.25  # ... probed when it scores within this fraction of the chosen plan
UNMEASURED_WITHIN = 0.5  # a plan never timed at a batch size: run at once when it scores within this
UNMEASURED_TRIES = 2  # ... at most this many times per batch size (a round of first rounds times nothing)
UNMEASURED_AFTER = 4  # ... once this many rounds were decided there (a generation's short tail tries none)
EXPLORE_ORDER = ("ar", "sd", "suffix", "ssd+neural", "ssd+suffix", "ssd+random")  # cheapest to measure first
# the times that say a plan was measured (not scored from priors, or derived from other plans' times)
MEASURED_BY = {"ssd+neural": ("verify",), "ssd+suffix": ("verify",), "ssd+random": ("verify",),
               "sd": ("plain_verify", "plain_draft"), "suffix": ("plain_verify",), "ar": ("decode",)}
FIRST_CALIBRATION_GAP = 16  # rounds after the warm-up calibrations (each costs one AR step of the batch)


class Chooser(SSDCap):
    """Owns the rule, the hysteresis per batch bucket and AR's calibration; `choose` gives the plan."""

    def __init__(self, config: SSDConfig, estimates: LiveEstimates, stats: EngineMetrics, backup: Optional[str]):
        self.config = config
        self.estimates = estimates
        self.stats = stats
        self.default = Plan(f"ssd+{backup}") if backup is not None else Plan.SSD_DRAFT
        self.rule = StrategyRule(StrategyConfig(candidates=tuple(p.label for p in candidate_plans(backup)),
                                                fixed=None if config.strategy_rule else self.default.label,
                                                hysteresis=config.hysteresis, switch_after=config.switch_after))
        self.current = self.default
        self.decided = False
        self._choices: dict[int, Plan] = {}  # batch_bucket -> the plan last chosen at those batch sizes
        self._measured_rounds = 0  # speculating rounds timed so far (SSDConfig.decide_after)
        self._calibrations, self._rounds_since_calibration = 0, 0
        self._restored: set[int] = set()  # buckets of kept choices (`calibrate`: no second warm-up there)
        self._since_probe: dict[int, int] = {}  # batch_bucket -> decided rounds since its last probe
        self._tries: dict[tuple[int, str], int] = {}  # (batch_bucket, plan label) -> unmeasured-plan rounds run
        self._rechecks: dict[tuple[int, str], int] = {}  # (batch_bucket, plan label) -> `_recheck` rounds run (-1: done)
        self._redecide: set[int] = set()  # buckets `_recheck` measured again: the next decision there has no hysteresis
        self._decided_rounds: dict[int, int] = {}  # batch_bucket -> rounds decided there
        self._tail_round = False  # this round runs a long call's tail plan: nothing is calibrated (`choose`)
        self.shares_cores = False  # a worker process holds a CPU core beside the target (ssd/cores.py; round.py sets it)
        self._v_waits: dict[int, int] = {}  # batch_bucket -> rounds `_explore` ran there for the cap's v (ssd_cap.py)

    def kept_choices(self) -> dict[str, str]:
        """The plan chosen at each batch bucket, as JSON data (ssd/rule_cache.py keeps it)."""
        return {str(bucket): plan.label for bucket, plan in self._choices.items()}

    def parse_choices(self, choices: Mapping) -> dict[int, Plan]:
        """An earlier engine's `kept_choices` as {bucket: plan}; a ValueError for a bucket or plan this
        chooser does not know."""
        parsed = {}
        for bucket, label in dict(choices).items():
            if not str(bucket).isdigit() or int(bucket) < 1 or label not in self.rule.config.candidates:
                raise ValueError(f"not a kept choice: bucket {bucket!r}, plan {label!r}")
            parsed[int(bucket)] = Plan(label)
        return parsed

    def restore_choices(self, choices: dict[int, Plan]) -> None:
        """Start from an earlier engine's choices (`parse_choices`): at those buckets the rule decides at
        once (no exploring rounds), keeping the choice by the hysteresis until `_recheck` has measured a close
        plan known only from those times. Nothing with the rule fixed."""
        if self.rule.config.fixed is None:
            self._choices.update(choices)
            self._restored |= set(choices)

    def choose(self, batch: int, fallback: Optional[Plan] = None, tail: bool = False, cold: bool = False) -> Plan:
        """The plan for a round of `batch` sequences; `fallback` (the draft side failed) overrides it.
        At a batch bucket not yet decided at, the plans are measured first (`_explore`), then the rule
        decides: its choice stands there by the hysteresis, with `_probe`'s rounds of the others (and
        `_recheck`'s, after which it decides there once without the hysteresis); in a
        long call's tail (`tail`: `call_tail`), once the rule has decided somewhere, the plan running
        stands instead (AR for an SSD plan; plans.TAIL_ROUNDS); AR's due re-timing waits out a `cold` one."""
        self._tail_round = False
        if fallback is not None:
            return fallback
        if self.rule.config.fixed is not None:
            return self._choose_fixed(batch)
        bucket = batch_bucket(batch)
        if tail and bucket not in self._choices and self._choices:
            self._tail_round = True
            self.current = Plan.AR if self.current.is_ssd else self.current
            return self.current
        try:
            inputs = self.estimates.inputs(batch)
        except ValueError:  # nothing timed yet (a round of first rounds times nothing)
            inputs = None
        if bucket not in self._choices:
            scores = rules.strategy_scores(inputs, self.rule.config.candidates) if inputs is not None else {}
            plan = self._explore(bucket, inputs, scores)
            if plan is not None and inputs is not None:  # what the rule would say of the plan measured
                self._publish(plan, inputs, scores, math.nan)
            if plan is not None or inputs is None:
                self.current = plan or self.current
                return self.current
        current = None if bucket in self._redecide else self._choices.get(bucket)
        self._redecide.discard(bucket)
        decision = self.rule.decide(inputs, current=None if current is None else current.label)
        chosen, scores = Plan(decision.chosen), decision.scores
        excluded = self._excluded(bucket, inputs, scores)
        self.stats.set_ssd_state(**self.cap_state(bucket, inputs, scores))  # ssd/cap, ssd/v, ssd/cap_batch
        if chosen.label in excluded:
            chosen = Plan(max((c for c in self.rule.config.candidates if c not in excluded), key=scores.get))
        if chosen is not self.current:
            log.info("SSD strategy %s -> %s (b=%d, p_hit=%.3f, scores %s, b*=%.3g)", self.current.label,
                     chosen.label, batch, inputs.p_hit, {k: round(v, 2) for k, v in scores.items()}, decision.b_star)
        log.debug("SSD strategy %s: inputs %s", chosen.label, inputs)
        self.current, self.decided, self._choices[bucket] = chosen, True, chosen
        ran = self._probe(bucket, chosen, scores, excluded)
        if ran is chosen and ran in (Plan.SD, Plan.SUFFIX) and not cold and self._times_timed("sd", bucket) \
                and self._calibration_due(bucket):
            ran = Plan.AR  # AR's due re-timing as an AR round, which emits its tokens (`calibrate`)
        self._publish(ran, inputs, scores, decision.b_star)
        return ran

    def _choose_fixed(self, batch: int) -> Plan:
        """The rule fixed to one plan (strategy_rule off: the default): the default for the first
        decide_after timed speculating rounds, then the fixed plan."""
        early = not self.decided and self._measured_rounds < self.config.decide_after
        chosen = self.default if early else Plan(self.rule.config.fixed)
        self.decided, self.current = not early, chosen
        try:
            inputs = self.estimates.inputs(batch)
        except ValueError:
            return chosen
        decision = self.rule.decide(inputs)
        self._publish(chosen, inputs, decision.scores, decision.b_star)
        return chosen

    def _publish(self, ran: Plan, inputs: StrategyInputs, scores: dict[str, float], b_star: float) -> None:
        """The rule's state for the `ssd/*` metrics: the plan run, the scores, the prediction for the plan
        run (its score over AR's) and the rule's own T_p / T_b (a round that measures them overwrites)."""
        timing = {"T_p": inputs.primary_seconds / inputs.verify_seconds}
        if "draft" in inputs.draft_seconds:
            timing["T_b"] = inputs.draft_seconds["draft"] / inputs.verify_seconds
        ar = scores.get("ar") or inputs.batch_size / inputs.decode_seconds
        self.stats.set_ssd_state(strategy=ran.label, b_star=b_star, predicted_speedup=scores[ran.label] / ar,
                                 scores=dict(scores), p_hit_estimate=inputs.p_hit, **timing)

    def _explore(self, bucket: int, inputs: Optional[StrategyInputs], scores: dict[str, float]) -> Optional[Plan]:
        """The next plan to measure at a bucket the rule has not decided at, or None when each was
        measured (or ruled out): AR first (the cheapest round), then plain speculation, then SSD, each for
        decide_after timed rounds (one round's timing is noisy), SSD not where Corollary 9's cap
        (`_excluded`) says it cannot beat what was measured; a plan whose first timed rounds score
        decide_margin below the best other measured one is left there, and so is one timed at the next
        larger bucket that scores so far below here (a GRPO call's batch shrinks: bench/RESULTS.md, "The
        float32 rows kernel"). Each round emits tokens; a round of first rounds times nothing, hence one
        try more than the timed rounds needed. `scores`: the rule's for `inputs` (empty: nothing timed). Where
        SSD waits for the cap's v beside a worker (`_v_pending`), rounds of the better of AR and SD time it."""
        excluded = self._excluded(bucket, inputs, scores) if inputs is not None else set()
        for label in EXPLORE_ORDER:
            if label not in self.rule.config.candidates or label in excluded:
                continue
            plan = Plan(label)
            need = 1 if plan is Plan.AR else self.config.decide_after
            have = self._times_timed(label, bucket)
            tries = self._tries.get((bucket, label), 0)
            if have >= need or tries > need:
                continue
            measured = self._measured_others(bucket, scores)
            others = [c for c in (measured or ["ar"]) if c != label]
            # a clear loser after its first timed rounds here, or (not yet timed here) as scored from its
            # times at the next larger bucket, where it was timed: a batch at most twice as small, whose
            # estimate is that one scaled (`_BatchTimes`); further down it is explored again
            timed_above = not have and bool(measured) and self._times_timed(label, bucket + 1) > 0
            if plan is not Plan.AR and (have or timed_above) and others:
                if scores[label] < max(scores[c] for c in others) * (1 - self.config.decide_margin):
                    continue
            self._tries[(bucket, label)] = tries + 1
            return plan
        if inputs is not None and self._v_pending(bucket, inputs.batch_size):
            # SSD waits for the cap's v: a round of the better of AR and SD times it (`calibrate`; an SD round
            # by its own verify, whose `count_round(narrow=True)` gives back the try counted here)
            self._v_waits[bucket] = self._v_waits.get(bucket, 0) + 1
            plan = Plan(max((c for c in ("sd", "ar") if c in scores and c in self.rule.config.candidates),
                            key=scores.get, default="ar"))
            self._tries[(bucket, plan.label)] = self._tries.get((bucket, plan.label), 0) + 1
            return plan
        return None

    def _times_timed(self, label: str, bucket: int) -> int:
        """Rounds of plan `label` timed at this bucket: the fewest measurements of the times it needs."""
        return min(self.estimates.times_measured(name, bucket) for name in MEASURED_BY[label])

    def _timed_here(self, label: str, bucket: int) -> int:
        """`_times_timed` by this engine's own rounds (not counting times kept from an earlier engine)."""
        return min(self.estimates.times_measured(name, bucket, here=True) for name in MEASURED_BY[label])

    def budget_cap(self, batch: int, plan: Optional[Plan] = None) -> Optional[int]:
        """A bound on the fan-out budget per sequence while the rule has not chosen at this batch size,
        and for a round of `plan` that only measures it (an SSD plan not chosen there: `_unmeasured`,
        `_probe`): a full tree over a large batch costs several verifies (two tries at 21 GRPO sequences
        cost 2.2 s, bench/RESULTS.md, "A fifth CPU kind"); EXPLORE_TREE_ROWS branches over the batch in
        all. None once chosen for the plan chosen, or with the rule off."""
        if self.rule.config.fixed is not None:
            return None
        chosen = self._choices.get(batch_bucket(batch))
        if chosen is not None and (plan is None or plan is chosen or not plan.is_ssd):
            return None
        return max(1, EXPLORE_TREE_ROWS // batch)

    def _probe(self, bucket: int, chosen: Plan, scores: dict[str, float], excluded: set[str]) -> Plan:
        """Every PROBE_EVERY decided rounds at a batch size, one round of the best other plan when it
        scores within PROBE_WITHIN of the chosen one: a plan that is not run is not measured, so its
        estimate keeps what its few (often first, slowest) rounds said, and a close call would otherwise
        stand on it for good. The probe's round refreshes that estimate; the choice at the batch size
        stands (the hysteresis decides on the next rounds as always)."""
        if self.rule.config.fixed is not None:
            return chosen
        self._decided_rounds[bucket] = self._decided_rounds.get(bucket, 0) + 1
        unmeasured = self._unmeasured(bucket, chosen, scores, excluded) or self._recheck(bucket, chosen, scores, excluded)
        if unmeasured is not None:
            return unmeasured
        self._since_probe[bucket] = self._since_probe.get(bucket, 0) + 1
        if self._since_probe[bucket] < PROBE_EVERY:
            return chosen
        self._since_probe[bucket] = 0
        others = [c for c in self.rule.config.candidates if c != chosen.label and c not in excluded]
        runner_up = max(others, key=lambda c: scores[c], default=None)
        if runner_up is None or scores[runner_up] < scores[chosen.label] * (1 - PROBE_WITHIN):
            return chosen
        return Plan(runner_up)

    def _unmeasured(self, bucket: int, chosen: Plan, scores: dict[str, float], excluded: set[str]) -> Optional[Plan]:
        """The best-scoring other plan never timed at this batch bucket, when it scores within
        UNMEASURED_WITHIN of the chosen one (UNMEASURED_TRIES rounds at most): one scored from priors or
        other plans' times led the rule astray on a CPU (bench/RESULTS.md, the seventh session's
        section); one round measures it. Timed at the next larger bucket counts as measured (scaled).
        None when every close plan is measured, or before UNMEASURED_AFTER decided rounds at the bucket."""
        for label in self._close_others(bucket, chosen, scores, excluded, UNMEASURED_WITHIN):
            tries = self._tries.get((bucket, label), 0)
            if tries < UNMEASURED_TRIES and not self._times_timed(label, bucket) \
                    and not self._times_timed(label, bucket + 1):  # (scaled from there: `_explore`)
                self._tries[(bucket, label)] = tries + 1
                return Plan(label)
        return None

    def _close_others(self, bucket: int, chosen: Plan, scores: dict[str, float], excluded: set[str], within: float):
        """The candidate plans other than `chosen` (none of `excluded`) scoring within `within` of it, best first;
        none before UNMEASURED_AFTER decided rounds at the bucket (`_unmeasured`'s and `_recheck`'s walk)."""
        if self._decided_rounds[bucket] < UNMEASURED_AFTER:
            return
        for label in sorted(scores, key=scores.get, reverse=True):
            if label == chosen.label or label not in self.rule.config.candidates or label in excluded:
                continue
            if scores[label] < scores[chosen.label] * (1 - within):
                return
            yield label

    def _recheck(self, bucket: int, chosen: Plan, scores: dict[str, float], excluded: set[str]) -> Optional[Plan]:
        """A close plan (within PROBE_WITHIN of the chosen one) whose times at this bucket all came from an
        earlier engine (ssd/rule_cache.py): another hour of a shared host, and acceptance and tokens per
        round of another workload, which a choice would otherwise stand on for good (a plan not run is not
        measured; its draft's first round after others' is a catch-up, not a drafting time). It runs for
        decide_after timed rounds here (one try more: a round of first rounds times nothing), then the
        choice at this bucket is made again with what this engine measured, as at a bucket it explored
        (the hysteresis is for its own choices). None before UNMEASURED_AFTER decided rounds there."""
        for label in self._close_others(bucket, chosen, scores, excluded, PROBE_WITHIN):
            key, need = (bucket, label), 1 if label == "ar" else self.config.decide_after  # (as `_explore`)
            if key not in self._rechecks:
                if not self._times_timed(label, bucket) or self._timed_here(label, bucket):
                    continue  # never timed (`_unmeasured`), or timed by this engine
                self._rechecks[key] = 0
            if self._rechecks[key] < 0:  # done
                continue
            if self._timed_here(label, bucket) >= need or self._rechecks[key] > need:
                self._rechecks[key] = -1
                self._redecide.add(bucket)  # decided again on the next round there (`choose`)
                return None
            self._rechecks[key] += 1
            return Plan(label)
        return None

    def count_round(self, plan: Plan, cold: bool, batch: int = 1, narrow: bool = False) -> None:
        """A round ran: an AR round not `cold` measured AR's step (a calibration, `choose`'s swap among
        them); a speculating round that was timed counts towards decide_after; a `narrow_verify` round
        timed no SD round, so it gives back the try `_explore` counted."""
        if narrow:
            key = (batch_bucket(batch), plan.label)
            self._tries[key] = max(0, self._tries.get(key, 0) - 1)
            if self._rechecks.get(key, 0) > 0:
                self._rechecks[key] -= 1
        if plan is Plan.AR and not cold:
            self._calibrations, self._rounds_since_calibration = self._calibrations + 1, 0
        elif plan is not Plan.AR:
            self._measured_rounds += not cold

    def calibrate(self, runner: ModelRunner, running: list[Sequence], cold: bool,
                  cores: Optional[TargetCores] = None, plan: Optional[Plan] = None) -> float:
        """Time one plain AR decode forward of this batch (then undo it): the rule compares against AR's
        real step, not a prior (docs/THEORY.md §3). With the rule fixed, on each of the first
        `decide_after` timed speculating rounds (a median: one slow step cannot set the first decision);
        deciding, AR's own rounds measured it first (`_explore`). Then FIRST_CALIBRATION_GAP rounds later
        (not from kept choices), then every CALIBRATE_EVERY; never in a round of first rounds (`cold`)
        nor in a long call's tail. Beside a worker (`cores`) in AR and (rule deciding) SD rounds, once per
        bucket where it could change the answer, the cap's one-core time (`_time_verify_shape`). Called
        between the draft side's answer and the chains it is sent (no cache build competes for memory).
        While SD is untimed at this bucket, the AR step is timed on the target's own core too
        ("decode_narrow": it scales plain speculation's priors). Returns the seconds spent."""
        if cold or self._tail_round:
            return 0.0
        bucket = batch_bucket(len(running))
        if plan is Plan.AR or (plan is Plan.SD and self.rule.config.fixed is None):
            shape = self._time_verify_shape(runner, running, cores, plan)
            if plan is Plan.AR:  # the round is AR's step on every core: timed as it runs
                return shape
        else:
            shape = 0.0
        if not self._calibration_due(bucket):
            self._rounds_since_calibration += 1
            return shape
        seconds, was_wide = shape, cores is None or cores.is_wide
        if cores is not None and not self._times_timed("sd", bucket):
            cores.narrow()
            seconds += self._time_step(runner, running, "decode_narrow")
            cores.widen()
        seconds += self._time_step(runner, running, "decode")
        if not was_wide:
            cores.narrow()
        self._calibrations, self._rounds_since_calibration = self._calibrations + 1, 0
        return seconds

    def _calibration_due(self, bucket: int) -> bool:
        """Whether AR's step is due for a re-timing (`calibrate`). Rule deciding: AR's rounds measured it
        first (`_explore`); from kept choices, no second warm-up at their buckets."""
        warmup = self.config.decide_after if self.rule.config.fixed is not None else 1
        second = self._calibrations == warmup and bucket not in self._restored
        gap = 0 if self._calibrations < warmup else FIRST_CALIBRATION_GAP if second else CALIBRATE_EVERY
        return not self._calibrations or self._rounds_since_calibration >= gap

