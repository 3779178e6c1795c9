"""Weight updates on their way into the engine: one queue per weight holder (the target, the draft).

An update arrives in process (`submit`: (HF name, tensor) pairs, a `NamedUpdate`) or from a
`weight_sync.WeightReceiver` served by a background thread (`attach_receiver`: a verified
`StagedUpdate`). Either way it is checked before anything is queued, queued, and applied between
rounds in arrival order, never inside one: the scheduler calls `apply` at every round boundary, and an
update that arrives while no driver runs rounds is applied at once (`apply_when_idle`).

What differs between the target and the draft lives in the holder (`TargetWeights` here, `DraftSync`
in draft_sync.py): how an arriving update is checked, how it is written, and what is counted once it
is. A write that fails (ValueError) leaves the holder at its version and is counted as rejected, as is
a transfer the receiver refused; a receiver's refused update is discarded so its sender learns of it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Protocol

import torch

from rollout_ssd.gpu.devices import CUDA_CAPTURE_LOCK
from rollout_ssd.named_update import NamedUpdate

log = logging.getLogger(__name__)


class WeightHolder(Protocol):
    """What an `UpdateQueue` writes to. what: the public method named in errors; label: the log prefix;
    stays: the log's phrase for 'keeps version {}'."""

    what: str
    label: str
    stays: str

    def ready(self) -> None:
        """Raise ValueError if there is nothing to update (checked before a receiver thread starts)."""

    def check(self, update: NamedUpdate, queue: "UpdateQueue") -> None:
        """Validate an in-process update on arrival (ValueError: nothing is queued)."""

    def write(self, update, queue: "UpdateQueue") -> None:
        """Write an update into the weights (between rounds); ValueError rejects it untouched."""

    def applied(self, update, seconds: float) -> None:
        """Count an update that was written."""


class UpdateQueue:
    """One holder's updates: validated on arrival, applied between rounds in order, counted.

    version: the version applied last; newest: the newest version applied or handed over in process;
    rejected: updates and transfers refused. apply_when_idle() applies the queue now if no driver runs
    rounds (the scheduler's `when_idle`), otherwise the driver does at its next round boundary."""

    def __init__(self, holder: WeightHolder, apply_when_idle: Callable[[], None]):
        self.holder = holder
        self._apply_when_idle = apply_when_idle
        self._queue: deque = deque()
        self._lock = threading.Lock()  # held while checking against `newest` and while applying
        self.version = 0
        self.newest = 0
        self.rejected = 0
        self._threads: list[threading.Thread] = []

    def submit(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Validate an in-process update now (ValueError: nothing queued), queue it, apply it if idle."""
        update = NamedUpdate(named_tensors, version, what=self.holder.what)
        with self._lock:
            with CUDA_CAPTURE_LOCK:  # the check runs kernels: never during a CUDA graph capture
                self.holder.check(update, self)
            self.newest = update.version
            self._queue.append(update)
        self._apply_when_idle()

    def attach_receiver(self, receiver, closed: Callable[[], bool]) -> None:
        """Serve a `weight_sync.WeightReceiver`: a background thread receives and verifies transfers and
        queues them, until `closed()` or the transport fails."""
        self.holder.ready()
        thread = threading.Thread(target=self._receive, args=(receiver, closed), daemon=True,
                                  name=f"rollout-ssd-{self.holder.label.split()[0]}-receiver")
        thread.start()
        self._threads.append(thread)

    def _receive(self, receiver, closed: Callable[[], bool]) -> None:
        from rollout_ssd.weight_sync import TransportError, WeightSyncError

        while not closed():
            try:
                staged = receiver.receive(timeout=None)
            except WeightSyncError as err:
                if isinstance(err, TransportError) and closed():
                    return
                with self._lock:
                    self.rejected += 1
                log.warning("%s: transfer rejected, %s: %s", self.holder.label,
                            self.holder.stays.format(self.version), err)
                if isinstance(err, TransportError):
                    return
                continue
            with self._lock:
                self._queue.append(staged)
            self._apply_when_idle()

    def apply(self) -> bool:
        """Apply every queued update (between rounds only). Returns whether any was applied."""
        applied = False
        with self._lock:
            while self._queue:
                update = self._queue.popleft()
                t0 = time.perf_counter()
                try:
                    self.holder.write(update, self)
                except ValueError as err:
                    discard = getattr(update, "discard", None)  # a receiver's update: tell the sender
                    if discard is not None:
                        discard()
                    self.rejected += 1
                    log.warning("%s: update %s rejected, %s: %s", self.holder.label, getattr(update, "version", "?"),
                                self.holder.stays.format(self.version), err)
                    continue
                self.version = update.version
                self.newest = max(self.newest, self.version)
                self.holder.applied(update, time.perf_counter() - t0)
                applied = True
        return applied


class TargetWeights:
    """The target model as a weight holder. An arriving update is checked against the version served
    now; its transfer time and bytes go to the engine's counters (`sync/seconds`, `sync/bytes`)."""

    what = "update_weights"
    label = "weight sync"
    stays = "still serving version {}"

    def __init__(self, params: Callable[[], dict[str, torch.Tensor]], stats):
        self._params, self._stats = params, stats

    def ready(self) -> None:
        pass

    def check(self, update: NamedUpdate, queue: UpdateQueue) -> None:
        # against the newest version accepted, not the one applied: v5 then v3 queued in one round would
        # otherwise both be accepted and leave the engine serving v3 (as the draft's check already does)
        update.validate(self._params(), queue.newest)

    def write(self, update, queue: UpdateQueue) -> None:
        update.apply_to(self._params())

    def applied(self, update, seconds: float) -> None:
        self._stats.add_sync(seconds, getattr(getattr(update, "stats", None), "bytes_received", 0))
