"""How much one round computes (`EngineConfig.max_round_rows`): which running sequences step, and how
many waiting ones it admits.

A round's cost grows with the rows it decodes (and a speculative round verifies K + 1 rows for each) and
with the prompts it prefills. A request that arrives while a large batch runs is admitted and prefilled
only between rounds, so its first token waits for the round in flight: on a CPU, a round of 60 sequences,
or one that admits 60 at once, can take several times a short request's whole time to first token. With
`max_round_rows` = B, a round admits at most B waiting sequences (the admission policy picks which, so a
newcomer goes first under "fair") and steps at most B of the running ones: the B that have waited longest
since they last stepped (ties: lower KV slot first), so each running sequence steps once every
ceil(running / B) rounds and a newcomer waits for at most one B-row round. This trades some of a large
batch's throughput (more, smaller rounds) for a bounded time to first token, as a token budget per step
does in vLLM. None (the default): every running sequence steps every round and every free slot is
filled at once.

Which round a sequence steps in never changes its law, and not its tokens either where the arithmetic does
not depend on the batch's shape: its randomness is its own (seed, prompt index, sample index), every
speculator catches a sequence up on the tokens it emitted while it sat out, and greedy is exact.
"""

from __future__ import annotations

from typing import Optional

from rollout_ssd.sequence import Sequence


class RoundBudget:
    def __init__(self, max_rows: Optional[int] = None):
        if max_rows is not None and (not isinstance(max_rows, int) or isinstance(max_rows, bool) or max_rows < 1):
            raise ValueError(f"max_round_rows must be an integer >= 1 or None, got {max_rows!r}")
        self.max_rows = max_rows
        self._round = 0
        self._last: dict[int, int] = {}  # id(sequence) -> the round it last stepped in

    def pick(self, running: list[Sequence]) -> list[Sequence]:
        """The running sequences that step this round, in `running`'s order."""
        if self.max_rows is None:  # no budget: nothing to keep per sequence
            return running
        self._round += 1
        if len(running) <= self.max_rows:
            chosen = running
        else:
            last = self._last
            order = sorted(range(len(running)), key=lambda i: (last.get(id(running[i]), 0), running[i].slot))
            keep = set(order[:self.max_rows])
            chosen = [seq for i, seq in enumerate(running) if i in keep]
        live = {id(seq) for seq in running}
        self._last = {key: r for key, r in self._last.items() if key in live}
        for seq in chosen:
            self._last[id(seq)] = self._round
        return chosen
