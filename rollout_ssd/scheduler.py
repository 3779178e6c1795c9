"""The engine's loop: requests in, rounds run, finished sequences out (continuous batching).

A `Request` (request.py) is one call's sequences (one `sample` call, one HTTP request). Requests may be submitted
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

import json
import logging
import os
import threading
import time
from collections import deque
from typing import Callable, Optional

from rollout_ssd.admission import Admission
from rollout_ssd.decode import DecodeStrategy, sample_rows
from rollout_ssd.metrics import EngineMetrics
from rollout_ssd.request import Request, RequestCancelled
from rollout_ssd.round_budget import RoundBudget
from rollout_ssd.runner import ModelRunner
from rollout_ssd.sequence import Sequence

log = logging.getLogger(__name__)

TRACE_ENV = "ROLLOUT_SSD_ROUND_TRACE"


class RoundTrace:
    """One JSON line per round to the file named by $ROLLOUT_SSD_ROUND_TRACE (off when unset): when the
    round started (epoch seconds, to line up with a client's clock) and what it did: seconds in all and in
    its prefill, sequences admitted and their prompt tokens, the requests they came from, rows stepped,
    running and waiting sequences, tokens emitted. For finding where a latency goes (docs/serving.md)."""

    def __init__(self, path: str):
        self._file = open(path, "a", buffering=1)

    @classmethod
    def from_env(cls) -> Optional["RoundTrace"]:
        path = os.environ.get(TRACE_ENV)
        return cls(path) if path else None

    def write(self, row: dict) -> None:
        self._file.write(json.dumps(row) + "\n")

    def flush(self) -> None:
        self._file.flush()


class Scheduler:
    """Waiting / running sequences over a runner's KV slots, driven one round at a time.

    The loop's phases, each a method: take new requests in, drop cancelled ones, apply queued weight
    updates (`apply_updates`, the between-rounds hook), admit waiting sequences into free slots and
    prefill them (`_admit`, `_prefill`), one round of the decode strategy, retire finished sequences
    (`_retire`) and release their slots (`_release`).
    strategy() is the engine's decode strategy (looked up each round); updates() applies queued weight
    updates and returns whether the target's weights changed; version() is the target weight version
    served now; stats receives prefill and busy time; admission picks which waiting sequences get the
    free slots (admission.py; default: fair, no reserved slots); budget picks which running sequences step
    in a round (round_budget.py; default: all)."""

    def __init__(self, runner: ModelRunner, strategy: Callable[[], DecodeStrategy], stats: EngineMetrics, *,
                 updates: Callable[[], bool], version: Callable[[], int], admission: Optional[Admission] = None,
                 budget: Optional[RoundBudget] = None):
        self.runner = runner
        self._strategy = strategy
        self._stats = stats
        self._updates = updates
        self._version = version
        self._cond = threading.Condition()
        self._inbox: deque[Request] = deque()
        self._live: dict[int, Request] = {}
        self.waiting = admission if admission is not None else Admission()
        self.budget = budget if budget is not None else RoundBudget()
        self.running: list[Sequence] = []
        self._driving = False
        self._paused = False
        self._closed = False
        self._thread: Optional[threading.Thread] = None
        self._trace = RoundTrace.from_env()
        self._admitted: tuple[list[Sequence], float] = ([], 0.0)  # the round's admissions, prefill seconds

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
        if self._trace is not None:
            self._trace.flush()
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
                    with self._cond:
                        self._take_inbox()
                        if not self._live or self._closed:
                            # updates queued during the last round apply now, under the lock: one queued
                            # after this point finds no driver (`when_idle`) and is applied by its sender
                            self.apply_updates([])
                            self._stop_driving()
                            break
                    continue  # new requests arrived: the next round applies pending updates first
                if paused:
                    self._drop_cancelled()
                    self.apply_updates(self.running)
                    continue
                t0 = time.perf_counter()
                emitted = self._round()
                self._stats.end_round(time.perf_counter() - t0, emitted)  # per live batch (metrics.py)
                produced += emitted
        except BaseException as err:
            with self._cond:
                self._take_inbox()
                self._fail_all(err)
                self._stop_driving()
            raise
        finally:
            self._strategy().on_idle()  # in the driving thread, which the rounds ran in
            if produced:
                self._stats.add_time(time.perf_counter() - start, produced)

    def _round(self) -> int:
        """One round, phase by phase; returns the tokens it emitted."""
        trace = self._trace
        if trace is not None:
            start, t0 = time.time(), time.perf_counter()
            self._admitted = ([], 0.0)
        self._drop_cancelled()
        self.apply_updates(self.running)
        produced = self._admit()
        self._retire()
        if produced:  # the admitted sequences' first tokens (from the prefill) reach listeners now
            self._report()
        stepped = []
        if self.running:
            stepped = self.budget.pick(self.running)
            produced += self._strategy().step(stepped)
            self._retire()
        self._report()
        if trace is not None:
            admitted, prefill_s = self._admitted
            trace.write({"t": start, "round_s": time.perf_counter() - t0, "prefill_s": prefill_s,
                         "admitted": len(admitted), "admitted_tokens": sum(len(s.prompt_token_ids) for s in admitted),
                         "admitted_requests": sorted({s.request_id for s in admitted}), "stepped": len(stepped),
                         "running": len(self.running), "waiting": len(self.waiting), "emitted": produced})
        return produced

    # ------------------------------------------------------------------ the phases
    def apply_updates(self, running: list[Sequence]) -> None:
        """Apply queued weight updates (between rounds only). Running sequences' target KV was computed
        under the old weights, so it is recomputed under the new ones: each later token is then verified
        under exactly the version its rollout reports."""
        if not self._updates():
            return
        self._strategy().on_weights_changed()
        if running:
            for seq in running:
                self.runner.rollback(seq.slot, 0)
            self.runner.prefill([s.slot for s in running], [s.all_token_ids[:-1] for s in running])

    def _admit(self) -> int:
        """Give waiting sequences the free KV slots and prefill them; returns the tokens they emitted."""
        admitted = self.waiting.take(self.runner.cache.num_free, self.running, self.budget.max_rows)
        for seq in admitted:
            seq.slot = self.runner.allocate()
        if not admitted:
            return 0
        self.running.extend(admitted)  # before the prefill, so a failure in it releases them too
        return self._prefill(admitted)

    def _prefill(self, seqs: list[Sequence]) -> int:
        """One ragged prefill of the admitted prompts; each sequence's first token is sampled from its
        prefill logits."""
        t0 = time.perf_counter()
        strategy = self._strategy()
        strategy.before_prefill(seqs)
        logits = self.runner.prefill([s.slot for s in seqs], [s.prompt_token_ids for s in seqs])
        strategy.on_admit(seqs)
        tokens, logprobs = sample_rows(seqs, logits)
        produced = sum(s.append([t], [lp]) for s, t, lp in zip(seqs, tokens, logprobs))
        self._stats.add_prefill(time.perf_counter() - t0, produced)
        if self._trace is not None:
            self._admitted = (list(seqs), time.perf_counter() - t0)
        return produced

    def _release(self, seq: Sequence) -> None:
        if seq.slot >= 0:
            self._strategy().on_release(seq)
            self.runner.free(seq.slot)
            seq.slot = -1

    def _report(self) -> None:
        """End the requests whose sequences all finished; tell the others' listeners of progress."""
        for req in list(self._live.values()):
            if all(s.finished for s in req.seqs):
                del self._live[req.id]
                req._finish()
            else:
                req._notify(False)

    def _take_inbox(self) -> None:
        while self._inbox:
            req = self._inbox.popleft()
            self._live[req.id] = req
            self.waiting.add(req.seqs)

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
        self._compact()

    def _compact(self) -> None:
        """Keep the running sequences' slots one run from 0: attention then reads each layer's cache as a
        view (`Decoder.forward`), where the holes finished sequences leave would make every layer of
        every step gather the rows. A sequence above the run moves into a hole (its KV copied once);
        slots are allocated lowest first, so admissions fill holes themselves."""
        n = len(self.running)
        for seq in self.running:
            if seq.slot >= n:
                seq.slot = self.runner.move_down(seq.slot)

    def _drop_cancelled(self) -> None:
        gone = {rid for rid, req in self._live.items() if req.cancelled}
        if not gone:
            return
        self.waiting.drop(gone)
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
