"""Live estimates for the strategy rule: per-round counters in, `StrategyInputs` (ssd/rule.py) out.

Every estimate is an exponentially weighted count, so old rounds fade as the policy moves (in RL it
moves every step, and hit rate and acceptance drift with it); priors enter as pseudo-counts.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from rollout_ssd.config import SPECULATORS
from rollout_ssd.ssd.rule import StrategyInputs, tokens_from_acceptance


@dataclass(frozen=True)
class EstimatesConfig:
    """k: speculated tokens per round. halflife_rounds: EMA half-life, in rounds, of every estimate.
    prior_accept: per-speculator acceptance a before data; tokens priors are E(prior a, k).
    prior_p_hit: hit rate before data. prior_weight: the priors' weight, in sequence-rounds
    (resp. judged tokens). prior_time_units: times before measurement, in verify units.
    """

    k: int
    halflife_rounds: float = 50.0
    prior_p_hit: float = 0.6
    prior_accept: Mapping[str, float] = field(
        default_factory=lambda: {"draft": 0.6, "suffix": 0.3, "random": 0.0})
    prior_weight: float = 4.0
    prior_time_units: Mapping[str, float] = field(
        default_factory=lambda: {"primary": 0.9, "overhead": 0.0, "decode": 1.0, "draft": 0.5, "suffix": 0.01,
                                 "random": 0.0})

    def __post_init__(self):
        if not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"EstimatesConfig.k must be an integer >= 1, got {self.k!r}")
        if not self.halflife_rounds > 0:
            raise ValueError(f"EstimatesConfig.halflife_rounds must be > 0, got {self.halflife_rounds!r}")
        if not 0.0 <= self.prior_p_hit <= 1.0:
            raise ValueError(f"EstimatesConfig.prior_p_hit must be in [0, 1], got {self.prior_p_hit!r}")
        if set(self.prior_accept) != set(SPECULATORS) or not all(0 <= v <= 1 for v in self.prior_accept.values()):
            raise ValueError(f"EstimatesConfig.prior_accept needs {SPECULATORS} in [0, 1], got {self.prior_accept!r}")
        if not self.prior_weight > 0:
            raise ValueError(f"EstimatesConfig.prior_weight must be > 0, got {self.prior_weight!r}")
        needed = {"primary", "overhead", "decode"} | set(SPECULATORS)
        if set(self.prior_time_units) != needed or not all(v >= 0 for v in self.prior_time_units.values()):
            raise ValueError(f"EstimatesConfig.prior_time_units needs keys {sorted(needed)} >= 0")
        object.__setattr__(self, "prior_accept", dict(self.prior_accept))
        object.__setattr__(self, "prior_time_units", dict(self.prior_time_units))


class _Ratio:
    """Exponentially weighted num / den, starting from a prior worth `weight` denominator units."""

    def __init__(self, prior: float, weight: float, decay: float):
        self.num, self.den, self.decay = prior * weight, weight, decay

    def add(self, num: float, den: float) -> None:
        self.num = self.decay * self.num + num
        self.den = self.decay * self.den + den

    @property
    def value(self) -> float:
        return self.num / self.den


class _Mean(_Ratio):
    """Exponentially weighted mean of the values seen: a `_Ratio` with no prior and one denominator
    unit per value (normalised: the first value is not held at full weight, so one slow warm-up round
    fades as soon as steady ones arrive). None before the first value."""

    def __init__(self, decay: float):
        super().__init__(0.0, 0.0, decay)

    def add(self, x: float) -> None:
        super().add(x, 1.0)

    @property
    def value(self) -> float | None:
        return self.num / self.den if self.den else None


class _RecentMedian:
    """Median of the last `size` values: for AR's decode time, measured by rare one-step calibrations
    (and by AR rounds), where one outlier (a first, cold forward) must not set the estimate, and for the
    times it is weighed against (`LiveEstimates.MEDIANS`)."""

    def __init__(self, size: int):
        self.values: list[float] = []
        self.size = size

    def add(self, x: float) -> None:
        self.values = (self.values + [x])[-self.size:]

    @property
    def value(self) -> float | None:
        if not self.values:
            return None
        ordered = sorted(self.values)
        n = len(ordered)
        return ordered[n // 2] if n % 2 else 0.5 * (ordered[n // 2 - 1] + ordered[n // 2])


class _BatchTimes:
    """A time per round as a function of the batch size b: one estimator (`make()`) per b seen, and for
    a b not seen, a line t = alpha + beta*b fitted to the others (least squares over their estimates,
    weighted by how often each was measured; alpha, beta >= 0: a forward costs a fixed weight read plus
    work per sequence). The slope is shrunk towards the prior shape t ∝ b + B0 through the data's mean
    (B0 = BATCH_PRIOR sequences cost what the weight read costs) with the weight of a spread of B0 in b:
    with one b seen, or sizes close together (16 and 15 at the end of a generation, whose slope is
    noise), t(b) = t(b0) * (b + B0) / (b0 + B0); sizes spread widely set the slope themselves. The
    batch shrinks at the end of a generation and grows as rollouts are admitted; a time measured at 16
    sequences says little about 3 otherwise. A size measured fewer than OWN_AFTER times is read off the
    line too (its points in it, weighted by their count): one slow step at a size the tail of a
    generation passes through (a host hiccup; bench/RESULTS.md, the seventh session's section) must
    not set that size's estimate, and with it the plan, alone."""

    BATCH_PRIOR = 4.0
    OWN_AFTER = 3  # measurements at a batch size before its own estimate stands alone (else: the line, it included)

    def __init__(self, make):
        self.make = make
        self.by_batch: dict[int, object] = {}
        self.counts: dict[int, int] = {}
        self.seeded: dict[int, int] = {}  # batch -> counts from `seed`

    def seed(self, batch: int, seconds: float, count: int) -> None:
        """A measurement kept from an earlier engine (ssd/rule_cache.py): one value standing for
        `count` (at most OWN_AFTER) measurements, which the next ones outweigh as they come."""
        self.by_batch[batch], self.counts[batch] = self.make(), min(count, self.OWN_AFTER)
        self.by_batch[batch].add(seconds)
        self.seeded[batch] = self.counts[batch]

    def measured(self, bucket: int, here: bool = False) -> int:
        """How often it was measured at the batch sizes of `bucket`; `here`: by this engine (an earlier one's
        kept values not counted)."""
        return sum(n - (self.seeded.get(b, 0) if here else 0) for b, n in self.counts.items() if b.bit_length() == bucket)

    def live(self, bucket: int) -> bool:
        """Whether this engine measured it at a batch size of `bucket` (not only an earlier one's kept value)."""
        return self.measured(bucket, here=True) > 0

    def add(self, batch: int, seconds: float) -> None:
        if batch not in self.by_batch:
            self.by_batch[batch], self.counts[batch] = self.make(), 0
        self.by_batch[batch].add(seconds)
        self.counts[batch] += 1

    def value(self, batch: int) -> float | None:
        if batch in self.by_batch and (self.counts[batch] >= self.OWN_AFTER or len(self.by_batch) == 1):
            return self.by_batch[batch].value
        if not self.by_batch:
            return None
        points = [(b, est.value, self.counts[b]) for b, est in self.by_batch.items()]
        w = sum(n for _, _, n in points)
        mb = sum(n * b for b, _, n in points) / w
        mt = sum(n * t for _, t, n in points) / w
        sxx = sum(n * (b - mb) ** 2 for b, _, n in points)
        sxy = sum(n * (b - mb) * (t - mt) for b, t, n in points)
        prior_slope, prior_weight = mt / (mb + self.BATCH_PRIOR), w * self.BATCH_PRIOR**2
        beta = max(0.0, (sxy + prior_weight * prior_slope) / (sxx + prior_weight))
        alpha = mt - beta * mb
        if alpha < 0:  # through the origin instead: t = beta * b
            alpha, beta = 0.0, sum(n * b * t for b, t, n in points) / sum(n * b * b for b, _, n in points)
        return alpha + beta * batch


class LiveEstimates:
    """Per-round counters in, `StrategyInputs` out.

    Every estimate is a ratio of exponentially weighted sums (each `observe_*` call first decays the
    sums it updates by 0.5^(1/halflife_rounds), so the half-life counts calls: one per round and path),
    so busy rounds weigh more than quiet ones and old rounds fade: in RL the policy moves every step
    and hit rate and acceptance drift with it. Priors enter as pseudo-counts that fade the same way.
    Paths: "hit" = chain from the speculation cache (drafted by the draft model); "draft",
    "suffix", "random" = chain from that speculator on demand.
    Times are per batch size (`_BatchTimes`): normalised exponentially weighted means of the
    measurements (a prior time is used until the first one); AR's decode time, measured rarely, is the
    median of its last DECODE_WINDOW values.
    """

    DECODE_WINDOW = 15

    PATHS = ("hit",) + SPECULATORS
    TIMES = ("verify", "primary", "overhead", "decode") + SPECULATORS
    # no priors: "plain_verify" (the verify of a round with no cache build beside it: SD's, suffix's) and
    # "plain_draft" (SD's drafting, on a CPU in the target's process) are the verify and draft-model
    # times scaled by decode / "decode_narrow" (an AR step on the target's own core, the worker holding
    # the other; ssd/cores.py) until measured; without a split the two decode times agree
    PLAIN = {"plain_verify": "verify", "plain_draft": "drafting"}
    # "drafting": the draft side's own time drafting K tokens on demand (without the target's wait for
    # a cache build to finish, nor the transfer): what SD's drafting costs where it runs in process
    # "verify_narrow": a forward of K+1 tokens per sequence on the target's own core (the SSD verify's
    # shape beside the worker, timed before any SSD round: ssd/chooser.py's cap on SSD)
    # "narrow_ref": SD's verify estimate when "verify_narrow" was timed, so that their ratio (the cap's v)
    # is one moment's: a host slower later (or in a later engine, from the rule's cache) slows SD's live
    # verify, and a cap from the old one-core time alone would then let SSD look worth trying
    UNPRIORED = (*PLAIN, "decode_narrow", "drafting", "verify_narrow", "narrow_ref")
    # medians (`_RecentMedian`): AR's step (rare calibrations, a cold first forward among them) and plain
    # speculation's times, so that the two plans a CPU's rule weighs against each other are read alike (a
    # host hiccup in one SD round raised SD's mean, never AR's median, and tipped near ties to AR,
    # bench/RESULTS.md, "The SSD engine's own measuring"); SSD's times stay means: their spread is the
    # plan's own (a cache build beside the verify)
    MEDIANS = ("decode", "decode_narrow", "verify_narrow", "plain_verify", "plain_draft", "narrow_ref")

    def __init__(self, config: EstimatesConfig):
        self.config = config
        d = 0.5 ** (1.0 / config.halflife_rounds)
        w = config.prior_weight
        self._hit = _Ratio(config.prior_p_hit, w, d)
        a = config.prior_accept
        self._accept = {s: _Ratio(a[s], w, d) for s in SPECULATORS}
        e = tokens_from_acceptance(a, config.k)
        self._tokens = {path: _Ratio(e[path], w, d) for path in self.PATHS}
        # MEDIANS are medians of their last few; every other time a mean
        self._times = {name: _BatchTimes((lambda: _RecentMedian(self.DECODE_WINDOW)) if name in self.MEDIANS
                                         else (lambda: _Mean(d)))
                       for name in self.TIMES + self.UNPRIORED}

    def observe_cache(self, hits: int, misses: int) -> None:
        """Sequences whose verdict was found in the speculation cache this round, and those that were not."""
        if hits < 0 or misses < 0:
            raise ValueError(f"hits and misses must be >= 0, got {hits}, {misses}")
        self._hit.add(hits, hits + misses)

    def observe_round(self, path: str, sequences: int, accepted: int, judged: int, emitted: int) -> None:
        """One round's verification results for the sequences whose chain came by `path`."""
        if path not in self.PATHS:
            raise ValueError(f"unknown path {path!r}; known: {self.PATHS}")
        if not (0 <= accepted <= judged and sequences >= 0 and emitted >= 0):
            raise ValueError(
                f"bad counts: sequences={sequences}, accepted={accepted}, judged={judged}, emitted={emitted}"
            )
        if sequences == 0:
            return
        kind = "draft" if path == "hit" else path
        self._accept[kind].add(accepted, judged)
        self._tokens[path].add(emitted, sequences)

    def observe_time(self, name: str, seconds: float, batch: int) -> None:
        """A measured time per round of a batch of `batch` sequences: "verify", "primary" (T_p),
        "overhead" (T_o), "decode" (one AR step), or a speculator name (the target's wait for K tokens
        drafted with it: T_SD for "draft", T_b for backups), "plain_verify" (the verify of a plain
        speculation round), "plain_draft" (SD's drafting), "decode_narrow" (an AR step on the target's own
        core beside the worker), "drafting" (the draft side's own time for an on-demand chain)."""
        if name not in self._times:
            raise ValueError(f"unknown time {name!r}; known: {self.TIMES + self.UNPRIORED}")
        if not seconds >= 0:
            raise ValueError(f"time must be >= 0, got {seconds!r}")
        if not isinstance(batch, int) or batch < 1:
            raise ValueError(f"batch must be an integer >= 1, got {batch!r}")
        self._times[name].add(batch, seconds)
        if name == "verify_narrow" and self.live("plain_verify", batch.bit_length()):  # (this moment's)
            self._times["narrow_ref"].add(batch, self.seconds("plain_verify", batch))

    @property
    def p_hit(self) -> float:
        return self._hit.value

    def accept_rate(self, speculator: str) -> float:
        return self._accept[speculator].value

    def tokens_per_round(self, path: str) -> float:
        return self._tokens[path].value

    def seconds(self, name: str, batch: int) -> float:
        """A time estimate at `batch` sequences; before any measurement of it: its prior in verify units
        times the verify time ("plain_verify": the verify time, scaled as UNPRIORED says)."""
        if name in self.PLAIN:
            return self._plain_seconds(name, batch)
        t = self._times[name].value(batch)
        if t is not None:
            return t
        verify = self._times["verify"].value(batch)
        if verify is None:  # no SSD round timed yet: the verify of a plain round, else an AR step, stands in
            verify = self._times["plain_verify"].value(batch) or self._times["decode"].value(batch)
        if verify is None:
            raise ValueError(f"no measurement of {name!r} nor of a verify or decode time yet")
        return verify if name == "verify" else self.config.prior_time_units[name] * verify

    def times_measured(self, name: str, bucket: int, here: bool = False) -> int:
        """How often time `name` was measured at the batch sizes of this batch bucket (`int.bit_length`
        of the size: 1, 2-3, 4-7, ...; ssd/chooser.py's buckets); 0: it is a prior or derived there.
        `here`: by this engine, not counting what an earlier one's kept values stand for (`restore`)."""
        return self._times[name].measured(bucket, here)

    def measured(self, name: str, bucket: int) -> bool:
        return self.times_measured(name, bucket) > 0

    def live(self, name: str, bucket: int) -> bool:
        """Measured at this bucket by this engine, not only kept from an earlier one (`restore`)."""
        return self._times[name].live(bucket)

    def scaled_down(self, name: str, batch: int, bucket: int) -> float:
        """A lower bound on time `name` at `batch` sequences from its measurements at the batch sizes of a
        larger `bucket` (which must hold one): min over them of t(b) * batch / b. A round's time grows at
        most in proportion to the batch (t = alpha + beta * b with alpha, beta >= 0, `_BatchTimes`)."""
        times = self._times[name]
        return min(times.by_batch[b].value * batch / b for b in times.by_batch if b.bit_length() == bucket)

    def snapshot(self) -> dict:
        """What was measured, as plain JSON data (ssd/rule_cache.py keeps it per machine): each time per
        batch size with its count, and the hit rate, acceptance and tokens per round (the priors of the
        next engine)."""
        return {"times": {name: {str(b): [t.by_batch[b].value, t.counts[b]] for b in t.by_batch}
                          for name, t in self._times.items() if t.by_batch},
                "p_hit": self.p_hit, "accept": {s: self.accept_rate(s) for s in SPECULATORS},
                "tokens": {path: self.tokens_per_round(path) for path in self.PATHS}}

    def restore(self, state: Mapping) -> int:
        """Start from an earlier engine's `snapshot` (same machine, models and settings: the caller's
        key): its times as measurements (`_BatchTimes.seed`), its rates as the priors (prior_weight).
        Returns the times restored. A ValueError (nothing changed) when `state` is not a snapshot."""
        if not isinstance(state, Mapping):
            raise ValueError(f"not an estimates snapshot: {type(state).__name__}")
        times = state.get("times")
        seeds = []
        if not isinstance(times, Mapping) or set(times) - set(self._times):
            raise ValueError(f"not an estimates snapshot: times {times!r:.80}")
        for name, by_batch in times.items():
            for b, entry in dict(by_batch).items():
                seconds, count = entry
                if not (int(b) >= 1 and math.isfinite(seconds) and seconds >= 0 and int(count) >= 1):
                    raise ValueError(f"not an estimates snapshot: {name} at {b}: {entry!r}")
                seeds.append((name, int(b), float(seconds), int(count)))
        rates = [(self._accept, state["accept"], SPECULATORS), (self._tokens, state["tokens"], self.PATHS)]
        p_hit = float(state["p_hit"])
        values = [float(v[k]) for _, v, keys in rates for k in keys]
        accept_ok = all(0 <= float(state["accept"][s]) <= 1 for s in SPECULATORS)
        if not 0 <= p_hit <= 1 or not accept_ok or not all(math.isfinite(v) and v >= 0 for v in values):
            raise ValueError("not an estimates snapshot: rates out of range")
        d, w = 0.5 ** (1.0 / self.config.halflife_rounds), self.config.prior_weight
        self._hit = _Ratio(p_hit, w, d)
        for table, values, keys in rates:
            for key in keys:
                table[key] = _Ratio(float(values[key]), w, d)
        for name, b, seconds, count in seeds:
            self._times[name].seed(b, seconds, count)
        return len(seeds)

    def _plain_seconds(self, name: str, batch: int) -> float:
        t = self._times[name].value(batch)
        if t is not None:
            return t
        source = self.PLAIN[name]
        if source == "drafting" and self._times["drafting"].value(batch) is None:
            source = "draft"  # not yet measured: the target's wait for drafted chains, an upper bound
        base = self._times[source].value(batch) if source == "drafting" else self.seconds(source, batch)
        wide, narrow = self._times["decode"].value(batch), self._times["decode_narrow"].value(batch)
        return base * min(1.0, wide / narrow) if wide is not None and narrow else base

    def inputs(self, batch_size: int) -> StrategyInputs:
        k = self.config.k
        return StrategyInputs(
            p_hit=self.p_hit,
            tokens={path: min(max(self.tokens_per_round(path), 1.0), k + 1.0) for path in self.PATHS},
            draft_seconds={s: self.seconds(s, batch_size) for s in SPECULATORS},
            primary_seconds=self.seconds("primary", batch_size),
            overhead_seconds=self.seconds("overhead", batch_size),
            verify_seconds=self.seconds("verify", batch_size),
            plain_verify_seconds=self.seconds("plain_verify", batch_size),
            plain_draft_seconds=self.seconds("plain_draft", batch_size),
            decode_seconds=self.seconds("decode", batch_size),
            batch_size=batch_size,
            k=k,
        )
