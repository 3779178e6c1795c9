"""A `Request`: one submitted call's sequences (one `sample` call, one HTTP request), its progress
listener, and how its caller waits for the rollouts.

The scheduler (scheduler.py) owns a request from `submit` until it ends: done, cancelled or failed.
A caller only reads it (`result`, `done`, `wait`, `num_tokens`) or asks to `cancel` it; the scheduler's
driver thread calls `_notify` after each round and `_finish` once at its end.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import Callable, Optional

from rollout_ssd.sequence import Sequence

log = logging.getLogger(__name__)

_ids = itertools.count(1)


class RequestCancelled(RuntimeError):
    """The request was cancelled before it finished."""


class Request:
    """One submitted call: its sequences, its progress listener, and how its caller waits.

    listener(request, finished) is called on the driver thread after every round in which the
    request's sequences emitted tokens (and right after the prefill that admits some of them, so a
    first token is not held for the round's decode step), and once more with finished=True when it
    ends (done, cancelled or failed). It must be quick and must not call back into the engine."""

    def __init__(self, seqs: list[Sequence], listener: Optional[Callable] = None, bar=None,
                 build: Optional[Callable] = None):
        self.id = next(_ids)
        self.seqs = seqs
        self.listener = listener
        self.bar = bar
        self.error: Optional[BaseException] = None
        self.cancelled = False
        self.submitted_at = time.perf_counter()
        self._build = build
        self._done = threading.Event()
        self._emitted = 0
        for s in seqs:
            s.request_id = self.id
        if not seqs:
            self._done.set()

    def cancel(self) -> None:
        """Ask the scheduler to drop this request; its slots are freed before the next round."""
        self.cancelled = True

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: Optional[float] = None) -> bool:
        return self._done.wait(timeout)

    def result(self, timeout: Optional[float] = None):
        """Block until done; return the rollouts (raises the error that ended it, RequestCancelled if
        cancelled, TimeoutError if not done in time)."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.id} not done after {timeout} s")
        if self.error is not None:
            raise self.error
        if self.cancelled and not all(s.finished and s.finish_reason != "abort" for s in self.seqs):
            raise RequestCancelled(f"request {self.id} was cancelled")
        return self._build(self.seqs) if self._build is not None else self.seqs

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    def _notify(self, finished: bool) -> None:
        emitted = self.num_tokens
        if self.bar is not None and emitted != self._emitted:
            rate = emitted / max(time.perf_counter() - self.submitted_at, 1e-9)
            self.bar.set_postfix_str(f"{rate:.0f} tok/s", refresh=False)
        if self.listener is not None and (finished or emitted != self._emitted):
            try:
                self.listener(self, finished)
            except Exception:  # a listener's failure must not break the other requests' rounds
                log.exception("request %d: listener failed", self.id)
        self._emitted = emitted

    def _finish(self, error: Optional[BaseException] = None) -> None:
        if self._done.is_set():
            return
        self.error = error
        for s in self.seqs:
            if not s.finished:
                s.finish_reason = "abort"
        self._done.set()
        self._notify(True)
        if self.bar is not None:
            self.bar.close()
