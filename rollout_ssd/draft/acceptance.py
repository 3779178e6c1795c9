"""How good a draft is for its target: the exact expected SD acceptance, and the decode-step cost ratio.

`measure_acceptance` lets the target sample continuations of held-out prompts (through the engine,
on_policy.sample_continuations), then scores every visited position with both models' distributions
there (one teacher-forced forward each, drift.visited_logits): at temperature T > 0 the probability
that min(1, p/q) accepts a draft token drawn from q_T, sum_x min(p_T(x), q_T(x)); for greedy,
P(argmax q == argmax p). Averaged per token, this is the expectation of spec/accept_rate (docs/DESIGN.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from rollout_ssd.draft.drift import visited_logits
from rollout_ssd.draft.on_policy import sample_continuations
from rollout_ssd.gpu.timing import DeviceTimer
from rollout_ssd.models.decoder import Decoder
from rollout_ssd.runner import ModelRunner

SCORED_SEQUENCES = 4  # sequences whose full-vocabulary logits are held at once while scoring


@dataclass
class Acceptance:
    temperature: float
    accept_rate: float   # mean expected per-token acceptance along the continuations
    positions: int
    sequences: int


def expected_acceptance(p_logits: torch.Tensor, q_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Per-row expected acceptance [N] of a draft token from q at `temperature`, logits [N, V]:
    T > 0: sum_x min(p_T(x), q_T(x)); T = 0: 1[argmax q == argmax p]."""
    if temperature <= 0:
        return (p_logits.argmax(-1) == q_logits.argmax(-1)).float()
    p = torch.softmax(p_logits.float() / temperature, -1)
    q = torch.softmax(q_logits.float() / temperature, -1)
    return torch.minimum(p, q).sum(-1)


@torch.no_grad()
def measure_acceptance(target: Decoder, draft: Decoder, prompt_ids: Sequence[Sequence[int]], temperature: float,
                       max_new_tokens: int = 128, batch_size: int = 16, seed: int = 1234) -> Acceptance:
    """Expected SD acceptance per draft token along continuations the target samples at `temperature`
    (see the module docstring). batch_size: sequences the target decodes together."""
    completions = sample_continuations(target, prompt_ids, [temperature] * len(prompt_ids), max_new_tokens,
                                       batch_size, seed)
    pairs = [(list(p), c) for p, c in zip(prompt_ids, completions) if c]
    total, count = 0.0, 0
    for start in range(0, len(pairs), SCORED_SEQUENCES):
        chunk = pairs[start:start + SCORED_SEQUENCES]
        hits = expected_acceptance(visited_logits(target, chunk), visited_logits(draft, chunk), temperature)
        total += float(hits.sum())
        count += len(hits)
    return Acceptance(temperature, total / max(count, 1), count, len(pairs))


@torch.no_grad()
def measure_cost(target: Decoder, draft: Decoder, batch_sizes: Sequence[int] = (1, 8), context: int = 128,
                 steps: int = 30) -> dict[int, dict[str, float]]:
    """Seconds per decode step of target and draft at each batch size (`context` tokens already cached),
    median over `steps` steps after a warm-up, and the ratio draft / target. Target and draft steps
    alternate, so load from other processes hits both alike. Each step is timed as device work
    (gpu/timing.DeviceTimer: CUDA events on a GPU, where perf_counter would time the launches)."""
    out = {}
    for b in batch_sizes:
        runners = {}
        for name, model in (("target", target), ("draft", draft)):
            runner = ModelRunner(model, b, context + steps + 8)
            slots = [runner.allocate() for _ in range(b)]
            runner.prefill(slots, [[1] * context for _ in range(b)])
            runners[name] = (runner, slots)
        times: dict[str, list[float]] = {"target": [], "draft": []}
        timers = {name: DeviceTimer(runner.device) for name, (runner, _) in runners.items()}
        for i in range(steps + 3):
            for name, (runner, slots) in runners.items():
                with timers[name]:
                    runner.decode(slots, [7 + i] * b)
                if i >= 3:
                    times[name].append(timers[name].seconds)
        med = {name: sorted(ts)[len(ts) // 2] for name, ts in times.items()}
        out[b] = {"target_s": med["target"], "draft_s": med["draft"], "ratio": med["draft"] / med["target"]}
    return out
