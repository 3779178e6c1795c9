"""The chooser: which plan each SSD round runs, from the strategy rule (ssd/rule.py) and live estimates.

Per round it returns a `Plan`: SSD with a backup (the draft model, suffix or random), plain SD with the
draft model, suffix speculation, or AR. Around the rule's scores it keeps
  - at a batch bucket not yet decided at, rounds that measure each plan, cheapest first (`_explore`):
    AR, plain speculation, then SSD for decide_after timed rounds, skipped where Corollary 9's cap says
    SSD cannot beat what was measured (`_excluded`), dropped early when its first timed rounds score
    decide_margin below the best other; each round emits tokens. With the rule off, the default SSD plan;
  - the hysteresis per batch bucket: what was chosen at a batch size stands there (a call's tail at a
    few sequences says nothing about the next call's full batch);
  - AR's decode time, calibrated by an occasional timed AR step of the batch (`calibrate`);
  - rounds of plans the rule scores without having timed them at a batch size, tried once when close
    (`_unmeasured`), and of a close runner-up now and then (`_probe`): a plan never run is never measured.
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
from rollout_ssd.ssd.rule import StrategyConfig, StrategyInputs, StrategyRule, expected_tokens_per_round
from rollout_ssd.ssd.timed_forward import timed_forward

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
VERIFY_SHAPE_MAX_ROWS = 64  # beyond: the one-core step is an AR step (a verify's shape there costs a verify or more)
FIRST_CALIBRATION_GAP = 16  # rounds after the warm-up calibrations (each costs one AR step of the batch)


class Chooser:
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
        self._decided_rounds: dict[int, int] = {}  # batch_bucket -> rounds decided there
        self._tail_round = False  # this round runs a long call's tail plan: nothing is calibrated (`choose`)

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
        once (no exploring rounds), keeping the choice by the hysteresis. Nothing with the rule fixed."""
        if self.rule.config.fixed is None:
            self._choices.update(choices)
            self._restored |= set(choices)

    def choose(self, batch: int, fallback: Optional[Plan] = None, tail: bool = False, cold: bool = False) -> Plan:
        """The plan for a round of `batch` sequences; `fallback` (the draft side failed) overrides it.
        At a batch bucket not yet decided at, the plans are measured first (`_explore`), then the rule
        decides: its choice stands there by the hysteresis, with `_probe`'s rounds of the others; in a
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
        current = self._choices.get(bucket)
        decision = self.rule.decide(inputs, current=None if current is None else current.label)
        chosen, scores = Plan(decision.chosen), decision.scores
        excluded = self._excluded(bucket, inputs, scores)
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
        try more than the timed rounds needed. `scores`: the rule's for `inputs` (empty: nothing timed)."""
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
        return None

    def _times_timed(self, label: str, bucket: int) -> int:
        """Rounds of plan `label` timed at this bucket: the fewest measurements of the times it needs."""
        return min(self.estimates.times_measured(name, bucket) for name in MEASURED_BY[label])

    def _measured_others(self, bucket: int, scores: dict[str, float]) -> list[str]:
        """The non-SSD plans timed at this bucket (AR, plain speculation): what an SSD plan must beat."""
        return [c for c in scores if not Plan(c).is_ssd and c in self.rule.config.candidates
                and self._times_timed(c, bucket)]

    def _excluded(self, bucket: int, inputs: StrategyInputs, scores: dict[str, float]) -> set[str]:
        """SSD plans not yet timed at this bucket that cannot beat the best timed AR / plain plan:
        Corollary 9's cap, here in tokens per second. A round of SSD costs at least one SSD verify, and
        emits at most a full K-token draft chain's tokens E(a, K) per sequence (every verdict a hit, the
        cache build hidden, no transfer); beside a worker on a CPU its verify runs on fewer cores, at
        least SD's verify (timed here; else its lower bound from the next larger bucket, `scaled_down`, or
        an AR step) / v, v = (SD's verify, on every core, as it was then) / (the verify's shape on the
        target's own core; else the same ratio of AR steps; 1 while neither was timed). So SSD
        <= b * E(a, K) * v / t_verify(SD), which is SD's rate times v * (1 + T_SD) * E(a, K) / E_SD
        (docs/THEORY.md, Corollary 9 on different hardware). Empty until AR or SD was timed here."""
        ssd, best = self._cap_question(bucket, scores)
        if not ssd:
            return set()
        return set(ssd) if self._ssd_cap(bucket, inputs, v=None) <= best else set()

    def _cap_question(self, bucket: int, scores: dict[str, float]) -> tuple[list[str], float]:
        """The SSD plans not yet timed at this bucket and the best measured AR / plain rate they must beat
        (no plans while neither AR nor plain speculation was timed here)."""
        measured = self._measured_others(bucket, scores)
        ssd = [c for c in self.rule.config.candidates if Plan(c).is_ssd and not self._times_timed(c, bucket)]
        if not ssd or not measured:
            return [], 0.0
        return ssd, max(scores[c] for c in measured)

    def _ssd_cap(self, bucket: int, inputs: StrategyInputs, v: Optional[float]) -> float:
        """`_excluded`'s bound on SSD's batch tokens per second at v (None: v from what was timed here)."""
        est, b = self.estimates, inputs.batch_size
        verify = inputs.plain_verify_seconds if est.measured("plain_verify", bucket) else inputs.decode_seconds
        if not est.measured("plain_verify", bucket) and est.measured("plain_verify", bucket + 1):
            verify = max(verify, est.scaled_down("plain_verify", b, bucket + 1))  # SD left unmeasured here (`_explore`)
        if v is None:
            v = 1.0
            if est.measured("verify_narrow", bucket) and est.measured("plain_verify", bucket):
                ref = est.seconds("narrow_ref", b) if est.measured("narrow_ref", bucket) else verify  # (then)
                v = min(1.0, ref / est.seconds("verify_narrow", b))  # the verify's own shape on one core
            elif est.measured("decode_narrow", bucket) and est.measured("decode", bucket):
                v = min(1.0, est.seconds("decode", b) / est.seconds("decode_narrow", b))
        return b * expected_tokens_per_round(est.accept_rate("draft"), inputs.k) * v / verify

    def _needs_verify_shape(self, bucket: int, batch: int) -> bool:
        """Whether `_excluded`'s v is worth timing at this bucket: SSD plans are untimed here and plain
        speculation's verify was measured by this engine (the cap's denominator, and "narrow_ref"), yet
        the cap at v = 1 (v <= 1: what it excludes every v excludes) does not exclude them."""
        if not self.estimates.live("plain_verify", bucket):
            return False
        inputs = self.estimates.inputs(batch)
        ssd, best = self._cap_question(bucket, rules.strategy_scores(inputs, self.rule.config.candidates))
        return bool(ssd) and self._ssd_cap(bucket, inputs, v=1.0) > best

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
        unmeasured = self._unmeasured(bucket, chosen, scores, excluded)
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
        if self._decided_rounds[bucket] < UNMEASURED_AFTER:
            return None
        for label in sorted(scores, key=scores.get, reverse=True):
            if label == chosen.label or label not in self.rule.config.candidates or label in excluded:
                continue
            if scores[label] < scores[chosen.label] * (1 - UNMEASURED_WITHIN):
                return None
            tries = self._tries.get((bucket, label), 0)
            if tries < UNMEASURED_TRIES and not self._times_timed(label, bucket) \
                    and not self._times_timed(label, bucket + 1):  # (scaled from there: `_explore`)
                self._tries[(bucket, label)] = tries + 1
                return Plan(label)
        return None

    def count_round(self, plan: Plan, cold: bool, batch: int = 1, narrow: bool = False) -> None:
        """A round ran: an AR round not `cold` measured AR's step (a calibration, `choose`'s swap among
        them); a speculating round that was timed counts towards decide_after; a `narrow_verify` round
        timed no SD round, so it gives back the try `_explore` counted."""
        if narrow:
            key = (batch_bucket(batch), plan.label)
            self._tries[key] = max(0, self._tries.get(key, 0) - 1)
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

    def narrow_verify(self, batch: int, cores: Optional[TargetCores]) -> bool:
        """Whether this SD round (the rule deciding) verifies on the target's own core as the cap's
        "verify_narrow" (`_time_verify_shape`), its chains drafted whole (the SSD verify's shape): a round
        that emits tokens costs what its verify loses on one core, not a forward more."""
        return self.rule.config.fixed is None and not self._tail_round and self._verify_shape(batch, cores) == "verify_narrow"

    def _verify_shape(self, batch: int, cores: Optional[TargetCores]) -> Optional[str]:
        """The one-core time `_excluded`'s v still needs at this batch ("verify_narrow"; past
        VERIFY_SHAPE_MAX_ROWS rows "decode_narrow", an AR step), or None."""
        bucket = batch_bucket(batch)
        name = "verify_narrow" if batch * (self.config.k + 1) <= VERIFY_SHAPE_MAX_ROWS else "decode_narrow"
        if cores is None or self.estimates.measured(name, bucket) or not self._needs_verify_shape(bucket, batch):
            return None
        return name

    def _time_verify_shape(self, runner: ModelRunner, running: list[Sequence], cores: Optional[TargetCores],
                           plan: Optional[Plan]) -> float:
        """Beside a worker, once per batch bucket where `_needs_verify_shape`: one forward of the verify's
        shape (K+1 tokens per sequence; an AR step beyond VERIFY_SHAPE_MAX_ROWS rows) on the target's own
        core, "verify_narrow" / "decode_narrow" (`_excluded`'s v); an SD round's own verify times the
        first (`narrow_verify`). Returns the seconds spent."""
        if plan is Plan.SD and len(running) * (self.config.k + 1) <= VERIFY_SHAPE_MAX_ROWS:
            return 0.0  # the round's own verify, asked before it drafted (`narrow_verify`)
        name = self._verify_shape(len(running), cores)
        if name is None:
            return 0.0
        cores.narrow()
        seconds = self._time_step(runner, running, name, tokens=self.config.k + 1 if name == "verify_narrow" else 1)
        cores.widen()
        return seconds

    def _time_step(self, runner: ModelRunner, running: list[Sequence], name: str, tokens: int = 1) -> float:
        """`timed_forward`, its seconds observed as time `name`."""
        seconds = timed_forward(runner, running, tokens)
        self.estimates.observe_time(name, seconds, len(running))
        return seconds
