"""Counters behind `engine.metrics()`, with docs/DESIGN.md's names (spelled once, in metric_names.py).
Counters run since start or reset.

Acceptance (docs/DESIGN.md): `spec/accept_rate` = accepted / judged, where a round judges its accepted
draft tokens plus the rejected one, if any (it estimates THEORY's per-token a);
`spec/accepted_per_proposed` = accepted / all proposed; `spec/accept_length` = tokens emitted per
verification round (accepted + bonus, before truncation at a stop); `spec/accept_rate_pos_{i}` =
accepted / judged at draft position i (1-based).

Time: `rollout/tokens_per_s` = all tokens / wall time of sample() (prefill included);
`rollout/prefill_seconds` = the part of it spent admitting and prefilling; `rollout/decode_tokens_per_s`
= tokens after each rollout's first / the rest of the time: the decode speed that speculation changes
(and that `ssd/predicted_speedup` predicts, relative to AR's).

Per live batch (`end_round`, called by the scheduler after every round, whatever the method): a round's
seconds and tokens go to the bucket of its live batch (the sequences its decode step ran on; a round that
only prefilled counts the sequences it admitted), `batch_bucket_label`: 1, 2-3, 4-7, 8-15, ... (the
buckets ssd/plans.py keeps plan choices per), and the round to its plan (an SSD round's `Plan` label, else
"ar" or "sd"; "prefill" for a round that only prefilled). The driver's bookkeeping between rounds and after
the last one is added to the last round's bucket when `add_time` closes the call, so the buckets' seconds
sum to `rollout/seconds` and their tokens to `rollout/tokens`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from rollout_ssd import metric_names as names


def batch_bucket_label(live: int) -> str:
    """The live-batch bucket of `live` sequences: "1", "2-3", "4-7", "8-15", ... (ssd/plans.py's
    `batch_bucket`, bit_length, as a range)."""
    if live < 1:
        raise ValueError(f"a live batch has at least one sequence, got {live}")
    low = 1 << (live.bit_length() - 1)
    return "1" if low == 1 else f"{low}-{2 * low - 1}"


def _bucket_low(label: str) -> int:
    return int(label.split("-")[0])


@dataclass
class EngineMetrics:
    seconds: float = 0.0
    tokens: int = 0
    prefill_seconds: float = 0.0  # within `seconds`: prefill forwards (and their first tokens)
    prefill_tokens: int = 0
    rounds: int = 0  # sequence-rounds: one per running sequence per decode round
    round_tokens: int = 0
    spec_rounds: int = 0  # sequence-rounds that verified a proposal (possibly empty)
    proposed: int = 0
    accepted: int = 0
    judged: int = 0
    verify_lengths: int = 0  # accepted + bonus summed over spec rounds
    pos_accepted: list = field(default_factory=list)
    pos_judged: list = field(default_factory=list)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    syncs: int = 0
    sync_seconds: float = 0.0
    sync_bytes: int = 0
    # SSD (ssd/decode.py): sequence-rounds that asked for a chain under an SSD strategy, those served
    # from the speculation cache, and those whose sequence had a cache built (the others are cold).
    ssd_rounds: int = 0
    ssd_hits: int = 0
    ssd_warm: int = 0
    ssd_worker_failures: int = 0
    ssd_strategy_rounds: dict = field(default_factory=dict)  # strategy -> batch rounds
    ssd_state: dict = field(default_factory=dict)  # latest ssd/fanout, T_p, T_b, b_star, ...
    # per live batch (module docstring): bucket -> seconds, bucket -> tokens, (bucket, plan) -> rounds
    batch_seconds: dict = field(default_factory=dict)
    batch_tokens: dict = field(default_factory=dict)
    batch_plan_rounds: dict = field(default_factory=dict)
    _round_rows: int = 0  # the round in progress: its decode step's rows, prefilled rows and plan
    _round_admitted: int = 0
    _round_plan: Optional[str] = None
    _open_seconds: float = 0.0  # rounds' seconds since the last add_time
    _last_bucket: Optional[str] = None

    def add_time(self, seconds: float, tokens: int) -> None:
        """One call's busy time and tokens; the part of it no round took goes to the last round's bucket."""
        self.seconds += seconds
        self.tokens += tokens
        if self._last_bucket is not None:
            self.batch_seconds[self._last_bucket] += seconds - self._open_seconds
        self._open_seconds = 0.0

    def end_round(self, seconds: float, tokens: int) -> None:
        """One scheduler round ended: `seconds` (admission and prefill included) and the `tokens` it emitted
        go to its live batch's bucket, one round to the bucket's plan (module docstring)."""
        live = self._round_rows or self._round_admitted
        plan = self._round_plan or ("prefill" if not self._round_rows else "ar")
        self._round_rows, self._round_admitted, self._round_plan = 0, 0, None
        self._open_seconds += seconds
        if not live:  # nothing ran (every sequence cancelled): its time is the call's remainder
            return
        bucket = batch_bucket_label(live)
        self.batch_seconds[bucket] = self.batch_seconds.get(bucket, 0.0) + seconds
        self.batch_tokens[bucket] = self.batch_tokens.get(bucket, 0) + tokens
        self.batch_plan_rounds[bucket, plan] = self.batch_plan_rounds.get((bucket, plan), 0) + 1
        self._last_bucket = bucket

    def add_prefill(self, seconds: float, tokens: int) -> None:
        """Part of a later add_time: prefill time and the first tokens it sampled."""
        self.prefill_seconds += seconds
        self.prefill_tokens += tokens
        self._round_admitted += tokens  # one first token per admitted sequence

    def add_rounds(self, rows: int, tokens: int) -> None:
        self.rounds += rows
        self.round_tokens += tokens
        self._round_rows = rows

    def add_spec_round(self, proposed: list[int], accepted: list[int], rejected: list[bool], emitted: int,
                       draft_seconds: float, verify_seconds: float) -> None:
        self.add_rounds(len(proposed), emitted)
        self._round_plan = self._round_plan or "sd"  # an SSD round's own plan label, if it came first
        self.spec_rounds += len(proposed)
        self.draft_seconds += draft_seconds
        self.verify_seconds += verify_seconds
        for k, a, r in zip(proposed, accepted, rejected):
            judged = a + int(r)
            self.proposed += k
            self.accepted += a
            self.judged += judged
            self.verify_lengths += a + 1
            need = max(k, len(self.pos_judged))
            self.pos_judged += [0] * (need - len(self.pos_judged))
            self.pos_accepted += [0] * (need - len(self.pos_accepted))
            for i in range(judged):
                self.pos_judged[i] += 1
                self.pos_accepted[i] += int(i < a)

    def add_sync(self, seconds: float, nbytes: int) -> None:
        self.syncs += 1
        self.sync_seconds += seconds
        self.sync_bytes += nbytes

    def add_ssd_round(self, strategy: str, rounds: int, hits: int, warm: int) -> None:
        self.ssd_strategy_rounds[strategy] = self.ssd_strategy_rounds.get(strategy, 0) + 1
        self._round_plan = strategy
        self.ssd_rounds += rounds
        self.ssd_hits += hits
        self.ssd_warm += warm

    def set_ssd_state(self, **values) -> None:
        """Latest values of ssd/<name> (fanout, T_p, T_b, b_star, strategy, predicted_speedup, ...)."""
        self.ssd_state.update(values)

    def reset(self) -> None:
        self.__init__()

    def as_dict(self) -> dict:
        out = {
            names.ROLLOUT_TOKENS: self.tokens,
            names.ROLLOUT_SECONDS: self.seconds,
            names.ROLLOUT_TOKENS_PER_S: self.tokens / self.seconds if self.seconds else 0.0,
            names.ROLLOUT_TOKENS_PER_ROUND: self.round_tokens / self.rounds if self.rounds else 0.0,
            names.ROLLOUT_PREFILL_SECONDS: self.prefill_seconds,
        }
        decode_seconds = self.seconds - self.prefill_seconds
        out[names.ROLLOUT_DECODE_TOKENS_PER_S] = (
            (self.tokens - self.prefill_tokens) / decode_seconds if decode_seconds > 0 else 0.0)
        for bucket in sorted(self.batch_seconds, key=_bucket_low):
            out[names.rollout_seconds_by_batch(bucket)] = self.batch_seconds[bucket]
            out[names.rollout_tokens_by_batch(bucket)] = self.batch_tokens[bucket]
        for (bucket, plan), rounds in sorted(self.batch_plan_rounds.items(), key=lambda kv: _bucket_low(kv[0][0])):
            out[names.rollout_rounds_by_batch(bucket, plan)] = rounds
        if self.syncs:
            out.update({names.SYNC_BYTES: self.sync_bytes, names.SYNC_SECONDS: self.sync_seconds,
                        names.SYNC_COUNT: self.syncs})
        if self.ssd_rounds or self.ssd_strategy_rounds:
            out.update({
                names.SSD_HIT_RATE: self.ssd_hits / self.ssd_rounds if self.ssd_rounds else 0.0,
                names.SSD_HIT_RATE_WARM: self.ssd_hits / self.ssd_warm if self.ssd_warm else 0.0,
                names.SSD_ROUNDS: self.ssd_rounds,
                names.SSD_HITS: self.ssd_hits,
                names.SSD_COLD_ROUNDS: self.ssd_rounds - self.ssd_warm,
                names.SSD_WORKER_FAILURES: self.ssd_worker_failures,
                names.SSD_STRATEGY_ROUNDS: dict(self.ssd_strategy_rounds),
            })
            out.update({names.ssd_state(name): value for name, value in self.ssd_state.items()})
        if self.spec_rounds:
            total = self.draft_seconds + self.verify_seconds
            out.update({
                names.SPEC_ACCEPT_RATE: self.accepted / self.judged if self.judged else 0.0,
                names.SPEC_ACCEPTED_PER_PROPOSED: self.accepted / self.proposed if self.proposed else 0.0,
                names.SPEC_ACCEPT_LENGTH: self.verify_lengths / self.spec_rounds,
                names.SPEC_PROPOSED_PER_ROUND: self.proposed / self.spec_rounds,
                names.SPEC_DRAFT_SECONDS: self.draft_seconds,
                names.SPEC_VERIFY_SECONDS: self.verify_seconds,
                names.SPEC_DRAFT_TIME_SHARE: self.draft_seconds / total if total else 0.0,
            })
            for i, (a, j) in enumerate(zip(self.pos_accepted, self.pos_judged), start=1):
                out[names.spec_accept_rate_pos(i)] = a / j if j else 0.0
        return out
