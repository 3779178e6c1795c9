"""The target side's handle on the SSD draft side: the client, failover and restarts, the sequence
mirror, admission, and the draft's weights.

The draft side (a DraftServer, in process or in the worker process) knows each sequence through a
`_Track`: how many committed tokens it has, and the chain it was told. Each round the target tells it
the previous round's verdict (k, t*), or the committed tokens it lacks (SYNC, after rounds that left it
behind), and gets this round's chains (`request_chains`), which it checks before trusting; then it tells
the draft side the chains, from which it builds the next cache (`build`).

Draft weights (`apply_draft_update`, between rounds): the target side keeps its own copy of the draft
(the in-process draft side, the fallback, and what a restarted worker loads); an update is validated and
written there first, then the draft side is brought in line (in process: nothing to copy; the worker: an
exact delta through shared memory, ssd/worker_client.py), and the draft side drops its cache and draft
KV. A draft that shares a tensor with the target (the embedding of a built-in draft) follows target
updates: `on_weights_changed` forwards a changed shared tensor to the worker the same way.

Faults: if the worker dies, times out or answers nonsense, we warn once, terminate it, and finish with
an in-process draft model (SD) or AR (`fallback`). Nothing is lost or duplicated: the target's sequences
are the only record of committed tokens, and a fresh draft side is re-admitted from them.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Optional

import torch

from rollout_ssd.decode import RoundOutcome
from rollout_ssd.draft_sync import shared_names
from rollout_ssd.metrics import EngineMetrics
from rollout_ssd.models.decoder import Decoder
from rollout_ssd.sequence import Sequence
from rollout_ssd.spec.verify import DenseDraft, DraftDistribution, PointDraft
from rollout_ssd.ssd.client import DraftClient, LocalDraftClient, WorkerFailure
from rollout_ssd.ssd.config import SSDConfig
from rollout_ssd.ssd.draft_server import DraftServer, weights_digest
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
from rollout_ssd.ssd.plans import Plan
from rollout_ssd.ssd.rng import draft_key
from rollout_ssd.ssd.tree import SaguaroRule

log = logging.getLogger(__name__)


@dataclass
class _Track:
    """What the target side knows about a sequence's draft-side view."""

    seq_id: int
    known: int  # committed tokens the draft side has (counting the pending verdict when `told`)
    chain: list[int] = field(default_factory=list)
    told: bool = False  # the draft side knows `chain`, so a verdict (k, t*) is enough
    verdict: Optional[tuple[int, int]] = None


@dataclass
class Chains:
    """One round's proposals and where they came from."""

    chains: list[list[int]]
    q: list[DraftDistribution]  # the law each chain was drawn from, one single-row law per sequence
    paths: list[str]  # "hit" | "draft" | "suffix" | "random" | "none"
    first: list[bool]  # the sequence's first round (no verdict before it)
    reply: Optional[ChainReply] = None
    warm: list[bool] = field(default_factory=list)  # a cache had been built for the sequence
    cached: list[int] = field(default_factory=list)  # candidates cached at the realised depth
    backup_seconds: float = 0.0
    wait_seconds: float = 0.0  # the target's wait for the draft side's chains, request to validated reply
    whole_q: Optional[DraftDistribution] = None  # one law for the whole batch (an SD round in process)
    drafted_here: Optional[tuple[int, float, bool]] = None  # misses drafted in the target's process: rows, seconds, lagged
    lagged: bool = False  # the draft (the draft side; an SD round's speculator) caught up on rounds it sat out

    @classmethod
    def empty(cls, first: list[bool]) -> "Chains":
        """No chain for anyone: every sequence verifies an empty proposal (an AR step)."""
        n = len(first)
        return cls([[] for _ in range(n)], [PointDraft() for _ in range(n)], ["none"] * n, list(first),
                   warm=[False] * n, cached=[0] * n)

    @property
    def cold(self) -> bool:
        """Every sequence is on its first round (a generation's cold start: one-off costs)."""
        return all(self.first)


def _stamp(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), t._version


def concurrent_draft_side(device: torch.device) -> str:
    """What runs the draft side beside the target (`worker=True`) for a draft on `device`: a process on
    a CPU (its own core; shared memory is host memory), a thread with its own stream elsewhere."""
    return "process" if device.type == "cpu" else "thread"


class DraftSide:
    def __init__(self, draft_model: Decoder, target_params: dict[str, torch.Tensor], config: SSDConfig,
                 stats: EngineMetrics, num_slots: int, max_model_len: int):
        self.draft_model = draft_model
        self.config = config
        self.stats = stats
        self.num_slots = num_slots
        self.max_model_len = max_model_len
        self.tracks: dict[int, _Track] = {}  # id(seq) -> track
        self.live: dict[int, Sequence] = {}
        self.unsent: dict[int, Sequence] = {}  # admitted, not yet sent to a worker process (`admit`)
        self._next_id = 0
        self.failed = False
        self._warned = False
        self._restarts = 0
        self.client: Optional[DraftClient] = None
        self.draft_version = 0
        self._weights_lock = threading.Lock()  # draft weight traffic may come from a receiver thread
        shared = shared_names(draft_model.hf_parameters(), target_params)
        self._shared_names = [n for n in draft_model.hf_parameters() if n in shared]
        # what the draft side holds of each shared tensor: its (storage, version counter) when it was sent;
        # every write through copy_ or an in-place op bumps the counter, so no checksum (on a GPU: no copy
        # to the host) is needed to see that the target changed it
        self._shared_stamps: dict[str, tuple[int, int]] = {}
        try:
            self.client = self._start_client(worker=config.worker)
        except WorkerFailure as err:  # a worker that cannot start is a failure like any other
            self._fail(err)

    @property
    def shares_target_tensors(self) -> bool:
        """Whether the draft holds tensors of the target (a built-in draft's embedding)."""
        return bool(self._shared_names)

    @property
    def cores(self):
        """The target's CPU share beside a worker process (a TargetCores, ssd/cores.py), or None."""
        return self.client.cores if self.client is not None else None

    @property
    def fallback(self) -> Optional[Plan]:
        """None while healthy; after a failure, what the rounds run instead (SD in process, or AR)."""
        return None if not self.failed else Plan.SD if self.client is not None else Plan.AR

    # ------------------------------------------------------------------ client, failover, restarts
    def _local_server(self, model: Optional[Decoder] = None) -> DraftServer:
        cfg = self.config
        model = model if model is not None else self.draft_model
        return DraftServer(model, self.num_slots, self.max_model_len, cfg.k, cfg.max_branches,
                           SaguaroRule(C=cfg.saguaro_c, c_min=cfg.c_min), draft_version=self.draft_version)

    def _start_client(self, worker: bool) -> DraftClient:
        params = self.draft_model.hf_parameters()
        self._shared_stamps = {n: _stamp(params[n]) for n in self._shared_names}  # what the draft side holds
        from rollout_ssd.gpu.devices import resolved

        here = self.draft_model.embed.device
        device = resolved(self.config.draft_device) if self.config.draft_device else here
        if worker and concurrent_draft_side(device) == "thread":
            from rollout_ssd.ssd.thread_client import ThreadDraftClient

            model = self.draft_model if device == resolved(here) else \
                copy.deepcopy(self.draft_model).to(device)  # its own copy on its own device
            return ThreadDraftClient(self._local_server(model), timeout=self.config.worker_timeout)
        if worker:
            from rollout_ssd.ssd.worker_client import WorkerClient

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
                   f"{'the draft model in process (SD)' if self.config.fallback == 'sd' else 'AR'}")
            warnings.warn(msg, RuntimeWarning, stacklevel=4)
            log.warning(msg)
        self.stats.ssd_worker_failures += 1
        if self.client is not None:
            self.client.close()
        self.client = None
        self.failed = True
        self.unsent = {}  # every live sequence is admitted anew, wherever the rounds go next
        if self.config.fallback == "sd":
            self.client = LocalDraftClient(self._local_server())
            if self.live:
                self.client.send(self._admit_rows(list(self.live.values())))

    def restart_worker(self) -> None:
        """Start a fresh draft worker (or in-process draft side) and re-admit every live sequence."""
        if self.client is not None:
            self.client.close()
            self.client = None
        self.unsent = {}
        try:
            self.client = self._start_client(worker=self.config.worker)
            if self.live:
                self.client.send(self._admit_rows(list(self.live.values())))
            self.failed = False
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
    def admitted(self, seq: Sequence) -> bool:
        return id(seq) in self.tracks

    def admit(self, seqs: list[Sequence]) -> list[Sequence]:
        """Admit the sequences not yet admitted (restarting a failed worker first, while restarts are
        left); returns them. Beside a worker process on a CPU they are sent to it only when a round first
        asks it for chains (`flush`): its prefill would otherwise run on its core while the target's AR or
        SD rounds run on every core, the two slowing each other, and a batch the rule runs AR or SD on
        throughout never needs it. Sent then, they carry every committed token, as a SYNC would."""
        seqs = [s for s in seqs if id(s) not in self.tracks]  # already admitted by before_prefill
        if not seqs:
            return seqs
        if self.failed and self.config.worker and self._restarts < self.config.max_restarts:
            self._restarts += 1
            log.warning("SSD: restarting the draft worker (restart %d of %d)", self._restarts, self.config.max_restarts)
            self.restart_worker()
        for seq in seqs:
            self.tracks[id(seq)] = _Track(self._next_id, 0)
            self.live[id(seq)] = seq
            self._next_id += 1
        if self.cores is not None:
            self.unsent.update((id(s), s) for s in seqs)
        elif self.client is not None:
            self._send(self._admit_rows(seqs))
        return seqs

    def flush(self) -> None:
        """Send the admissions `admit` held back (before anything else goes to the draft side)."""
        if self.unsent:
            seqs, self.unsent = list(self.unsent.values()), {}
            self._send(self._admit_rows(seqs))

    def release(self, seq: Sequence) -> None:
        tr = self.tracks.pop(id(seq), None)
        self.live.pop(id(seq), None)
        if self.unsent.pop(id(seq), None) is None and tr is not None:  # one never sent is not released
            self._send(ReleaseSequences((tr.seq_id,)))

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None

    # ------------------------------------------------------------------ one round
    def is_first_round(self, seq: Sequence) -> bool:
        return self.tracks[id(seq)].verdict is None

    def request_chains(self, running: list[Sequence], ks: list[int], drafts_on_miss: bool,
                       fanout: tuple[int, ...], out: Chains) -> bool:
        """Tell each sequence's last verdict (or SYNC its missing tokens), get this round's chains into
        `out`; False when the draft side failed (then `out` is left empty)."""
        if self.client is None:
            return False
        self.flush()
        rows = []
        for seq, k in zip(running, ks):
            tr = self.tracks[id(seq)]
            if tr.told and tr.verdict is not None:
                rows.append(VerdictRow(tr.seq_id, tr.verdict[0], tr.verdict[1], seq.num_tokens, k, drafts_on_miss))
            else:
                rows.append(VerdictRow(tr.seq_id, SYNC, 0, seq.num_tokens, k, drafts_on_miss,
                                       tuple(seq.all_token_ids[tr.known:])))
            tr.known = seq.num_tokens
        try:
            t0 = time.perf_counter()
            reply = self.client.request(Verdicts(tuple(rows), fanout))
            if not isinstance(reply, ChainReply):
                raise WorkerFailure(f"expected a ChainReply, got {type(reply).__name__}")
            self._accept_reply(reply, rows, ks, out)
            out.wait_seconds = time.perf_counter() - t0
            out.lagged = max((len(r.tail) for r in rows if r.k == SYNC), default=0) > max(ks, default=0) + 1
        except WorkerFailure as err:  # chains not received: empty proposals (AR steps) this round
            self._fail(err)
            return False
        return True

    def _accept_reply(self, reply: ChainReply, rows, ks: list[int], out: Chains) -> None:
        """Check the reply against the request (a worker's answer is not trusted) and take its chains."""
        vocab = self.draft_model.cfg.vocab_size
        if len(reply.rows) != len(rows) or reply.vocab != vocab:
            raise WorkerFailure("chain reply does not match the request")
        out.reply = reply
        checks: list[tuple[int, torch.Tensor]] = []  # (row, q valid): judged together, one host read
        for i, (row, req) in enumerate(zip(reply.rows, rows)):
            if row.seq_id != req.seq_id or len(row.tokens) > ks[i] or any(not 0 <= t < vocab for t in row.tokens):
                raise WorkerFailure(f"chain reply row {i} does not match the request")
            out.warm[i] = row.cached >= 0
            out.cached[i] = max(row.cached, 0)
            if row.status in (HIT, DRAFTED) and row.tokens:
                q = row.q  # [len, V]
                at = q[torch.arange(len(row.tokens), device=q.device), torch.tensor(row.tokens, device=q.device)]
                lo, hi = torch.aminmax(q)  # a NaN makes both NaN: lo >= 0 fails; one pass, no [len, V] mask
                checks.append((i, (lo >= 0) & torch.isfinite(hi) & (at > 0).all()))
                out.chains[i] = list(row.tokens)
                out.q[i] = DenseDraft(q[None].clone())
                out.paths[i] = "hit" if row.status == HIT else "draft"
        if checks:
            valid = torch.stack([ok.to(checks[0][1].device) for _, ok in checks]).tolist()
            bad = [i for (i, _), ok in zip(checks, valid) if not ok]
            if bad:
                raise WorkerFailure(f"chain reply row {bad[0]} has an invalid q")

    def missed(self, out: Chains, ks: list[int]) -> list[int]:
        """Rows the draft side gave no chain for (a cache miss it did not draft), that want one."""
        return [i for i in range(len(ks)) if out.reply.rows[i].status == MISS and ks[i] > 0]

    def build(self, running: list[Sequence], chains: list[list[int]], ks: list[int], build: bool,
              fanout: tuple[int, ...]) -> bool:
        """Tell the draft side this round's chains; with `build`, it constructs the next cache from them
        (in the worker, while the target verifies). Returns whether it was told."""
        rows = tuple(BuildRow(self.tracks[id(s)].seq_id, tuple(c), build and k > 0)
                     for s, c, k in zip(running, chains, ks))
        return self._send(BuildCache(rows, fanout))

    def remember(self, running: list[Sequence], chains: list[list[int]], told: bool, outcome: RoundOutcome) -> None:
        """Each sequence's verdict (k, t*), told to the draft side at the start of the next round."""
        for seq, chain, k, t in zip(running, chains, outcome.accepted, outcome.bonus):
            tr = self.tracks[id(seq)]
            tr.chain, tr.told, tr.verdict = chain, told, (k, t)

    # ------------------------------------------------------------------ draft weights (between rounds)
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
            changed = {n: params[n] for n in self._shared_names if _stamp(params[n]) != self._shared_stamps.get(n)}
            if changed:
                self._push(changed, {})

    def digest(self) -> int:
        """weights_digest of the weights the draft side holds now (asked of the worker itself)."""
        with self._weights_lock:
            if self.client is None:
                return weights_digest(self.draft_model.hf_parameters())
            return self.client.digest().digest

    def _push(self, new: dict[str, torch.Tensor], old: dict[str, torch.Tensor]) -> None:
        if self.client is None:
            return
        self.flush()  # in order: the worker refreshes what it built of admitted sequences
        try:
            self.client.update_weights(new, old, self.draft_version)
        except WorkerFailure as err:  # the fallback starts from the target side's (updated) copy
            self._fail(err)
        for n in self._shared_names:
            if n in new:
                self._shared_stamps[n] = _stamp(new[n])
