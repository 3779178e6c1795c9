"""SSDDecode: speculative speculative decoding as a decode strategy (THEORY.md §2).

Round n for a batch, target side:
  1. tell the draft side each sequence's verdict of round n-1 (k, t*) and get the chain for round n:
     HIT (pre-drafted in the speculation cache), DRAFTED (the neural draft on demand: the neural backup,
     and every sequence's first, cold round) or MISS (a fast backup speculator, suffix or random, covers it);
  2. send the chains to the draft side, which builds the next cache from them (glue forward + branch
     tree, ssd/tree.py); in the worker process this runs WHILE the target does step 3;
  3. verify: one target forward over [last token, chain] per sequence and `verify` with the exact q
     each chain was drawn from (a MixedDraft: dense q for neural chains, point masses for fast ones);
  4. append, roll the target KV back; the verdict is remembered for step 1 of round n+1.
Every chain is an ordinary SD proposal verified against its own q, so the output law is the target's on
every path (hit, miss, fallback). Greedy: hits and misses give the same tokens as AR.

Strategy: per batch the rule (ssd/strategy.py) scores ssd+neural, ssd+<fast backup>, sd, suffix and ar from
live estimates and picks one (or always "ssd+<backup>" when the rule is off; the scores are still logged).
Rounds that skip the draft side leave it behind; it catches up from the committed tokens (SYNC) the
next time it is used.

Draft weights (`apply_draft_update`, between rounds): the target side keeps its own copy of the draft
(the in-process draft side, the fallback, and what a restarted worker loads); an update is validated and
written there first, then the draft side is brought in line (in process: nothing to copy; the worker: an
exact delta through shared memory, ssd/worker.py), and the draft side drops its cache and draft KV. A
draft that shares a tensor with the target (the embedding of a built-in draft) follows target updates:
`on_weights_changed` forwards a changed shared tensor to the worker the same way.

Faults: if the worker dies, times out or answers nonsense, we warn once, terminate it, and finish with
an in-process neural draft (SD) or AR. Chains already received stay valid; a sequence whose chain did
not arrive verifies an empty proposal (an AR step). Nothing is lost or duplicated: the target's
sequences are the only record of committed tokens, and a fresh draft side is re-admitted from them.
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

import torch

from rollout_ssd.decode import DecodeStrategy, ar_step
from rollout_ssd.metrics import EngineMetrics
from rollout_ssd.models.decoder import Decoder
from rollout_ssd.runner import ModelRunner
from rollout_ssd.sequence import Sequence
from rollout_ssd.spec.sd import SDDecode
from rollout_ssd.spec.speculator import Speculator
from rollout_ssd.spec.verify import (
    DenseDraft,
    DraftDistribution,
    MixedDraft,
    PointDraft,
    SparseDraft,
    VerifyResult,
)
from rollout_ssd.ssd.client import DraftClient, LocalDraftClient, WorkerFailure
from rollout_ssd.ssd.config import SSDConfig
from rollout_ssd.ssd.draft_server import DraftServer
from rollout_ssd.ssd.fanout import FanoutConfig, FanoutPlan, FanoutPlanner
from rollout_ssd.ssd.messages import (
    DRAFTED,
    HIT,
    MISS,
    SYNC,
    AdmitRow,
    AdmitSequences,
    BuildCache,
    BuildRow,
    ChainReply,
    ReleaseSequences,
    VerdictRow,
    Verdicts,
)
from rollout_ssd.ssd.rng import draft_key
from rollout_ssd.ssd.strategy import EstimatesConfig, LiveEstimates, StrategyConfig, StrategyRule
from rollout_ssd.ssd.tree import SaguaroRule
from rollout_ssd.weight_sync.codec import checksum

log = logging.getLogger(__name__)

USES_DRAFT = ("ssd+neural", "ssd+suffix", "ssd+random", "sd")


@dataclass
class _Track:
    """What the target side knows about a sequence's draft-side view."""

    seq_id: int
    known: int  # committed tokens the draft side has (counting the pending verdict when `told`)
    chain: list[int] = field(default_factory=list)
    told: bool = False  # the draft side knows `chain`, so a verdict (k, t*) is enough
    verdict: Optional[tuple[int, int]] = None


@dataclass
class _Round:
    """One round's proposals and where they came from."""

    chains: list[list[int]]
    dists: list[DraftDistribution]
    paths: list[str]  # "hit" | "neural" | "suffix" | "random" | "none"
    reply: Optional[ChainReply] = None
    warm: list[bool] = field(default_factory=list)  # a cache had been built for the sequence
    cached: list[int] = field(default_factory=list)  # candidates cached at the realised depth
    first: list[bool] = field(default_factory=list)  # the sequence's first round (no verdict before it)
    backup_seconds: float = 0.0
    wait_seconds: float = 0.0  # the target's wait for the draft side's chains, request to validated reply

    @property
    def cold(self) -> bool:
        """Every sequence is on its first round (a generation's cold start: one-off costs)."""
        return all(self.first)


def batch_bucket(batch: int) -> int:
    """Batch sizes that share a strategy choice: 1, 2-3, 4-7, 8-15, 16-31, ..."""
    return batch.bit_length()


CALIBRATE_EVERY = 128  # speculating rounds between AR decode-time calibrations, after the warm-up ones
FIRST_CALIBRATION_GAP = 16  # rounds after the warm-up calibrations (each costs one AR step of the batch)


class SSDDecode(DecodeStrategy):
    verify_round = SDDecode.verify_round  # SD's verification (uses self.runner only)

    def __init__(self, runner: ModelRunner, draft_model: Decoder, config: SSDConfig, stats: EngineMetrics,
                 backup: Optional[Speculator] = None, max_model_len: Optional[int] = None):
        if draft_model.cfg.vocab_size != runner.model.cfg.vocab_size:
            raise ValueError(f"draft vocab_size {draft_model.cfg.vocab_size} differs from the target's "
                             f"{runner.model.cfg.vocab_size}")
        if config.backup != "neural" and backup is None:
            raise ValueError(f"SSDConfig.backup={config.backup!r} needs its speculator (backup=...)")
        self.runner = runner
        self._calibrations, self._rounds_since_calibration = 0, 0
        self.draft_model = draft_model
        self.config = config
        self.k = config.k
        self.stats = stats
        self.backup = backup
        self.num_slots = runner.cache.num_slots
        self.max_model_len = max_model_len or runner.max_len
        initial = config.budget or min(config.max_budget, 2 * (config.k + 1))
        self.planner = FanoutPlanner(FanoutConfig(k=config.k, manual=config.fanout, budget=config.budget,
                                                  max_budget=config.max_budget, initial_budget=initial))
        self.estimates = LiveEstimates(EstimatesConfig(k=config.k))
        self.default_strategy = "ssd+neural" if backup is None else f"ssd+{config.backup}"
        candidates = ["ssd+neural", "sd", "ar"]
        if backup is not None and config.backup in ("suffix", "random"):
            candidates.insert(1, f"ssd+{config.backup}")
            if config.backup == "suffix":
                candidates.insert(3, "suffix")
        self.rule = StrategyRule(StrategyConfig(candidates=tuple(candidates),
                                                fixed=None if config.strategy_rule else self.default_strategy,
                                                hysteresis=config.hysteresis,
                                                switch_after=config.switch_after))
        self.strategy = self.default_strategy
        self._decided = False
        self._choices: dict[int, str] = {}  # batch_bucket -> the strategy last chosen at those batch sizes
        self.trace: Optional[list[dict]] = None  # set to a list to get a record of each round (bench/trace_rule.py)
        self._measured_rounds = 0  # speculating rounds timed so far (SSDConfig.decide_after)
        self.tracks: dict[int, _Track] = {}  # id(seq) -> track
        self.live: dict[int, Sequence] = {}
        self._next_id = 0
        self._failed = False
        self._warned = False
        self._restarts = 0
        self._prev_verify: Optional[float] = None
        self._prev_batch = 1
        self._prev_budget = 0
        self.client: Optional[DraftClient] = None
        self.draft_version = 0
        self._weights_lock = threading.Lock()  # draft weight traffic may come from a receiver thread
        target_storages = {t.untyped_storage().data_ptr() for t in runner.model.hf_parameters().values()}
        self._shared_names = [n for n, t in draft_model.hf_parameters().items()
                              if t.untyped_storage().data_ptr() in target_storages]
        self._shared_checksums: dict[str, str] = {}
        try:
            self.client = self._start_client(worker=config.worker)
        except WorkerFailure as err:  # a worker that cannot start is a failure like any other
            self._fail(err)

    # ------------------------------------------------------------------ draft side
    def _local_server(self) -> DraftServer:
        return DraftServer(self.draft_model, self.num_slots, self.max_model_len, self.k, self.config.max_branches,
                           SaguaroRule(C=self.config.saguaro_c, c_min=self.config.c_min), draft_version=self.draft_version)

    def _start_client(self, worker: bool) -> DraftClient:
        params = self.draft_model.hf_parameters()
        self._shared_checksums = {n: checksum(params[n]) for n in self._shared_names}  # what the draft side holds
        if worker:
            from rollout_ssd.ssd.worker import WorkerClient

            return WorkerClient.start(self.draft_model, self.num_slots, self.max_model_len, self.config,
                                      draft_version=self.draft_version)
        return LocalDraftClient(self._local_server())

    def _admit_rows(self, seqs: list[Sequence]) -> AdmitSequences:
        rows = []
        for seq in seqs:
            tr = self.tracks[id(seq)]
            context = seq.all_token_ids[:-1] if seq.token_ids else list(seq.prompt_token_ids)
            tr.known, tr.told, tr.verdict, tr.chain = len(context), False, None, []
            p = seq.params
            rows.append(AdmitRow(tr.seq_id, draft_key(p.seed, seq.prompt_index, seq.sample_index), float(p.temperature),
                                 int(p.top_k), float(p.top_p), tuple(context)))
        return AdmitSequences(tuple(rows))

    def _fail(self, err: BaseException) -> None:
        """The worker is gone: warn once, stop it, and continue with the fallback."""
        if not self._warned:
            self._warned = True
            msg = (f"SSD draft worker failed ({err}); finishing with "
                   f"{'an in-process neural draft (SD)' if self.config.fallback == 'sd' else 'AR'}")
            warnings.warn(msg, RuntimeWarning, stacklevel=3)
            log.warning(msg)
        self.stats.ssd_worker_failures += 1
        if self.client is not None:
            self.client.close()
        self.client = None
        self._failed = True
        if self.config.fallback == "sd":
            self.client = LocalDraftClient(self._local_server())
            if self.live:
                self.client.send(self._admit_rows(list(self.live.values())))

    def restart_worker(self) -> None:
        """Start a fresh draft worker (or in-process draft side) and re-admit every live sequence."""
        if self.client is not None:
            self.client.close()
            self.client = None
        try:
            self.client = self._start_client(worker=self.config.worker)
            if self.live:
                self.client.send(self._admit_rows(list(self.live.values())))
            self._failed = False
        except WorkerFailure as err:
            self._fail(err)

    def _send(self, msg) -> bool:
        if self.client is None:
            return False
        try:
            self.client.send(msg)
            return True
        except WorkerFailure as err:
            self._fail(err)
            return False

    # ------------------------------------------------------------------ lifecycle
    def before_prefill(self, seqs: list[Sequence]) -> None:
        """Admit to the draft side before the target prefills, so the worker's prefill overlaps the
        target's (an engine hook; without it `on_admit` does the same after the target's prefill)."""
        self.on_admit(seqs)

    def on_admit(self, seqs: list[Sequence]) -> None:
        seqs = [s for s in seqs if id(s) not in self.tracks]  # already admitted by before_prefill
        if not seqs:
            return
        if self._failed and self.config.worker and self._restarts < self.config.max_restarts:
            self._restarts += 1
            log.warning("SSD: restarting the draft worker (restart %d of %d)", self._restarts, self.config.max_restarts)
            self.restart_worker()
        for seq in seqs:
            self.tracks[id(seq)] = _Track(self._next_id, 0)
            self.live[id(seq)] = seq
            self._next_id += 1
        if self.client is not None:
            self._send(self._admit_rows(seqs))
        if self.backup is not None:
            self.backup.on_admit(seqs)

    def on_release(self, seq: Sequence) -> None:
        tr = self.tracks.pop(id(seq), None)
        self.live.pop(id(seq), None)
        if tr is not None:
            self._send(ReleaseSequences((tr.seq_id,)))
        if self.backup is not None:
            self.backup.on_release(seq)

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
        if self.backup is not None:
            self.backup.close()

    # ------------------------------------------------------------------ draft weights (between rounds)
    def draft_parameters(self) -> dict[str, torch.Tensor]:
        """The target side's copy of the draft, by HF name (what updates are validated against)."""
        return self.draft_model.hf_parameters()

    def apply_draft_update(self, update, params: dict[str, torch.Tensor], names: tuple[str, ...]) -> None:
        """Apply `update` (anything with `version` and `apply_to(params)`, which validates before it
        writes and raises ValueError) to the target side's copy, then bring the draft side in line."""
        with self._weights_lock:
            remote = self.client is not None and not self.client.in_process
            old = {n: params[n].detach().clone() for n in names if n in params} if remote else {}
            update.apply_to(params)
            self.draft_version = update.version
            self._push({n: params[n] for n in names}, old)

    def on_weights_changed(self) -> None:
        """The target's weights changed: a tensor the draft shares with it changed too, so the draft side
        gets it (the worker holds its own copy) and drops what the old value built."""
        if not self._shared_names or self.client is None:
            return
        with self._weights_lock:
            params = self.draft_model.hf_parameters()
            changed = {n: params[n] for n in self._shared_names if checksum(params[n]) != self._shared_checksums.get(n)}
            if changed:
                self._push(changed, {})

    def draft_digest(self) -> int:
        """weights_digest of the weights the draft side holds now (asked of the worker itself)."""
        with self._weights_lock:
            if self.client is None:
                from rollout_ssd.ssd.draft_server import weights_digest

                return weights_digest(self.draft_model.hf_parameters())
            return self.client.digest().digest

    def _push(self, new: dict[str, torch.Tensor], old: dict[str, torch.Tensor]) -> None:
        if self.client is None:
            return
        try:
            self.client.update_weights(new, old, self.draft_version)
        except WorkerFailure as err:  # the fallback starts from the target side's (updated) copy
            self._fail(err)
        for n in self._shared_names:
            if n in new:
                self._shared_checksums[n] = checksum(new[n])

    # ------------------------------------------------------------------ one round
    def _calibrate_decode(self, running: list[Sequence], cold: bool) -> float:
        """Time one plain AR decode forward of this batch (then undo it), so the strategy rule compares
        against AR's real step time rather than a prior. On a CPU a verify of K+1 tokens costs more than
        one decode step (THEORY.md §3), and without this the rule (and ssd/predicted_speedup) would
        assume they cost the same. Done on each of the first `decide_after` timed speculating rounds (the
        estimate is the median of the last few, so one slow step among them cannot set the first decision,
        which one calibration alone, 16 rounds before the next, did), FIRST_CALIBRATION_GAP rounds
        later, then every CALIBRATE_EVERY (AR rounds are measured as they run, `_observe`); never in a
        round of first rounds (`cold`, one-off costs). It runs between the draft side's answer and the
        chains it is sent: the draft side is idle then, as it is while AR runs, so the step is not slowed
        by a cache build competing for memory bandwidth. Returns the seconds spent."""
        if cold:
            return 0.0
        warmup = self.config.decide_after
        gap = 0 if self._calibrations < warmup else FIRST_CALIBRATION_GAP if self._calibrations == warmup \
            else CALIBRATE_EVERY
        if self._calibrations and self._rounds_since_calibration < gap:
            self._rounds_since_calibration += 1
            return 0.0
        slots = [s.slot for s in running]
        t0 = time.perf_counter()
        self.runner.extend(slots, [[s.last_token] for s in running], last_only=True)
        seconds = time.perf_counter() - t0
        self.estimates.observe_time("decode", seconds, len(running))
        for seq in running:
            self.runner.rollback(seq.slot, seq.num_tokens - 1)
        self._calibrations, self._rounds_since_calibration = self._calibrations + 1, 0
        return seconds

    def step(self, running: list[Sequence]) -> int:
        t0 = time.perf_counter()
        plan = self.planner.plan()
        strategy = self._choose(len(running))
        ks = [max(0, min(self.k, s.budget - 1)) for s in running]
        rnd = self._propose(running, ks, strategy, plan)
        calibration = self._calibrate_decode(running, rnd.cold) if strategy != "ar" else 0.0
        told = False
        if rnd.reply is not None and self.client is not None:  # the draft side that answered hears the chains
            build = strategy.startswith("ssd+")
            rows = tuple(BuildRow(self.tracks[id(s)].seq_id, tuple(c), build and k > 0)
                         for s, c, k in zip(running, rnd.chains, ks))
            told = self._send(BuildCache(rows, plan.fanout))
        t2 = time.perf_counter()
        if strategy == "ar":
            result = self._ar_round(running)
        else:
            result = self.verify_round(running, rnd.chains, MixedDraft(rnd.dists))
        t3 = time.perf_counter()

        emitted = 0
        accepted = result.num_accepted.tolist()
        bonus = result.tokens.gather(1, result.num_accepted[:, None]).squeeze(1).tolist()
        for i, seq in enumerate(running):
            n = int(result.num_emitted[i])
            emitted += seq.append(result.tokens[i, :n].tolist(), result.logprobs[i, :n].tolist())
            if not seq.finished:
                self.runner.rollback(seq.slot, seq.num_tokens - 1)
            tr = self.tracks[id(seq)]
            tr.chain, tr.told, tr.verdict = rnd.chains[i], told, (accepted[i], bonus[i])
        if self.backup is not None:
            self.backup.on_verified(running, accepted)
        t4 = time.perf_counter()
        self.stats.add_spec_round(
            proposed=[len(c) for c in rnd.chains], accepted=accepted, rejected=result.rejected.tolist(),
            emitted=emitted, draft_seconds=(t2 - t0 - calibration) + (t4 - t3), verify_seconds=t3 - t2,
        )
        self._observe(strategy, plan, rnd, ks, accepted, result.rejected.tolist(), t3 - t2)
        if self.trace is not None:
            state = self.stats.ssd_state
            self.trace.append({
                "batch": len(running), "strategy": strategy, "cold": rnd.cold, "emitted": emitted,
                "seconds": time.perf_counter() - t0, "verify_seconds": t3 - t2, "wait_seconds": rnd.wait_seconds,
                "calibration_seconds": calibration, "paths": dict(Counter(rnd.paths)), "fanout": list(plan.fanout),
                "scores": dict(state.get("scores", {})), "predicted_speedup": state.get("predicted_speedup"),
                "p_hit_estimate": state.get("p_hit_estimate")})
        return emitted

    def _ar_round(self, running: list[Sequence]) -> VerifyResult:
        """An AR round as the AR engine runs it (`ARDecode`: one decode forward, one token drawn from the
        target law per row), as a verdict with nothing proposed. Not `verify` with empty chains: that
        builds the target law for a K+1-token verify and judges nothing, and costs more per round."""
        tokens, logprobs = ar_step(self.runner, running)
        n = len(running)
        return VerifyResult(tokens=torch.tensor(tokens, dtype=torch.int64)[:, None],
                            num_emitted=torch.ones(n, dtype=torch.int64),
                            num_accepted=torch.zeros(n, dtype=torch.int64),
                            rejected=torch.zeros(n, dtype=torch.bool),
                            logprobs=torch.tensor(logprobs, dtype=torch.float32)[:, None])

    def _choose(self, batch: int) -> str:
        if self._failed:
            return "sd" if self.client is not None else "ar"
        # few timed rounds yet: noisy estimates. Over once a strategy was taken for a clear lead (it then
        # stands by the hysteresis like any choice; AR rounds add no speculating round to the count)
        early = not self._decided and self._measured_rounds < self.config.decide_after
        if early and not self._measured_rounds:
            return self.default_strategy
        try:
            inputs = self.estimates.inputs(batch)
        except ValueError:  # a time the rule needs was never measured
            return self.default_strategy
        # the hysteresis keeps what was chosen at this batch size (a sample() call's tail at a few
        # sequences says nothing about the next call's full batch); the first decision at a batch size
        # (the strategy so far was a default, not a choice) is taken at once
        bucket = batch_bucket(batch)
        decision = self.rule.decide(inputs, current=self._choices.get(bucket) if self._decided else None)
        chosen, scores = decision.chosen, decision.scores
        if early:  # leave the default only for a strategy clearly better than it, beyond the noise
            margin = 1 + self.config.decide_margin
            if self.rule.config.fixed is not None or scores[chosen] <= scores[self.default_strategy] * margin:
                chosen = self.default_strategy
        self._decided = not early or chosen != self.default_strategy  # early only while not yet decided
        if chosen != self.strategy:
            log.info("SSD strategy %s -> %s (b=%d, p_hit=%.3f, scores %s, b*=%.3g)", self.strategy, chosen,
                     batch, inputs.p_hit, {k: round(v, 2) for k, v in scores.items()}, decision.b_star)
        log.debug("SSD strategy %s: inputs %s", chosen, inputs)
        self.strategy = chosen
        if self._decided:
            self._choices[bucket] = chosen
        # the rule's own inputs; a round that measures T_p / T_b directly overwrites them (_finish)
        timing = {"T_p": inputs.primary_seconds / inputs.verify_seconds}
        if "neural" in inputs.draft_seconds:
            timing["T_b"] = inputs.draft_seconds["neural"] / inputs.verify_seconds
        predicted = decision.predicted_speedup * scores[chosen] / scores[decision.chosen]  # of the one run
        self.stats.set_ssd_state(strategy=chosen, b_star=decision.b_star, predicted_speedup=predicted,
                                 scores=dict(scores), p_hit_estimate=inputs.p_hit, **timing)
        return chosen

    def _propose(self, running: list[Sequence], ks: list[int], strategy: str, plan: FanoutPlan) -> _Round:
        n = len(running)
        rnd = _Round([[] for _ in range(n)], [PointDraft() for _ in range(n)], ["none"] * n,
                     warm=[False] * n, cached=[0] * n, first=[self.tracks[id(s)].verdict is None for s in running])
        need_backup = list(range(n)) if strategy in ("suffix",) else []
        if strategy in USES_DRAFT and self.client is not None:
            on_miss = strategy in ("ssd+neural", "sd")
            rows = []
            for seq, k in zip(running, ks):
                tr = self.tracks[id(seq)]
                if tr.told and tr.verdict is not None:
                    rows.append(VerdictRow(tr.seq_id, tr.verdict[0], tr.verdict[1], seq.num_tokens, k, on_miss))
                else:
                    rows.append(VerdictRow(tr.seq_id, SYNC, 0, seq.num_tokens, k, on_miss,
                                           tuple(seq.all_token_ids[tr.known:])))
                tr.known = seq.num_tokens
            try:
                t0 = time.perf_counter()
                reply = self.client.request(Verdicts(tuple(rows), plan.fanout))
                if not isinstance(reply, ChainReply):
                    raise WorkerFailure(f"expected a ChainReply, got {type(reply).__name__}")
                self._accept_reply(reply, rows, ks, rnd)
                rnd.wait_seconds = time.perf_counter() - t0
            except WorkerFailure as err:  # chains not received: empty proposals (AR steps) this round
                self._fail(err)
                rnd = _Round([[] for _ in range(n)], [PointDraft() for _ in range(n)], ["none"] * n,
                             warm=[False] * n, cached=[0] * n, first=rnd.first)
            else:
                need_backup = [i for i in range(n) if rnd.reply.rows[i].status == MISS and ks[i] > 0]
        if need_backup and self.backup is not None and strategy in ("ssd+suffix", "ssd+random", "suffix"):
            t0 = time.perf_counter()
            prop = self.backup.propose([running[i] for i in need_backup], [ks[i] for i in need_backup])
            rnd.backup_seconds = time.perf_counter() - t0
            for j, i in enumerate(need_backup):
                rnd.chains[i] = list(prop.tokens[j])[: ks[i]]
                rnd.dists[i] = _row_of(prop.draft, j)
                rnd.paths[i] = self.backup.name if rnd.chains[i] else "none"
        return rnd

    def _accept_reply(self, reply: ChainReply, rows, ks: list[int], rnd: _Round) -> None:
        """Check the reply against the request (a worker's answer is not trusted) and take its chains."""
        vocab = self.runner.model.cfg.vocab_size
        if len(reply.rows) != len(rows) or reply.vocab != vocab:
            raise WorkerFailure("chain reply does not match the request")
        rnd.reply = reply
        for i, (row, req) in enumerate(zip(reply.rows, rows)):
            if row.seq_id != req.seq_id or len(row.tokens) > ks[i] or any(not 0 <= t < vocab for t in row.tokens):
                raise WorkerFailure(f"chain reply row {i} does not match the request")
            rnd.warm[i] = row.cached >= 0
            rnd.cached[i] = max(row.cached, 0)
            if row.status in (HIT, DRAFTED) and row.tokens:
                q = row.q
                at = q[torch.arange(len(row.tokens)), torch.tensor(row.tokens)]
                if not bool(torch.isfinite(q).all()) or bool((q < 0).any()) or bool((at <= 0).any()):
                    raise WorkerFailure(f"chain reply row {i} has an invalid q")
                rnd.chains[i] = list(row.tokens)
                rnd.dists[i] = DenseDraft(q[None].clone())
                rnd.paths[i] = "hit" if row.status == HIT else "neural"

    # ------------------------------------------------------------------ telemetry
    def _observe(self, strategy: str, plan: FanoutPlan, rnd: _Round, ks: list[int], accepted: list[int],
                 rejected: list[bool], verify_seconds: float) -> None:
        est, planner, b = self.estimates, self.planner, len(ks)
        # a round of first rounds only (a generation's cold start) times nothing: it carries one-off costs
        # (weight copies remade after a policy update, first touches of the KV cache) that later rounds
        # do not, and one such time would hold a strategy's estimate down until that strategy runs again
        timed = (lambda name, seconds, batch: None) if rnd.cold else est.observe_time
        if strategy == "ar":  # a one-token step: AR's time, not a K+1-token verify's (and a calibration)
            timed("decode", verify_seconds, b)
            self._calibrations, self._rounds_since_calibration = self._calibrations + 1, 0
        else:
            timed("verify", verify_seconds, b)
            self._measured_rounds += not rnd.cold
        # acceptance and tokens per round leave out each sequence's first round: the first tokens after a
        # prompt are the easiest (a trace at batch 16 greedy, bench/RESULTS.md), every rollout has one, and
        # the rule decides about the rounds after it
        groups: dict[str, list[int]] = {}
        for i, path in enumerate(rnd.paths):
            if not rnd.first[i]:
                groups.setdefault(path, []).append(i)
        for path, idx in groups.items():
            if path == "none":
                continue
            acc = sum(accepted[i] for i in idx)
            judged = acc + sum(int(rejected[i]) for i in idx)
            est.observe_round(path, len(idx), acc, judged, acc + len(idx))
            if path in ("hit", "neural"):
                planner.observe_acceptance(acc, judged)
        asked = [i for i in range(len(ks)) if ks[i] > 0]
        warm = [i for i in asked if rnd.warm[i]]
        hits = [i for i in asked if rnd.paths[i] == "hit"]
        if strategy.startswith("ssd+"):
            self.stats.add_ssd_round(strategy, len(asked), len(hits), len(warm))
        else:
            self.stats.add_ssd_round(strategy, 0, 0, 0)
        if warm:
            est.observe_cache(len([i for i in warm if rnd.paths[i] == "hit"]),
                              len([i for i in warm if rnd.paths[i] != "hit"]))
            planner.observe_cache([rnd.cached[i] for i in warm], [rnd.paths[i] == "hit" for i in warm])
        state = {"fanout": list(plan.fanout), "a_estimate": plan.a, "r_estimate": plan.r,
                 "predicted_miss_rate": plan.predicted_miss_rate}
        reply = rnd.reply
        if reply is not None:
            if reply.build_seconds > 0 and self._prev_verify:
                timed("primary", reply.build_seconds, self._prev_batch)
                planner.observe_timing(reply.build_seconds, max(self._prev_budget, 1), self._prev_verify,
                                       min(reply.glue_seconds, reply.build_seconds))
                state["T_p"] = reply.build_seconds / self._prev_verify
            # draft-side times are the target's waits (strategy.py): on-demand drafting, or the cache's transfer
            if any(p == "neural" for p in rnd.paths):
                timed("neural", rnd.wait_seconds, b)
                state["T_b"] = rnd.wait_seconds / verify_seconds
            elif asked and all(rnd.paths[i] == "hit" for i in asked):
                excess = max(0.0, reply.build_seconds - (self._prev_verify or 0.0))  # counted in T_p
                overhead = max(0.0, rnd.wait_seconds - excess)
                timed("overhead", overhead, b)
                state["T_o"] = overhead / verify_seconds
        if rnd.backup_seconds and self.backup is not None and self.backup.name in ("suffix", "random"):
            timed(self.backup.name, rnd.backup_seconds, b)
            state["T_b"] = rnd.backup_seconds / verify_seconds
        self._prev_verify, self._prev_batch = verify_seconds, b
        self._prev_budget = plan.budget if strategy.startswith("ssd+") else 0
        state["strategy"] = strategy
        self.stats.set_ssd_state(**state)


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
