"""One forward of a batch, timed and then undone: how the SSD chooser measures a step that no round of
the plan running measures (AR's re-timing where it is not an AR round, the cap's one-core time where no
SD round verifies on that core; ssd/chooser.py)."""

from __future__ import annotations

from rollout_ssd.gpu.timing import DeviceTimer
from rollout_ssd.runner import ModelRunner
from rollout_ssd.sequence import Sequence


def timed_forward(runner: ModelRunner, running: list[Sequence], tokens: int = 1) -> float:
    """Seconds (device time on a GPU) of one forward of `tokens` tokens per sequence (1: an AR decode
    step, last rows' logits; more: a verify's shape, every row's logits), each within its room in the
    cache as its verify's chain would be (ssd/round.chain_lengths); the cache is rolled back after."""
    rows = [[s.last_token] * max(1, min(tokens, runner.max_len - (s.num_tokens - 1))) for s in running]
    timer = DeviceTimer(runner.device).start()
    runner.extend([s.slot for s in running], rows, last_only=tokens == 1)
    seconds = timer.stop()
    for seq in running:
        runner.rollback(seq.slot, seq.num_tokens - 1)
    return seconds
