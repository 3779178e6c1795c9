"""User-facing request parameters (docs/DESIGN.md): a `Prompt`, `SamplingParams` and the `Rollout` result."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Optional, Union

Prompt = Union[str, list[int]]  # text, or token ids


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. temperature 0 is greedy; top_k 0 and top_p 1 switch truncation off."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    seed: int = 0
    stop_token_ids: Optional[tuple[int, ...]] = None
    ignore_eos: bool = False
    chat: bool = False
    stop: Optional[tuple[str, ...]] = None  # stop strings (as vLLM's): the text ends before the first one

    def __post_init__(self):
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"SamplingParams.n must be an integer >= 1, got {self.n!r}")
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be an integer >= 0, got {self.top_k!r}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not isinstance(self.seed, int):
            raise ValueError(f"SamplingParams.seed must be an integer, got {self.seed!r}")
        if self.stop_token_ids is not None:
            ids = self.stop_token_ids
            if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
                raise ValueError(f"SamplingParams.stop_token_ids must be a sequence of token ids, got {ids!r}")
            ids = tuple(ids)
            if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in ids):
                raise ValueError(f"SamplingParams.stop_token_ids must be non-negative integers, got {ids!r}")
            object.__setattr__(self, "stop_token_ids", ids)
        if self.stop is not None:
            stop = (self.stop,) if isinstance(self.stop, str) else self.stop
            if not isinstance(stop, Iterable) or any(not isinstance(x, str) or not x for x in stop):
                raise ValueError(f"SamplingParams.stop must be non-empty strings, got {self.stop!r}")
            object.__setattr__(self, "stop", tuple(stop) or None)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class Rollout:
    """One generated sample. `logprobs[i]` = log softmax(target logits / T)[token_ids[i]] (T=1 if greedy)."""

    prompt_index: int
    sample_index: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    text: Optional[str]
    finish_reason: str  # "stop" | "length"
    weight_version: int = 0
    extra: dict = field(default_factory=dict)
