"""The SSD cap: which SSD plans the chooser (ssd/chooser.py) leaves out at a batch size because they cannot
beat what was measured there (Corollary 9's cap in tokens per second, `_excluded`), and the one-core times
its v needs beside a worker process (`narrow_verify`, `_time_verify_shape`); and that cap over the best
measured plan as the `ssd/cap` metric (`cap_state`), which says whether SSD can pay on this machine at all.
A mixin of `Chooser`, whose state (rule, estimates, config, shares_cores, _v_waits) it reads.
"""

from __future__ import annotations

import math
from typing import Optional

from rollout_ssd.runner import ModelRunner
from rollout_ssd.sequence import Sequence
from rollout_ssd.ssd import rule as rules
from rollout_ssd.ssd.cores import TargetCores
from rollout_ssd.ssd.plans import Plan, batch_bucket
from rollout_ssd.ssd.rule import StrategyInputs, expected_tokens_per_round
from rollout_ssd.ssd.timed_forward import timed_forward

VERIFY_SHAPE_MAX_ROWS = 64  # beyond: the one-core step is an AR step (a verify's shape there costs a verify or more)
V_WAIT_ROUNDS = 3  # rounds exploring waits for v at a bucket (a round of first rounds times nothing)


class SSDCap:
    """`Chooser`'s cap on SSD plans (module docstring)."""

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
        (docs/THEORY.md, Corollary 9 on different hardware). Empty until AR or SD was timed here. Beside a
        worker, while the cap at v = 1 leaves SSD in but v is still to be timed here, SSD waits for it."""
        ssd, best = self._cap_question(bucket, scores)
        if ssd and (self._ssd_cap(bucket, inputs, v=None) <= best or self._v_pending(bucket, inputs.batch_size)):
            return set(ssd)
        return set()

    def _v_pending(self, bucket: int, batch: int) -> bool:
        """Beside a worker, the cap's v not yet timed here (neither of `_ssd_cap`'s sources) though the cap at
        v = 1 leaves SSD in: SSD waits for it (the next AR or SD round times it; `_explore` runs rounds of the
        better of the two for it, V_WAIT_ROUNDS at most; bench/RESULTS.md, "The layer kernel's arithmetic ...")."""
        return self.shares_cores and self._v_source(bucket) is None and self._v_waits.get(bucket, 0) < V_WAIT_ROUNDS \
            and self._needs_verify_shape(bucket, batch)

    def _v_source(self, bucket: int) -> Optional[str]:
        """The one-core time the cap's v comes from at this bucket: "verify_narrow" (the verify's own shape,
        beside SD's verify), else "decode_narrow" (AR steps, beside AR's), else None (v = 1)."""
        est = self.estimates
        for narrow, wide in (("verify_narrow", "plain_verify"), ("decode_narrow", "decode")):
            if est.measured(narrow, bucket) and est.measured(wide, bucket):
                return narrow
        return None

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
        verify = self._cap_verify(bucket, inputs)
        if v is None:
            v = self._v(bucket, inputs.batch_size, verify)
        return self._cap_at(inputs, verify, v)

    def _cap_at(self, inputs: StrategyInputs, verify: float, v: Optional[float]) -> float:
        """b * E(a, K) * v / verify: every verdict a hit, a full K-token chain (v None: 1)."""
        tokens = expected_tokens_per_round(self.estimates.accept_rate("draft"), inputs.k)
        return inputs.batch_size * tokens * (1.0 if v is None else v) / verify

    def _cap_verify(self, bucket: int, inputs: StrategyInputs) -> float:
        """The verify seconds `_ssd_cap` divides by: SD's, timed here; else its lower bound from the next
        larger bucket (`scaled_down`) or an AR step."""
        est = self.estimates
        verify = inputs.plain_verify_seconds if est.measured("plain_verify", bucket) else None
        verify = verify or inputs.decode_seconds  # (inputs made without SD's verify: the rule's own fallback)
        if not est.measured("plain_verify", bucket) and est.measured("plain_verify", bucket + 1):  # SD left unmeasured here
            verify = max(verify, est.scaled_down("plain_verify", inputs.batch_size, bucket + 1))  # (`_explore`)
        return verify

    def _v(self, bucket: int, batch: int, verify: float) -> Optional[float]:
        """The cap's v at this bucket from what was timed here (`_v_source`; `verify`: SD's verify, the
        reference where the one-core time's own was not kept), or None while neither source was timed."""
        est, source = self.estimates, self._v_source(bucket)
        if source == "verify_narrow":
            ref = est.seconds("narrow_ref", batch) if est.measured("narrow_ref", bucket) else verify  # (then)
            return min(1.0, ref / est.seconds("verify_narrow", batch))  # the verify's own shape on one core
        if source == "decode_narrow":
            return min(1.0, est.seconds("decode", batch) / est.seconds("decode_narrow", batch))
        return None

    def cap_state(self, bucket: int, inputs: StrategyInputs, scores: dict[str, float]) -> dict[str, float]:
        """`ssd/cap`, `ssd/v` and `ssd/cap_batch` (the batch size they are for) for the metrics: Corollary 9's
        bound on SSD's tokens per second at this bucket (`_ssd_cap`, as `_excluded` takes it) over the best AR
        or plain plan timed there, so SSD can beat them there only where it is above 1; and its v (1 where
        no worker shares the CPU's cores and none was timed, NaN while the one-core time it needs is untimed
        beside a worker: the cap is then taken at v = 1). Both NaN where no AR or plain plan was timed here
        (no stale value from another bucket)."""
        measured = self._measured_others(bucket, scores)
        if not measured or not any(Plan(c).is_ssd for c in self.rule.config.candidates):
            return {"cap": math.nan, "v": math.nan, "cap_batch": inputs.batch_size}
        verify = self._cap_verify(bucket, inputs)
        v = self._v(bucket, inputs.batch_size, verify)
        cap = self._cap_at(inputs, verify, v) / max(scores[c] for c in measured)
        if v is None:
            v = math.nan if self.shares_cores else 1.0
        return {"cap": cap, "v": v, "cap_batch": inputs.batch_size}

    def _needs_verify_shape(self, bucket: int, batch: int) -> bool:
        """Whether `_excluded`'s v is worth timing at this bucket: SSD plans are untimed here and plain
        speculation's verify was measured by this engine (the cap's denominator, and "narrow_ref"), yet
        the cap at v = 1 (v <= 1: what it excludes every v excludes) does not exclude them."""
        if not self.estimates.live("plain_verify", bucket):
            return False
        inputs = self.estimates.inputs(batch)
        ssd, best = self._cap_question(bucket, rules.strategy_scores(inputs, self.rule.config.candidates))
        return bool(ssd) and self._ssd_cap(bucket, inputs, v=1.0) > best

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
