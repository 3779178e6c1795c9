"""LearnerSync: the learner's side of weight sync in one object, for the target (policy) and the draft.

It owns one WeightSender per model over the transport of the learner's choice (InProcessTransport when
the engine lives in the learner's process, DistributedTransport over a torch.distributed group
otherwise; the engine serves them with `attach_receiver` / `attach_draft_receiver`). Each sync casts
the learner's floating parameters to the rollout dtype (the sender's `SenderConfig.dtype`), encodes
full or exact-delta tensors against what the receivers acknowledged last, sends, waits for the
acknowledgement and returns the `TransferStats` (bytes on the wire, seconds, changed share).

Weights may be given as a mapping or an iterable of (HF name, tensor), a model with `hf_parameters()`
(rollout_ssd's Decoder), or any torch module (its state_dict; a tensor that shares storage with an
earlier one, a tied LM head, is sent once under the first name). Depends only on torch.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from .sender import SenderConfig, TransferStats, WeightSender
from .transport import Transport

logger = logging.getLogger(__name__)


def named_tensors(weights: Any, exclude: Iterable[str] = ()) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs from a mapping, an iterable of pairs, a model with `hf_parameters()`, or a
    torch module (state_dict, storage-sharing duplicates dropped); names in `exclude` are left out."""
    skip = set(exclude)
    if hasattr(weights, "hf_parameters"):
        items = list(weights.hf_parameters().items())
    elif isinstance(weights, torch.nn.Module):
        items, seen = [], set()
        for name, t in weights.state_dict(keep_vars=True).items():
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
            if key not in seen:
                seen.add(key)
                items.append((name, t))
    elif isinstance(weights, Mapping):
        items = list(weights.items())
    else:
        items = list(weights)
    return [(name, t) for name, t in items if name not in skip]


class LearnerSync:
    """target / draft: the transports to the engine's target and draft receivers (draft optional).
    config / draft_config: their SenderConfig (rollout dtype, delta, buckets, compression).
    timeout: seconds to wait for the receivers' acknowledgement of each sync."""

    def __init__(self, target: Transport, draft: Transport | None = None, *, config: SenderConfig | None = None,
                 draft_config: SenderConfig | None = None, timeout: float | None = 60.0):
        self.target = WeightSender(target, config or SenderConfig())
        self.draft = None if draft is None else WeightSender(draft, draft_config or config or SenderConfig())
        self.timeout = timeout
        self.last: dict[str, TransferStats] = {}

    def seed_target(self, weights: Any, version: int, exclude: Iterable[str] = ()) -> None:
        """The engine already holds these target weights at `version` (same checkpoint): the first sync
        may then be a delta."""
        self.target.seed(named_tensors(weights, exclude), version)

    def seed_draft(self, weights: Any, version: int, exclude: Iterable[str] = ()) -> None:
        self._draft_sender().seed(named_tensors(weights, exclude), version)

    def sync_target(self, weights: Any, version: int, *, force_full: bool = False,
                    exclude: Iterable[str] = ()) -> TransferStats:
        """Send the policy's weights as `version` and wait until the engine applied them."""
        return self._sync("target", self.target, weights, version, force_full, exclude)

    def sync_draft(self, weights: Any, version: int, *, force_full: bool = False,
                   exclude: Iterable[str] = ()) -> TransferStats:
        """Send the draft's weights as draft `version` (e.g. DraftFollower.named_tensors())."""
        return self._sync("draft", self._draft_sender(), weights, version, force_full, exclude)

    def metrics(self) -> dict[str, float]:
        """The last syncs as metrics: sync/* for the target, sync/draft_* for the draft."""
        out: dict[str, float] = {}
        if "target" in self.last:
            out.update(self.last["target"].as_metrics())
        if "draft" in self.last:
            out.update({k.replace("sync/", "sync/draft_", 1): v for k, v in self.last["draft"].as_metrics().items()})
        return out

    def _draft_sender(self) -> WeightSender:
        if self.draft is None:
            raise ValueError("LearnerSync has no draft transport (pass draft=...)")
        return self.draft

    def _sync(self, which: str, sender: WeightSender, weights: Any, version: int, force_full: bool,
              exclude: Iterable[str]) -> TransferStats:
        with torch.no_grad():
            stats = sender.sync(named_tensors(weights, exclude), version, timeout=self.timeout, force_full=force_full)
        if not stats.acknowledged:
            logger.warning("LearnerSync: %s version %d was not acknowledged by every receiver", which, version)
        self.last[which] = stats
        return stats
