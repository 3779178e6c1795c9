"""The rollout side of draft weight sync: updates to the draft model, applied between rounds.

A draft follows the policy (THEORY.md §5) when the learner distills it and sends its new weights
(`draft_follow.py`, `weight_sync.LearnerSync`). They reach the engine in process
(`RolloutEngine.update_draft_weights`) or through a `weight_sync.WeightReceiver`
(`RolloutEngine.attach_draft_receiver`); either way they are validated on arrival, queued, and applied
between rounds to the draft wherever it lives, by its holder:
  SD   the DraftModelSpeculator (its draft KV is cut and recomputed at the next round);
  SSD  SSDDecode: its in-process copy of the draft, then the draft side (in process, or the worker
       process through shared memory), which drops its speculation cache and draft KV.
A holder has `draft_parameters()` and `apply_draft_update(update, params, names)`.

Exactness does not depend on any of this: every chain is verified against the q it was drawn from, so
outputs stay lossless across draft updates. What the draft shares with the target (a built-in draft's
embedding is the target's own tensor) is not the draft's to change: an update naming it is refused, and
it follows target updates instead.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

import torch

from rollout_ssd.named_update import NamedUpdate

log = logging.getLogger(__name__)
SHARED_REASON = "is shared with the target model; it follows target updates (update_weights), not draft updates"


def DraftUpdate(named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> NamedUpdate:
    """A draft update handed over in process (validated on arrival, applied between rounds)."""
    return NamedUpdate(named_tensors, version, what="update_draft_weights")


def shared_names(draft: dict[str, torch.Tensor], target: dict[str, torch.Tensor]) -> set[str]:
    """Draft parameters whose storage is one of the target's (they change with the target)."""
    storages = {t.untyped_storage().data_ptr() for t in target.values()}
    return {n for n, t in draft.items() if t.untyped_storage().data_ptr() in storages}


class DraftSync:
    """The engine's draft-weight queue. `strategy()` returns the engine's decode strategy, `target_params()`
    the target's HF parameters, `sampling()` whether a `sample` call is running (then updates wait for the
    next round boundary, where the engine calls `apply_pending`)."""

    def __init__(self, strategy: Callable[[], object], target_params: Callable[[], dict[str, torch.Tensor]],
                 sampling: Callable[[], bool]):
        self._strategy, self._target_params, self._sampling = strategy, target_params, sampling
        self._lock = threading.Lock()  # held while checking `sampling()` and while applying
        self._queue: list = []
        self.version = 0
        self._newest = 0  # the newest version applied or queued
        self.rejected = 0
        self.count = 0
        self.bytes = 0
        self.seconds = 0.0
        self._threads: list[threading.Thread] = []

    # ------------------------------------------------------------------ the draft's holder
    def holder(self):
        strategy = self._strategy()
        for obj in (strategy, getattr(strategy, "speculator", None)):
            if obj is not None and hasattr(obj, "apply_draft_update"):
                return obj
        raise ValueError("this engine has no draft model to update (method='ar', or an SD speculator that is "
                         "not a neural draft)")

    def _params(self, holder) -> tuple[dict[str, torch.Tensor], set[str]]:
        """The draft's updatable parameters, and the names it shares with the target."""
        params = holder.draft_parameters()
        shared = shared_names(params, self._target_params())
        return {n: t for n, t in params.items() if n not in shared}, shared

    # ------------------------------------------------------------------ arrival
    def submit(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Validate an in-process update now (ValueError: nothing queued) and queue it."""
        update = DraftUpdate(named_tensors, version)
        params, shared = self._params(self.holder())
        with self._lock:
            update.validate(params, self._newest, shared, SHARED_REASON)
            self._newest = update.version
            self._queue.append(update)
            if not self._sampling():
                self._apply_locked()

    def attach_receiver(self, receiver, closed: Callable[[], bool]) -> None:
        """Serve a weight_sync WeightReceiver for the draft: a background thread receives and verifies
        transfers and queues them. A rejected transfer is logged and counted (`sync/draft_rejected`)."""
        self.holder()  # fail now, not in the thread, if there is no draft

        def loop():
            from rollout_ssd.weight_sync import TransportError, WeightSyncError

            while not closed():
                try:
                    staged = receiver.receive(timeout=None)
                except WeightSyncError as err:
                    if isinstance(err, TransportError) and closed():
                        return
                    self.rejected += 1
                    log.warning("draft sync: transfer rejected, the draft stays at version %d: %s", self.version, err)
                    if isinstance(err, TransportError):
                        return
                    continue
                with self._lock:
                    self._queue.append(staged)
                    if not self._sampling():
                        self._apply_locked()

        thread = threading.Thread(target=loop, name="rollout-ssd-draft-receiver", daemon=True)
        thread.start()
        self._threads.append(thread)

    # ------------------------------------------------------------------ between rounds
    def apply_pending(self) -> bool:
        """Apply every queued update (the engine calls this between rounds). Returns whether any applied."""
        with self._lock:
            return self._apply_locked()

    def _apply_locked(self) -> bool:
        applied = False
        while self._queue:
            update = self._queue.pop(0)
            t0 = time.perf_counter()
            try:
                holder = self.holder()
                params, _ = self._params(holder)
                if update.version <= self.version:
                    raise ValueError(f"version {update.version} is not newer than the draft's {self.version}")
                names = tuple(update.names)
                holder.apply_draft_update(update, params, names)
            except ValueError as err:
                discard = getattr(update, "discard", None)  # a receiver's update: tell the sender
                if discard is not None:
                    discard()
                self.rejected += 1
                log.warning("draft sync: update %s rejected, the draft stays at version %d: %s",
                            getattr(update, "version", "?"), self.version, err)
                continue
            self.version = update.version
            self._newest = max(self._newest, self.version)
            self.count += 1
            self.seconds += time.perf_counter() - t0
            stats = getattr(update, "stats", None)
            self.bytes += stats.bytes_received if stats is not None else getattr(update, "nbytes", 0)
            applied = True
        return applied

    def digest(self) -> int:
        """weights_digest (ssd/draft_server.py) of the draft the engine serves from; SSD asks the draft
        side itself, the worker process included (a debug check that it holds what was sent)."""
        from rollout_ssd.ssd.draft_server import weights_digest

        holder = self.holder()
        if hasattr(holder, "draft_digest"):
            return holder.draft_digest()
        return weights_digest(holder.draft_parameters())

    def metrics(self) -> dict:
        out = {"sync/draft_version": self.version, "sync/draft_rejected": self.rejected}
        if self.count:
            out.update({"sync/draft_count": self.count, "sync/draft_bytes": self.bytes,
                        "sync/draft_seconds": self.seconds})
        return out

