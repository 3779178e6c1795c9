"""Admission: which waiting sequences get the free KV slots at the start of a round
(`EngineConfig.admission`, `EngineConfig.reserved_slots`).

- "fifo": sequences in arrival order. A request of many sequences holds the head of the queue until
  all of them have a slot, so a request arriving behind it waits that long (head-of-line blocking).
- "fair": round-robin over requests. Each free slot goes to the waiting request that holds the fewest
  running sequences (ties: the earlier request), so a small request that arrives while a large one
  waits takes the next free slot, whatever the large one still has queued. With `reserved` > 0 the
  last `reserved` free slots go only to requests that hold no slot yet: however many sequences the
  running requests have, a newcomer's first sequence starts at the next round while a reserved slot
  is free. One request alone (one `sample` call) is admitted in its own order under both policies.
- a cap (`limit`: `EngineConfig.max_round_rows`) bounds the sequences one round admits; under "fair" a
  capped round that admits a newcomer (a request holding no slot) admits no sequence of a request that
  already runs, so the newcomer's prefill, which its first token waits for, is its own.

Which round a sequence starts in never changes its tokens: randomness is per sequence (seed, prompt
index, sample index), so a seeded request gets the same rollouts under either policy.
"""

from __future__ import annotations

import heapq
from collections import Counter, deque
from typing import Iterable, Optional

from rollout_ssd.sequence import Sequence

POLICIES = ("fair", "fifo")  # = config.ADMISSION
AUTO_RESERVE_SHARE = 16  # reserved_slots="auto": one slot in 16 (at least one) is kept for newcomers


def resolve_reserved(reserved, num_slots: int) -> int:
    """The number of reserved slots: an int as given, "auto" = max(1, num_slots // 16); never all of them."""
    if reserved == "auto":
        reserved = max(1, num_slots // AUTO_RESERVE_SHARE)
    return max(0, min(int(reserved), num_slots - 1))


class Admission:
    """The waiting sequences, one queue per request (in arrival order), and the policy that picks."""

    def __init__(self, policy: str = "fair", reserved: int = 0):
        if policy not in POLICIES:
            raise ValueError(f"admission policy must be one of {POLICIES}, got {policy!r}")
        self.policy = policy
        self.reserved = reserved if policy == "fair" else 0
        self._queues: dict[int, deque[Sequence]] = {}
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def __iter__(self):
        for queue in self._queues.values():
            yield from queue

    def add(self, seqs: Iterable[Sequence]) -> None:
        for seq in seqs:
            self._queues.setdefault(seq.request_id, deque()).append(seq)
            self._count += 1

    def drop(self, request_ids: set[int]) -> None:
        for rid in request_ids:
            queue = self._queues.pop(rid, None)
            if queue is not None:
                self._count -= len(queue)

    def clear(self) -> None:
        self._queues.clear()
        self._count = 0

    def take(self, free: int, running: list[Sequence], limit: Optional[int] = None) -> list[Sequence]:
        """The sequences to admit into `free` slots now, at most `limit` of them (None: no limit), in
        admission order (removed from the queue)."""
        limit = free if limit is None else min(free, limit)
        out = self._fifo(limit) if self.policy == "fifo" else self._fair(free, running, limit)
        self._count -= len(out)
        return out

    def _fifo(self, free: int) -> list[Sequence]:
        out = []
        while free > len(out) and self._queues:
            rid, queue = next(iter(self._queues.items()))
            while queue and free > len(out):
                out.append(queue.popleft())
            if not queue:
                del self._queues[rid]
        return out

    def _fair(self, free: int, running: list[Sequence], limit: int) -> list[Sequence]:
        held = Counter(s.request_id for s in running)
        heap = [(held[rid], rid) for rid in self._queues]  # request ids grow with arrival
        heapq.heapify(heap)
        out = []
        newcomers = False
        while free > 0 and heap and len(out) < limit:
            count, rid = heapq.heappop(heap)
            if count > 0 and free <= self.reserved:
                break  # the rest are reserved for newcomers; every request left holds a slot too
            if held[rid] > 0 and newcomers and limit < free:
                break  # a capped round that admits newcomers admits only them: their prefill stays short
            newcomers = newcomers or held[rid] == 0
            queue = self._queues[rid]
            out.append(queue.popleft())
            free -= 1
            if queue:
                heapq.heappush(heap, (count + 1, rid))
            else:
                del self._queues[rid]
        return out
