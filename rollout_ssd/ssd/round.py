"""SSDDecode: speculative speculative decoding as a decode strategy (docs/THEORY.md §2).

Round n for a batch, target side (`SSDDecode.step`, one call each):
  1. tell the draft side each sequence's verdict of round n-1 (k, t*) and get the chain for round n:
     HIT (pre-drafted in the speculation cache), DRAFTED (the draft model on demand: the "neural"
     backup, and every sequence's first, cold round) or MISS (a fast backup speculator, suffix or
     random, covers it; beside a worker process on a CPU the neural backup too: SD's own speculator
     drafts the chain in this process, on every core, `_drafts_misses_here`);
  2. send the chains to the draft side, which builds the next cache from them (glue forward + branch
     tree, ssd/tree.py); in the worker process this runs WHILE the target does step 3;
  3. verify: one target forward over [last token, chain] per sequence and `verify` with the exact q
     each chain was drawn from (a MixedDraft: dense q for draft-model chains, point masses for fast ones);
  4. append, roll the target KV back (decode.finish_round); the verdict is remembered for step 1 of
     round n+1.
Every chain is an ordinary SD proposal verified against its own q, so the output law is the target's on
every path (hit, miss, fallback). Greedy: hits and misses give the same tokens as AR.

Pieces, each owning its state: the draft side (ssd/draft_side.py: worker client, failover, the sequence
mirror, draft weights), the chooser (ssd/chooser.py: the plan of each round, from the strategy rule) and
the telemetry (ssd/telemetry.py: estimates, planner, stats, trace). Rounds whose plan skips the draft side
leave it behind; it catches up from the committed tokens (SYNC) the next time it is used.
"""

from __future__ import annotations

import time
from typing import Optional

import torch

from rollout_ssd.decode import DecodeStrategy, RoundOutcome, ar_verdict, chain_lengths, finish_round, verify_round
from rollout_ssd.gpu.timing import DeviceTimer
from rollout_ssd.metrics import EngineMetrics
from rollout_ssd.models.decoder import Decoder
from rollout_ssd.runner import ModelRunner
from rollout_ssd.sequence import Sequence
from rollout_ssd.spec.draft_model import DraftModelSpeculator
from rollout_ssd.spec.speculator import Speculator
from rollout_ssd.spec.verify import DenseDraft, DraftDistribution, MixedDraft, SparseDraft, VerifyResult
from rollout_ssd.ssd.chooser import Chooser, Plan
from rollout_ssd.ssd.config import SSDConfig
from rollout_ssd.ssd.cores import TargetCores
from rollout_ssd.ssd.draft_side import Chains, DraftSide
from rollout_ssd.ssd.estimates import EstimatesConfig, LiveEstimates
from rollout_ssd.ssd.fanout import FanoutConfig, FanoutPlan, FanoutPlanner
from rollout_ssd.ssd.plans import call_tail
from rollout_ssd.ssd.rule_cache import RuleCache, cache_directory, engine_key
from rollout_ssd.ssd.telemetry import RoundTelemetry, RoundTimes


class SSDDecode(DecodeStrategy):
    def __init__(self, runner: ModelRunner, draft_model: Decoder, config: SSDConfig, stats: EngineMetrics,
                 backup: Optional[Speculator] = None, max_model_len: Optional[int] = None):
        if draft_model.cfg.vocab_size != runner.model.cfg.vocab_size:
            raise ValueError(f"draft vocab_size {draft_model.cfg.vocab_size} differs from the target's "
                             f"{runner.model.cfg.vocab_size}")
        if config.backup != "neural" and backup is None:
            raise ValueError(f"SSDConfig.backup={config.backup!r} needs its speculator (backup=...)")
        self.runner = runner
        self.config = config
        self.k = config.k
        self.stats = stats
        self.backup = backup
        initial = config.budget or min(config.max_budget, 2 * (config.k + 1))
        self.planner = FanoutPlanner(FanoutConfig(k=config.k, manual=config.fanout, budget=config.budget,
                                                  max_budget=config.max_budget, initial_budget=initial))
        estimates = LiveEstimates(EstimatesConfig(k=config.k))
        fast = config.backup if backup is not None and config.backup in ("suffix", "random") else None
        self.chooser = Chooser(config, estimates, stats, backup=fast)
        directory = cache_directory(config.rule_cache)  # what an earlier engine here measured (ssd/rule_cache.py)
        self.rule_cache = None if directory is None else RuleCache(directory, engine_key(runner, draft_model, config))
        self.restored_times = 0 if self.rule_cache is None else self.rule_cache.load(self.chooser)
        self.telemetry = RoundTelemetry(estimates, self.planner, stats, None if backup is None else backup.name)
        self.draft = DraftSide(draft_model, runner.model.hf_parameters(), config, stats,
                               runner.cache.num_slots, max_model_len or runner.max_len)
        # SD rounds (and, Saguaro off, SSD's misses) while a worker process holds a CPU core: the SD
        # engine's own speculator, in this process on every core (the worker would draft on its one
        # core). Taken up at the first round that drafts with it (on every core; it prefills the live
        # sequences then, and each new one at admission after that): a call the rule runs AR on
        # throughout never pays its prefill. Made here beside a worker, where it will be used, so that
        # its KV cache's allocation is not a first call's cost
        self.sd: Optional[DraftModelSpeculator] = None
        self._sd_spare = self._new_speculator() if self.draft.cores is not None else None

    # ------------------------------------------------------------------ one round
    def step(self, running: list[Sequence]) -> int:
        """One round: its plan, docs/THEORY.md §2's four steps (module docstring), then its counts."""
        t0 = time.perf_counter()
        self.chooser.shares_cores = self.draft.cores is not None  # (none after a worker failure)
        plan = self.chooser.choose(len(running), fallback=self.draft.fallback, tail=call_tail(running),
                                   cold=all(self.draft.is_first_round(s) for s in running))
        fanout = self.planner.plan(cap=self.chooser.budget_cap(len(running), plan))
        ks = chain_lengths(running, self.k)
        sd, cores = self._share(plan)  # SD in this process; the target's CPU share beside a worker
        # this SD round's verify on the target's own core (a round of first rounds times nothing)
        narrow = sd and not all(self._sd_first(running)) and self.chooser.narrow_verify(len(running), cores)
        # 1. the last verdicts out, this round's chains in (the cache, the draft on demand, a fast backup)
        rnd = self._propose_sd(running, ks, narrow) if sd else self._propose(running, ks, plan, fanout, cores)
        calibration = self.chooser.calibrate(self.runner, running, rnd.cold, cores, plan)
        # 2. the chains to the draft side, which builds the next cache from them (a worker: during step 3)
        told = rnd.reply is not None and self.draft.build(running, rnd.chains, ks, plan.is_ssd, fanout.fanout)
        t2 = time.perf_counter()
        # 3. each chain verified against its own q (an AR round: the AR engine's step); device time on a GPU
        if narrow:
            cores.narrow()
        timer = DeviceTimer(self.runner.device).start()
        result = self._verify(running, rnd, plan)
        verify_seconds = timer.stop()
        if narrow:
            cores.widen()
        t3 = time.perf_counter()
        # 4. append, roll back; the verdicts go out in the next round's step 1
        outcome = finish_round(self.runner, running, result)
        self.draft.remember(running, rnd.chains, told, outcome)  # untold, it catches up (SYNC) when next asked
        if self.sd is not None:  # it drafted this round (SD, or an SSD round's misses) or keeps its KV as is
            self.sd.on_verified(running, outcome.accepted)
        if self.backup is not None:
            self.backup.on_verified(running, outcome.accepted)
        t4 = time.perf_counter()
        self._count(plan, fanout, rnd, ks, outcome, draft_seconds=(t2 - t0 - calibration) + (t4 - t3),
                    verify_seconds=verify_seconds, narrow=narrow)
        self.telemetry.record(plan, fanout, rnd, outcome.emitted,
                              RoundTimes(time.perf_counter() - t0, verify_seconds, calibration))
        return outcome.emitted

    def _share(self, plan: Plan) -> tuple[bool, Optional[TargetCores]]:
        """Whether this round is SD drafted in this process (a worker process holds a CPU core: SD
        rounds run the SD engine's speculator here instead of asking the worker), and the target's CPU
        share beside the worker (None elsewhere), set for the round: its own core while the worker
        builds beside it (SSD), every core when the worker is idle (AR, SD)."""
        cores = self.draft.cores
        if cores is None:
            return False, None
        if plan.is_ssd:
            cores.narrow()
            return False, cores
        cores.widen()
        return plan is Plan.SD, cores

    def _drafts_misses_here(self, plan: Plan) -> bool:
        """Whether this SSD round's misses are drafted in this process by the SD speculator, on every
        core, rather than by the worker on its one core while the target waits idle: beside a worker
        process (a CPU) with Saguaro off (the worker's on-demand chains bend towards the next cache,
        the speculator's do not). The worker still builds the next cache from the chains it is sent."""
        return plan is Plan.SSD_DRAFT and self.draft.cores is not None and self.config.saguaro_c == 1.0

    def _speculator(self) -> DraftModelSpeculator:
        """The SD engine's speculator in this process, taken up (made, where it was not made with the
        engine) when first needed, then told of every sequence."""
        if self.sd is None:
            self.sd = self._sd_spare if self._sd_spare is not None else self._new_speculator()
            self._sd_spare = None
            live = list(self.draft.live.values())
            if live:
                self.sd.on_admit(live)
        return self.sd

    def _speculators(self) -> list[DraftModelSpeculator]:
        """The in-process speculator in use and the one made ahead of its first round, where they exist."""
        return [sd for sd in (self.sd, self._sd_spare) if sd is not None]

    def _new_speculator(self) -> DraftModelSpeculator:
        return DraftModelSpeculator(self.draft.draft_model, self.draft.num_slots, self.draft.max_model_len,
                                    stop_prob=self.config.stop_prob)

    def _sd_first(self, running: list[Sequence]) -> list[bool]:
        """Per sequence, whether this is its first SD round here (every one before the speculator's takeup)."""
        return [self.sd is None or self.draft.is_first_round(s) for s in running]

    def _propose_sd(self, running: list[Sequence], ks: list[int], whole: bool = False) -> Chains:
        """An SD round's chains from the in-process speculator, verified against its batch law (`whole`:
        each ks[i] long, no early stop). The round that takes the speculator up holds its prefill of the
        live sequences: a one-off, timed as a first round."""
        rnd = Chains.empty(self._sd_first(running))
        sd = self._speculator()
        t0 = time.perf_counter()
        prop = sd.propose(running, ks, early_stop=not whole)
        rnd.wait_seconds, rnd.lagged = time.perf_counter() - t0, sd.lagged
        rnd.chains, rnd.whole_q = [list(t) for t in prop.tokens], prop.q
        rnd.paths = ["draft" if c else "none" for c in rnd.chains]
        return rnd

    def _propose(self, running: list[Sequence], ks: list[int], plan: Plan, fanout: FanoutPlan,
                 cores: Optional[TargetCores] = None) -> Chains:
        """Chains from the draft side where the plan asks it (its misses drafted here when
        `_drafts_misses_here`), then the fast backup where it gave none."""
        if plan.asks_draft_side:
            self.draft.flush()  # admissions held back (DraftSide.admit): each sequence's first round there
        first = [self.draft.is_first_round(s) for s in running]
        rnd = Chains.empty(first)
        need_backup = list(range(len(running))) if plan is Plan.SUFFIX else []
        here = self._drafts_misses_here(plan)
        if plan.asks_draft_side and self.draft.client is not None:
            if self.draft.request_chains(running, ks, plan.drafts_on_miss and not here, fanout.fanout, rnd):
                need_backup = self.draft.missed(rnd, ks)
                if here and need_backup:
                    self._draft_here(running, ks, need_backup, rnd, cores)
                    need_backup = []
            else:  # the draft side failed: nothing it sent is used, every row verifies an empty chain
                rnd, need_backup = Chains.empty(first), []
        if need_backup and self.backup is not None and plan.uses_backup:
            rnd.backup_seconds = _fill(rnd, need_backup, running, ks, self.backup, self.backup.name)
        return rnd

    def _draft_here(self, running: list[Sequence], ks: list[int], rows: list[int], rnd: Chains,
                    cores: Optional[TargetCores]) -> None:
        """The missed rows' chains from the SD speculator in this process, on every core (the worker
        waits for them to build the next cache), each verified against its own q."""
        if cores is not None:
            cores.widen()
        if self.sd is None:  # taken up here, with the live sequences' prefill: a one-off, timed as a first round
            rnd.first = [True] * len(running)
        sd = self._speculator()
        rnd.drafted_here = (len(rows), _fill(rnd, rows, running, ks, sd, "draft"), sd.lagged)  # (lagged on hits: SSD's cost)
        if cores is not None:
            cores.narrow()
        rnd.wait_seconds += rnd.drafted_here[1]

    def _verify(self, running: list[Sequence], rnd: Chains, plan: Plan) -> VerifyResult:
        """An AR round is the AR engine's decode step; otherwise each chain against its own q."""
        if plan is Plan.AR:
            return ar_verdict(self.runner, running)
        return self.verify_round(running, rnd.chains, rnd.whole_q if rnd.whole_q is not None else MixedDraft(rnd.q))

    def verify_round(self, seqs: list[Sequence], chains: list[list[int]], q: DraftDistribution) -> VerifyResult:
        return verify_round(self.runner, seqs, chains, q)

    def _count(self, plan: Plan, fanout: FanoutPlan, rnd: Chains, ks: list[int], outcome: RoundOutcome,
               draft_seconds: float, verify_seconds: float, narrow: bool = False) -> None:
        self.stats.add_spec_round(
            proposed=[len(c) for c in rnd.chains], accepted=outcome.accepted, rejected=outcome.rejected,
            emitted=outcome.emitted, draft_seconds=draft_seconds, verify_seconds=verify_seconds,
        )
        self.chooser.count_round(plan, rnd.cold, len(ks), narrow)
        self.telemetry.observe(plan, fanout, rnd, ks, outcome, verify_seconds, narrow)

    # ------------------------------------------------------------------ lifecycle
    def before_prefill(self, seqs: list[Sequence]) -> None:
        """Admit to the draft side before the target prefills, so the draft's prefill overlaps the
        target's (an engine hook; without it `on_admit` does the same after the target's prefill).
        Beside a worker process on a CPU the target prefills first, on every core, and the worker after
        it (`on_admit`): overlapped, the target's prefill, far the larger, would get one core."""
        if self.draft.cores is not None:
            self.draft.cores.widen()
            return
        self.on_admit(seqs)

    def on_admit(self, seqs: list[Sequence]) -> None:
        new = [s for s in seqs if not self.draft.admitted(s)]
        if new and self.sd is not None:  # first: the worker's prefill (next) would share its core with this one
            self.sd.on_admit(new)
        self.draft.admit(new)
        if new and self.backup is not None:
            self.backup.on_admit(new)

    def on_release(self, seq: Sequence) -> None:
        self.draft.release(seq)
        if self.sd is not None:
            self.sd.on_release(seq)
        if self.backup is not None:
            self.backup.on_release(seq)

    def close(self) -> None:
        self._keep_measurements()
        self.draft.close()
        for sd in self._speculators():
            sd.close()
        if self.backup is not None:
            self.backup.close()

    # ------------------------------------------------------------------ draft weights (between rounds)
    def draft_parameters(self) -> dict[str, torch.Tensor]:
        """The target side's copy of the draft, by HF name (what updates are validated against)."""
        return self.draft.draft_model.hf_parameters()

    def apply_draft_update(self, update, params: dict[str, torch.Tensor], names: tuple[str, ...]) -> None:
        self.draft.apply_draft_update(update, params, names)
        for sd in self._speculators():  # it drafts with the same (now written) copy: drop what it built
            sd.weights_changed()

    def on_idle(self) -> None:
        if self.draft.cores is not None:  # rounds narrowed this thread beside the worker: wide between calls
            self.draft.cores.widen()
        self._keep_measurements()

    def _keep_measurements(self) -> None:
        if self.rule_cache is not None:
            self.rule_cache.save(self.chooser)

    def on_weights_changed(self) -> None:
        self.draft.on_weights_changed()
        if self.draft.shares_target_tensors:  # a shared tensor may have changed
            for sd in self._speculators():
                sd.weights_changed()

    def draft_digest(self) -> int:
        """weights_digest of the weights the draft side holds now (asked of the worker itself)."""
        return self.draft.digest()

    # ------------------------------------------------------------------ what tests and benches read
    @property
    def client(self):
        return self.draft.client

    @property
    def draft_model(self) -> Decoder:
        return self.draft.draft_model

    @property
    def trace(self) -> Optional[list[dict]]:
        """Set to a list to get a record of each round (bench/probes/trace_rule.py)."""
        return self.telemetry.trace

    @trace.setter
    def trace(self, value: Optional[list[dict]]) -> None:
        self.telemetry.trace = value


def _fill(rnd: Chains, rows: list[int], running: list[Sequence], ks: list[int], speculator: Speculator,
          path: str) -> float:
    """Rows `rows` of the round's chains from `speculator` (each with its own row of the law, labelled
    `path`, "none" where it proposed nothing); returns the seconds it took to propose."""
    t0 = time.perf_counter()
    prop = speculator.propose([running[i] for i in rows], [ks[i] for i in rows])
    seconds = time.perf_counter() - t0
    for j, i in enumerate(rows):
        rnd.chains[i] = list(prop.tokens[j])[: ks[i]]
        rnd.q[i] = _row_of(prop.q, j)
        rnd.paths[i] = path if rnd.chains[i] else "none"
    return seconds


def _row_of(dist: DraftDistribution, i: int) -> DraftDistribution:
    """Row i of a batch draft law, as a single-row (or any-row) law for MixedDraft."""
    if dist.num_rows is None:
        return dist
    if isinstance(dist, DenseDraft):
        return DenseDraft(dist.probs[i: i + 1])
    if isinstance(dist, SparseDraft):
        return SparseDraft(dist.indices[i: i + 1], dist.probs[i: i + 1])
    if isinstance(dist, MixedDraft):
        return dist.rows[i]
    raise TypeError(f"cannot take a row of {type(dist).__name__}")
