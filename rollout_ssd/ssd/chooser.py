"""The chooser: which plan each SSD round runs, from the strategy rule (ssd/rule.py) and live estimates.

Per round it returns a `Plan`: SSD with a backup (the draft model, suffix or random), plain SD with the
draft model, suffix speculation, or AR. Around the rule's scores it keeps
  - a default (SSD with the configured backup) until the rule has timed rounds to go by, and while
    fewer than decide_after speculating rounds were timed it leaves the default only for a plan that
    scores decide_margin better (one round's timings are noisy);
  - the hysteresis per batch bucket: what was chosen at a batch size stands there (a sample() call's
    tail at a few sequences says nothing about the next call's full batch);
  - AR's decode time, calibrated by an occasional timed AR step of the batch (`calibrate`).
After a draft worker failure the draft side's fallback decides instead (SD in process, or AR).
"""

from __future__ import annotations

import logging
from enum import Enum
from typing import Optional

from rollout_ssd.gpu.timing import DeviceTimer
from rollout_ssd.metrics import EngineMetrics
from rollout_ssd.runner import ModelRunner
from rollout_ssd.sequence import Sequence
from rollout_ssd.ssd.config import SSDConfig
from rollout_ssd.ssd.cores import TargetCores
from rollout_ssd.ssd.estimates import LiveEstimates
from rollout_ssd.ssd.rule import StrategyConfig, StrategyRule

log = logging.getLogger(__name__)

CALIBRATE_EVERY = 128  # speculating rounds between AR decode-time calibrations, after the warm-up ones
EXPLORE_TREE_ROWS = 32  # tree rows (branches over the batch) of a cache built before the rule has chosen
PROBE_EVERY = 32  # decided rounds at a batch size between probes of the runner-up plan
PROBE_WITHIN = 0.25  # ... probed when it scores within this fraction of the chosen plan
FIRST_CALIBRATION_GAP = 16  # rounds after the warm-up calibrations (each costs one AR step of the batch)


class Plan(Enum):
    """What one round runs. The value is its label: what `ssd/strategy`, `ssd/scores` and
    `ssd/strategy_rounds` report, and the rule's name for it."""

    SSD_DRAFT = "ssd+neural"  # SSD; the draft model drafts a chain on a miss
    SSD_SUFFIX = "ssd+suffix"  # SSD; the suffix speculator covers misses
    SSD_RANDOM = "ssd+random"  # SSD; the random speculator covers misses
    SD = "sd"  # plain SD with the draft model (on the draft side)
    SUFFIX = "suffix"  # plain SD with the suffix speculator
    AR = "ar"

    @property
    def label(self) -> str:
        return self.value

    @property
    def is_ssd(self) -> bool:
        """Chains come from the speculation cache, and the draft side builds the next one."""
        return self in (Plan.SSD_DRAFT, Plan.SSD_SUFFIX, Plan.SSD_RANDOM)

    @property
    def asks_draft_side(self) -> bool:
        """The draft side is asked for this round's chains."""
        return self.is_ssd or self is Plan.SD

    @property
    def drafts_on_miss(self) -> bool:
        """Where the cache has no chain, the draft side drafts one on demand."""
        return self in (Plan.SSD_DRAFT, Plan.SD)

    @property
    def uses_backup(self) -> bool:
        """The fast backup speculator proposes where the draft side gave no chain."""
        return self in (Plan.SSD_SUFFIX, Plan.SSD_RANDOM, Plan.SUFFIX)


def batch_bucket(batch: int) -> int:
    """Batch sizes that share a plan choice: 1, 2-3, 4-7, 8-15, 16-31, ..."""
    return batch.bit_length()


def candidate_plans(backup: Optional[str]) -> tuple[Plan, ...]:
    """What the rule may pick, given the fast backup speculator (None: the draft model covers misses)."""
    plans = [Plan.SSD_DRAFT, Plan.SD, Plan.AR]
    if backup == "suffix":
        plans[1:1] = [Plan.SSD_SUFFIX]
        plans[3:3] = [Plan.SUFFIX]
    elif backup == "random":
        plans[1:1] = [Plan.SSD_RANDOM]
    return tuple(plans)


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
        self._since_probe: dict[int, int] = {}  # batch_bucket -> decided rounds since its last probe

    def choose(self, batch: int, fallback: Optional[Plan] = None) -> Plan:
        """The plan for a round of `batch` sequences; `fallback` (the draft side failed) overrides it."""
        if fallback is not None:
            return fallback
        # few timed rounds yet: noisy estimates. Over once a plan was taken for a clear lead (it then
        # stands by the hysteresis like any choice; AR rounds add no speculating round to the count)
        early = not self.decided and self._measured_rounds < self.config.decide_after
        if early and not self._measured_rounds:
            return self.default
        try:
            inputs = self.estimates.inputs(batch)
        except ValueError:  # a time the rule needs was never measured
            return self.default
        # the first decision at a batch size (the plan so far was a default, not a choice) is taken at once
        bucket = batch_bucket(batch)
        current = self._choices.get(bucket) if self.decided else None
        decision = self.rule.decide(inputs, current=None if current is None else current.label)
        chosen, scores = Plan(decision.chosen), decision.scores
        if early:  # leave the default only for a plan clearly better than it, beyond the noise
            margin = 1 + self.config.decide_margin
            if self.rule.config.fixed is not None or scores[chosen.label] <= scores[self.default.label] * margin:
                chosen = self.default
        self.decided = not early or chosen is not self.default  # early only while not yet decided
        if chosen is not self.current:
            log.info("SSD strategy %s -> %s (b=%d, p_hit=%.3f, scores %s, b*=%.3g)", self.current.label,
                     chosen.label, batch, inputs.p_hit, {k: round(v, 2) for k, v in scores.items()}, decision.b_star)
        log.debug("SSD strategy %s: inputs %s", chosen.label, inputs)
        self.current = chosen
        if self.decided:
            self._choices[bucket] = chosen
            chosen = self._probe(bucket, chosen, scores)
        # the rule's own inputs; a round that measures T_p / T_b directly overwrites them (telemetry)
        timing = {"T_p": inputs.primary_seconds / inputs.verify_seconds}
        if "draft" in inputs.draft_seconds:
            timing["T_b"] = inputs.draft_seconds["draft"] / inputs.verify_seconds
        predicted = decision.predicted_speedup * scores[chosen.label] / scores[decision.chosen]  # of the one run
        self.stats.set_ssd_state(strategy=chosen.label, b_star=decision.b_star, predicted_speedup=predicted,
                                 scores=dict(scores), p_hit_estimate=inputs.p_hit, **timing)
        return chosen

    def budget_cap(self, batch: int) -> Optional[int]:
        """A bound on the fan-out budget per sequence while the rule has not chosen at this batch size:
        the first rounds run SSD to measure it, and a full tree over a large batch costs several verifies
        (the first call of a fresh engine would pay them); EXPLORE_TREE_ROWS branches over the batch in
        all. None once chosen, or with the rule off."""
        if self.rule.config.fixed is not None or batch_bucket(batch) in self._choices:
            return None
        return max(1, EXPLORE_TREE_ROWS // batch)

    def _probe(self, bucket: int, chosen: Plan, scores: dict[str, float]) -> Plan:
        """Every PROBE_EVERY decided rounds at a batch size, one round of the best other plan when it
        scores within PROBE_WITHIN of the chosen one: a plan that is not run is not measured, so its
        estimate keeps what its few (often first, slowest) rounds said, and a close call would otherwise
        stand on it for good. The probe's round refreshes that estimate; the choice at the batch size
        stands (the hysteresis decides on the next rounds as always)."""
        if self.rule.config.fixed is not None:
            return chosen
        self._since_probe[bucket] = self._since_probe.get(bucket, 0) + 1
        if self._since_probe[bucket] < PROBE_EVERY:
            return chosen
        self._since_probe[bucket] = 0
        others = [c for c in self.rule.config.candidates if c != chosen.label]
        runner_up = max(others, key=lambda c: scores[c], default=None)
        if runner_up is None or scores[runner_up] < scores[chosen.label] * (1 - PROBE_WITHIN):
            return chosen
        return Plan(runner_up)

    def count_round(self, plan: Plan, cold: bool) -> None:
        """A round ran: an AR round measured AR's step (as a calibration does); a speculating round that
        was timed (not `cold`) counts towards decide_after."""
        if plan is Plan.AR:
            self._calibrations, self._rounds_since_calibration = self._calibrations + 1, 0
        else:
            self._measured_rounds += not cold

    def calibrate(self, runner: ModelRunner, running: list[Sequence], cold: bool,
                  cores: Optional[TargetCores] = None) -> float:
        """Time one plain AR decode forward of this batch (then undo it), so the rule compares against
        AR's real step time rather than a prior. On a CPU a verify of K+1 tokens costs more than one
        decode step (docs/THEORY.md §3), and without this the rule (and ssd/predicted_speedup) would assume
        they cost the same. Done on each of the first `decide_after` timed speculating rounds (the
        estimate is the median of the last few, so one slow step among them cannot set the first
        decision), FIRST_CALIBRATION_GAP rounds later, then every CALIBRATE_EVERY (AR rounds are measured
        as they run); never in a round of first rounds (`cold`, one-off costs). The round calls it between
        the draft side's answer and the chains it is sent: the draft side is idle then, as it is while
        AR runs, so the step is not slowed by a cache build competing for memory bandwidth. With `cores`
        (a worker process holds a core of its own) the step is timed as AR rounds run, on every core, and
        once more on the target's own core ("decode_narrow": their ratio scales plain speculation's
        verify and drafting until they are measured); the target's share is left as it was.
        Returns the seconds spent."""
        if cold:
            return 0.0
        warmup = self.config.decide_after
        gap = 0 if self._calibrations < warmup else FIRST_CALIBRATION_GAP if self._calibrations == warmup \
            else CALIBRATE_EVERY
        if self._calibrations and self._rounds_since_calibration < gap:
            self._rounds_since_calibration += 1
            return 0.0
        seconds, was_wide = 0.0, cores is None or cores.is_wide
        if cores is not None:
            cores.narrow()
            seconds += self._time_step(runner, running, "decode_narrow")
            cores.widen()
        seconds += self._time_step(runner, running, "decode")
        if not was_wide:
            cores.narrow()
        self._calibrations, self._rounds_since_calibration = self._calibrations + 1, 0
        return seconds

    def _time_step(self, runner: ModelRunner, running: list[Sequence], name: str) -> float:
        """One AR decode forward of the batch, timed as `name` (device time on a GPU), then undone."""
        timer = DeviceTimer(runner.device).start()
        runner.extend([s.slot for s in running], [[s.last_token] for s in running], last_only=True)
        seconds = timer.stop()
        self.estimates.observe_time(name, seconds, len(running))
        for seq in running:
            runner.rollback(seq.slot, seq.num_tokens - 1)
        return seconds
