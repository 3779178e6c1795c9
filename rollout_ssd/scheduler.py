"""The engine's loop: requests in, rounds run, finished sequences out (continuous batching).

A `Request` is one call's sequences (one `sample` call, one HTTP request). Requests may be submitted
from any thread at any time; each round the scheduler takes the new ones into its waiting queue,
drops cancelled ones (freeing their slots), applies weight updates (between rounds only), admits and
prefills waiting sequences into free KV slots, advances every running sequence by one round of the
decode strategy, and retires the finished ones. So a request that arrives while a batch runs joins
it at the next round, and the strategy always sees the live batch.

One thread drives the loop at a time: a `sample` caller drives it inline when no one else does
(exceptions then surface in that caller, as a plain blocking call would), otherwise the background
driver started by `start()` does. Randomness is per sequence ((seed, prompt index, sample index)), so
what a request gets never depends on which other requests shared its rounds.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from typing import Callable, Optional

from rollout_ssd.sequence import Sequence

log = logging.getLogger(__name__)

_ids = itertools.count(1)


class RequestCancelled(RuntimeError):
    """The request was cancelled before it finished."""


class Request:
    """One submitted call: its sequences, its progress listener, and how its caller waits.

    listener(request, finished) is called on the driver thread after every round in which the
    request's sequences emitted tokens, and once more with finished=True when it ends (done,
    cancelled or failed). It must be quick and must not call back into the engine."""

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


class Scheduler:
    """Waiting / running sequences over a runner's KV slots, driven one round at a time.

    The engine hands it its pieces as callables so that this module owns the loop and nothing else:
    between_rounds(running) applies queued weight updates; prefill(seqs) -> tokens emitted;
    step(running) -> tokens emitted (the decode strategy's round); release(seq) frees a slot;
    version() is the weight version now served; add_time(seconds, tokens) records a busy period."""

    def __init__(self, runner, *, between_rounds: Callable, prefill: Callable, step: Callable,
                 release: Callable, version: Callable[[], int], add_time: Callable):
        self.runner = runner
        self._between_rounds = between_rounds
        self._prefill = prefill
        self._step = step
        self._release = release
        self._version = version
        self._add_time = add_time
        self._cond = threading.Condition()
        self._inbox: deque[Request] = deque()
        self._live: dict[int, Request] = {}
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._driving = False
        self._paused = False
        self._closed = False
        self._thread: Optional[threading.Thread] = None

    # ------------------------------------------------------------------ callers' side
    def submit(self, request: Request) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError("RolloutEngine is closed")
            self._inbox.append(request)
            self._cond.notify_all()

    def run(self, request: Request) -> None:
        """Submit and wait for it; drive the loop on this thread if no one else does."""
        self.submit(request)
        if self._claim():
            self._drive(inline=True)
        try:
            while not request.wait(0.1):
                if self._claim():  # the driver stopped (failed or closed) with our request queued
                    self._drive(inline=True)
        except BaseException:
            request.cancel()
            self._wake()
            raise

    def start(self) -> None:
        """Start the background driver (idempotent): submitted requests are then served without a caller
        blocking in `sample`."""
        with self._cond:
            if self._thread is not None or self._closed:
                return
            self._thread = threading.Thread(target=self._serve, name="rollout-ssd-scheduler", daemon=True)
            self._thread.start()

    def pause(self) -> None:
        """Stop starting rounds; running sequences keep their KV and resume where they were."""
        with self._cond:
            self._paused = True

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def driving(self) -> bool:
        """Whether a driver is running rounds now (updates then wait for the next round)."""
        return self._driving

    def when_idle(self, fn: Callable[[], None]) -> bool:
        """Run fn now if no driver is running rounds (so it cannot land inside one); False otherwise (the
        driver then does it between rounds)."""
        with self._cond:
            if self._driving:
                return False
            fn()
            return True

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def counts(self) -> dict:
        with self._cond:
            waiting = len(self.waiting) + sum(len(r.seqs) for r in self._inbox)
            return {"running": len(self.running), "waiting": waiting, "requests": len(self._live) + len(self._inbox)}

    def close(self) -> None:
        """Stop the background driver and end every live request (cancelled)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        with self._cond:
            for req in list(self._live.values()) + list(self._inbox):
                req.cancel()
            if not self._driving:
                self._drop_cancelled()
                for req in self._inbox:
                    req._finish(RequestCancelled(f"request {req.id}: the engine closed"))
                self._inbox.clear()

    # ------------------------------------------------------------------ the loop
    def _claim(self) -> bool:
        with self._cond:
            if self._driving or self._thread is not None and not self._closed:
                return False
            self._driving = True
            return True

    def _stop_driving(self) -> None:
        """(Under the lock.) This driver is done; wake the background driver or a waiting caller."""
        self._driving = False
        self._cond.notify_all()

    def _serve(self) -> None:
        while True:
            with self._cond:
                while not (self._closed or self._inbox or self._live):
                    self._cond.wait()
                if self._closed:
                    return
                if self._driving:  # an inline driver is running; it notifies when it stops
                    self._cond.wait()
                    continue
                self._driving = True
            try:
                self._drive(inline=False)
            except Exception:
                log.exception("scheduler: a round failed; its requests were ended with the error")

    def _drive(self, inline: bool) -> None:
        """Run rounds until no request is left (or, for the background driver, the engine closes)."""
        start, produced = time.perf_counter(), 0
        try:
            while True:
                with self._cond:
                    self._take_inbox()
                    if self._paused and not self._closed:
                        self._cond.wait(0.02)
                        paused = True
                    else:
                        paused = False
                    idle = not self._live or (self._closed and not inline)
                if idle:
                    self._between_rounds([])  # updates queued during the last round apply now
                    with self._cond:
                        self._take_inbox()
                        if not self._live or self._closed:
                            self._stop_driving()
                            break
                    continue
                if paused:
                    self._drop_cancelled()
                    self._between_rounds(self.running)
                    continue
                produced += self._round()
        except BaseException as err:
            with self._cond:
                self._take_inbox()
                self._fail_all(err)
                self._stop_driving()
            raise
        finally:
            if produced:
                self._add_time(time.perf_counter() - start, produced)

    def _round(self) -> int:
        self._drop_cancelled()
        self._between_rounds(self.running)
        produced = 0
        admitted = []
        while self.waiting and self.runner.cache.num_free > 0:
            seq = self.waiting.popleft()
            seq.slot = self.runner.allocate()
            admitted.append(seq)
        if admitted:
            self.running.extend(admitted)  # before the prefill, so a failure in it releases them too
            produced += self._prefill(admitted)
        self._retire()
        if self.running:
            produced += self._step(self.running)
            self._retire()
        for req in list(self._live.values()):
            if all(s.finished for s in req.seqs):
                del self._live[req.id]
                req._finish()
            else:
                req._notify(False)
        return produced

    def _take_inbox(self) -> None:
        while self._inbox:
            req = self._inbox.popleft()
            self._live[req.id] = req
            self.waiting.extend(req.seqs)

    def _retire(self) -> None:
        version = self._version()
        still = []
        for seq in self.running:
            seq.versions.add(version)
            if seq.finished:
                self._release(seq)
                bar = self._live[seq.request_id].bar if seq.request_id in self._live else None
                if bar is not None:
                    bar.update(1)
            else:
                still.append(seq)
        self.running = still

    def _drop_cancelled(self) -> None:
        gone = {rid for rid, req in self._live.items() if req.cancelled}
        if not gone:
            return
        self.waiting = deque(s for s in self.waiting if s.request_id not in gone)
        for seq in self.running:
            if seq.request_id in gone:
                self._release(seq)
        self.running = [s for s in self.running if s.request_id not in gone]
        for rid in gone:
            req = self._live.pop(rid)
            req._finish()

    def _fail_all(self, err: BaseException) -> None:
        for seq in self.running:
            try:
                self._release(seq)
            except Exception:  # releasing after a failed round is best effort; report the round's error
                log.exception("scheduler: releasing slot %d after a failure", seq.slot)
        self.running = []
        self.waiting.clear()
        for req in self._live.values():
            req._finish(err)
        self._live.clear()
