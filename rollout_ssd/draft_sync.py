"""The rollout side of draft weight sync: updates to the draft model, applied between rounds.

A draft follows the policy (docs/THEORY.md §5) when the learner distills it and sends its new weights
(`draft/follow.py`, `weight_sync.LearnerSync`). They reach the engine in process
(`RolloutEngine.update_draft_weights`) or through a `weight_sync.WeightReceiver`
(`RolloutEngine.attach_draft_receiver`); either way the engine's draft `updates.UpdateQueue` validates
them on arrival, queues them, and applies them between rounds through `DraftSync` (this module), to the
draft wherever it lives, by its holder:
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

from collections.abc import Callable

import torch

from rollout_ssd import metric_names as names
from rollout_ssd.named_update import NamedUpdate

SHARED_REASON = "is shared with the target model; it follows target updates (update_weights), not draft updates"


def shared_names(draft: dict[str, torch.Tensor], target: dict[str, torch.Tensor]) -> set[str]:
    """Draft parameters whose storage is one of the target's (they change with the target)."""
    storages = {t.untyped_storage().data_ptr() for t in target.values()}
    return {n for n, t in draft.items() if t.untyped_storage().data_ptr() in storages}


class DraftSync:
    """The draft as a weight holder (`updates.WeightHolder`). `strategy()` returns the engine's decode
    strategy, `target_params()` the target's HF parameters. An update is checked against the newest
    version handed over (queued ones included) and, when written, against the version the draft holds."""

    what = "update_draft_weights"
    label = "draft sync"
    stays = "the draft stays at version {}"

    def __init__(self, strategy: Callable[[], object], target_params: Callable[[], dict[str, torch.Tensor]]):
        self._strategy, self._target_params = strategy, target_params
        self.count = 0
        self.bytes = 0
        self.seconds = 0.0

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

    # ------------------------------------------------------------------ updates.WeightHolder
    def ready(self) -> None:
        self.holder()  # fail now, not in a receiver thread, if there is no draft

    def check(self, update: NamedUpdate, queue) -> None:
        params, shared = self._params(self.holder())
        update.validate(params, queue.newest, shared, SHARED_REASON)

    def write(self, update, queue) -> None:
        holder = self.holder()
        params, _ = self._params(holder)
        if update.version <= queue.version:
            raise ValueError(f"version {update.version} is not newer than the draft's {queue.version}")
        holder.apply_draft_update(update, params, tuple(update.names))

    def applied(self, update, seconds: float) -> None:
        self.count += 1
        self.seconds += seconds
        stats = getattr(update, "stats", None)
        self.bytes += stats.bytes_received if stats is not None else getattr(update, "nbytes", 0)

    # ------------------------------------------------------------------ reporting
    def digest(self) -> int:
        """weights_digest (ssd/draft_server.py) of the draft the engine serves from; SSD asks the draft
        side itself, the worker process included (a debug check that it holds what was sent)."""
        from rollout_ssd.ssd.draft_server import weights_digest

        holder = self.holder()
        if hasattr(holder, "draft_digest"):
            return holder.draft_digest()
        return weights_digest(holder.draft_parameters())

    def metrics(self, queue) -> dict:
        """The draft's sync counters; queue: the engine's draft UpdateQueue (version, rejected)."""
        out = {names.SYNC_DRAFT_VERSION: queue.version, names.SYNC_DRAFT_REJECTED: queue.rejected}
        if self.count:
            out.update({names.SYNC_DRAFT_COUNT: self.count, names.SYNC_DRAFT_BYTES: self.bytes,
                        names.SYNC_DRAFT_SECONDS: self.seconds})
        return out
