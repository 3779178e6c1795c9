"""The target's share of the CPU while a draft worker process holds a core of its own.

On a CPU the SSD draft worker runs beside the target on its own core (ssd/worker_client.py): while the
worker builds the speculation cache the target must stay off that core, or the two fight for it. A
round whose plan leaves the worker idle (AR, and SD's verify: the worker drafted its chains before and
has nothing to do) has no reason to: `TargetCores.widen` gives the target every core it had (and its
intra-op threads) back for that round, and `narrow` pins it to its own core again before an SSD round.
Without it an SSD engine that falls back to AR or SD runs it on half the machine. Between calls the
thread is wide (SSDDecode.on_idle), as it was before the engine was made.

Both the affinity and OpenMP's thread count belong to the calling thread (the one running the rounds);
the intra-op workers it starts inherit its affinity.
"""

from __future__ import annotations

import os
import threading

import torch


class TargetCores:
    """The two CPU shares of the target process: `narrow` (its own core, one thread, beside the worker)
    and `wide` (what it had before the worker started). Both are no-ops where no split was made."""

    def __init__(self, wide: set[int], narrow: set[int], wide_threads: int):
        self.wide_cores, self.narrow_cores = set(wide), set(narrow)
        self.wide_threads = wide_threads
        self._state: tuple[int, bool] | None = None  # (thread that set it, wide?): both are per thread

    @property
    def is_wide(self) -> bool:
        return self._state is None or self._state[1]

    def narrow(self) -> None:
        """Pin the calling thread to the target's own core with one intra-op thread (an SSD round: the
        worker uses the other core)."""
        self._set(False, self.narrow_cores, 1)

    def widen(self) -> None:
        """Every core and thread the target had before the worker started (the worker is idle)."""
        self._set(True, self.wide_cores, self.wide_threads)

    def _set(self, wide: bool, cores: set[int], threads: int) -> None:
        state = (threading.get_ident(), wide)
        if state == self._state:
            return
        try:
            os.sched_setaffinity(0, cores)  # this thread's; the intra-op pool it starts inherits it
        except OSError:  # a core taken from the process meanwhile: the thread count is still set
            pass
        torch.set_num_threads(threads)  # OpenMP keeps this per calling thread as well
        self._state = state


def split_for_worker(pin: bool) -> tuple[TargetCores | None, int | None]:
    """The target's TargetCores (its first core, and every core it has) and the worker's core, or
    (None, None) where the process has fewer than two cores or `pin` is off. The calling thread is left
    wide: SSD rounds narrow it and the engine widens it again when a call ends (other engines the same
    thread drives must not find it on one core)."""
    if not pin or not hasattr(os, "sched_getaffinity"):
        return None, None
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return None, None
    return TargetCores(set(cores), {cores[0]}, torch.get_num_threads()), cores[1]
